"""lowprec under DeepSpeed ZeRO 1/2/3 through Accelerate's DeepSpeed plugin: two CPU processes (gloo).

One torchrun launch of tests/distributed/deepspeed_train.py per ZeRO stage (DeepSpeed's CPU
accelerator). What DeepSpeed can host works, FP8 really active; what it cannot is refused with a
message naming the combination and what to use instead.
"""

from __future__ import annotations

import os

import pytest
from conftest import scenario_ranks as ranks

pytestmark = pytest.mark.slow
pytest.importorskip("deepspeed")
pytest.importorskip("torchao")

SCRIPT = os.path.join(os.path.dirname(__file__), "distributed", "deepspeed_train.py")
WORKING = ["torchao", "optimizer_states_fp8", "comm_fp32"]


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda s: f"zero{s}")
def run(request, tmp_path_factory):
    from conftest import run_two_ranks

    stage = request.param
    result = run_two_ranks(SCRIPT, str(stage), out=tmp_path_factory.mktemp(f"zero{stage}") / "result.json",
                           timeout=600, DS_ACCELERATOR="cpu", ACCELERATE_USE_DEEPSPEED="true")
    assert result["stage"] == stage and result["world_size"] == 2
    return result


@pytest.mark.parametrize("name", WORKING)
def test_fp8_is_active_under_zero(run, name):
    for r in ranks(run, name):
        assert r["engine"] == "deepspeed" and r["wrapped"] == "DeepSpeedEngine"
        assert r["zero_stage"] == run["stage"]
        assert r["fp8_linears"] == 3 and r["fp8_forward_calls"] == 3 * 10  # every Linear, every step


@pytest.mark.parametrize("name", WORKING)
def test_loss_falls_and_replicated_weights_agree(run, name):
    a, b = ranks(run, name)
    for r in (a, b):
        assert sum(r["losses"][-3:]) < 0.75 * sum(r["losses"][:3]), r["losses"]
    if run["stage"] < 3:
        assert a["params"] == b["params"]  # DeepSpeed averaged the gradients: the same weights everywhere


def test_optimizer_states_are_honoured_inside_the_zero_optimizer(run):
    for r in ranks(run, "optimizer_states_fp8"):
        assert r["optimizer"] == "LowBitAdamW"
        assert r["zero_optimizer"].startswith("DeepSpeedZeroOptimizer")
    plain = ranks(run, "torchao")[0]["losses"]
    fp8_states = ranks(run, "optimizer_states_fp8")[0]["losses"]
    assert plain != fp8_states and max(abs(x - y) for x, y in zip(plain, fp8_states)) < 0.05


def test_grad_comm_dtype_sets_deepspeeds_communication_data_type(run):
    for r in ranks(run, "comm_fp32"):
        assert r["communication_data_type"] == "fp32" and r["engine_communication_data_type"] == "torch.float32"
        assert r["grad_comm"] == "FP32"
    for r in ranks(run, "torchao"):
        assert r["communication_data_type"] is None and r["engine_communication_data_type"] == "torch.bfloat16"
        assert r["grad_comm"] == "BF16"  # the plan says what DeepSpeed does by default


@pytest.mark.parametrize("name", WORKING)
def test_checkpoint_resumes_exactly_and_loads_into_the_plain_model(run, name):
    for r in ranks(run, name):
        assert r["resumed"] == r["continued"]  # save_state/load_state: the same next losses, bit for bit
    # get_state_dict(unwrap=True) loaded with strict=True into the unconverted nn.Sequential on rank 0
    rank0 = ranks(run, name)[0]
    assert rank0["state_dict_keys"] == sorted(f"{i}.{p}" for i in (0, 2, 4) for p in ("bias", "weight"))
    assert rank0["plain_output_norm"] > 0


@pytest.mark.parametrize("name, message", [
    ("comm_fp8", "grad_comm_dtype='fp8' cannot be honoured under DeepSpeed.*DDP/FSDP2"),
    ("O1", "opt_level='O1'.*not under deepspeed"),
    ("msamp", "backend 'msamp'.*engine 'deepspeed' is not supported.*backend='te' / 'torchao'"),
])
def test_what_deepspeed_cannot_host_is_refused(run, name, message):
    import re

    scenario = run["scenarios"][name]
    assert scenario.get("error", "").startswith("BackendUnavailableError"), scenario
    assert re.search(message, scenario["error"]), scenario["error"]


def test_te_recipe_is_honoured_under_deepspeed(run):
    # TransformerEngine's test double on an assumed H100: every training forward ran inside lowprec's
    # te.autocast with the DelayedScaling recipe asked for, which Accelerate's own TE path leaves out
    # under DeepSpeed; the weights stay in step across ranks (stage 1/2) and the loss falls.
    a, b = ranks(run, "te")
    for r in (a, b):
        assert r["fp8_linears"] == 3 and r["fp8_forward_calls"] == 30
        assert r["te_autocast_forwards"] == 10 and r["te_recipes"] == ["DelayedScaling"]
        assert r["te_reduce_amax"] == [True]  # reduce_amax unset: on, as TE's own default
        assert sum(r["losses"][-3:]) < 0.75 * sum(r["losses"][:3])
    if run["stage"] < 3:
        assert a["params"] == b["params"]


def _o3(run):
    if run["stage"] == 3:
        pytest.skip("O3 runs under ZeRO-1/2 (ZeRO-3 is refused: test_o3_under_zero3_names_what_to_use)")
    return ranks(run, "O3")


def test_o3_keeps_fp8_weights_and_owner_masters_beside_deepspeed(run):
    # MS-AMP's O3 (reference/msamp.md 1.7, 2.3): E4M3 weights with one scale per tensor on every rank,
    # FP16 masters with E4M3+FP16 Adam states on one rank per whole tensor, FP8 weight gradients
    a, b = _o3(run)
    for r in (a, b):
        o3 = r["o3"]
        assert r["fp8_forward_calls"] == 3 * 10 and o3["layers"] == 3
        assert o3["weight_types"] == ["FP8GatheredWeight torch.float8_e4m3fn"]
        assert o3["grad_dtypes"] == ["torch.float8_e4m3fn"]
        assert o3["master_dtypes"] == ["torch.float16"]
        assert o3["state_types"] == ["exp_avg torch.float8_e4m3fn", "exp_avg_sq torch.float16"]
        # DeepSpeed's ZeRO optimizer holds the biases only
        assert o3["deepspeed_numel"] == o3["model_numel"] - o3["params"]
        assert o3["bytes"]["weight"] == o3["bytes"]["grad"] == o3["params"]  # 1 byte each, every rank
        assert o3["plan_rows"]["weight"].startswith("FP8 E4M3 (Linear, every rank)")
        assert o3["plan_rows"]["grad_comm"].startswith("FP8 E4M3, shared scale (Linear)")
    assert a["o3"]["owners"] == b["o3"]["owners"] and set(a["o3"]["owners"]) == {0, 1}
    assert sorted(a["o3"]["owned"] + b["o3"]["owned"]) == [0, 1, 2]  # each master on exactly one rank
    # over both ranks: one FP16 master (2 bytes) and one pair of states (1 + 2 bytes, plus scales) per parameter
    params = a["o3"]["params"]
    assert a["o3"]["bytes"]["master"] + b["o3"]["bytes"]["master"] == 2 * params
    assert 3 * params <= a["o3"]["bytes"]["optimizer_states"] + b["o3"]["bytes"]["optimizer_states"] < 3 * params + 64
    # after every step the owners broadcast the new FP8 weights: identical on every rank, as are the masters
    assert a["params"] == b["params"] and a["o3"]["masters_digest"] == b["o3"]["masters_digest"]


def test_o3_under_zero_gives_every_rank_the_same_delayed_scales(run):
    """Each rank trains on its own rows, so its own amaxes differ; reduce_amax (on by default) all-reduces them
    after every step (from after_backward, where O3 steps under DeepSpeed): the same windows and input /
    output-gradient scales on both ranks."""
    a, b = _o3(run)
    assert a["o3"]["reduce_amax"] is True and a["o3"]["amax_reduction"] is True
    assert a["o3"]["amax_windows"] == b["o3"]["amax_windows"]
    assert a["o3"]["delayed_scales"] == b["o3"]["delayed_scales"]
    assert all(v > 0 for layer in a["o3"]["amax_windows"] for row in layer for v in row[:9])  # 10 steps recorded


def test_o3_under_zero_trains_like_o2_on_one_process(run):
    a, b = _o3(run)
    o3 = [(x + y) / 2 for x, y in zip(a["losses"], b["losses"])]  # the global batch's loss
    o2, fp32 = a["o2_single"], a["fp32_single"]
    assert o3[-1] < 0.7 * o3[0]
    for x, y, z in zip(o3, o2, fp32):
        # same FP8 GEMMs and states; the FP8 gradient average and DeepSpeed's BF16 biases differ
        assert abs(x - y) / y < 0.02, (o3, o2)
        assert abs(x - z) / z < 0.03, (o3, fp32)


def test_o3_accumulates_micro_batches_like_one_batch(run):
    # two micro-batches per step under accelerator.accumulate (DeepSpeed's gradient_accumulation_steps=2):
    # FP8 gradients accumulate on the layers and the masters step once, at the boundary
    for r in _o3(run):
        assert len(r["accumulated"]) == len(r["losses"])
        for x, y in zip(r["accumulated"], r["losses"]):
            assert abs(x - y) / y < 0.02, (r["accumulated"], r["losses"])


def test_o3_checkpoints_carry_the_masters(run):
    a, b = _o3(run)
    for r in (a, b):
        assert r["resumed"] == r["continued"]  # masters and states restored exactly by load_state
        # get_state_dict exports the FP16 masters (gathered from their owners), not the E4M3 weights
        assert r["o3"]["export_minus_master"] == 0 and r["o3"]["export_minus_fp8"] > 0
        # the learning rate a scheduler sets after the resume reaches the masters (load_state gives the optimizer new
        # group dicts: O3 read the old ones until 2026-11-29, and kept the rate they had at the load)
        assert r["o3_lr_after_resume"] and set(r["o3_lr_after_resume"]) == {1.25e-3}
    assert a["state_dict_keys"] == sorted(f"{i}.{p}" for i in (0, 2, 4) for p in ("bias", "weight"))


def test_fp8_activations_under_zero_train_like_high_precision_ones_and_resume(run):
    # activation_dtype='fp8' (issue 32) under every ZeRO stage: what the forward saves is stored in E4M3, the
    # run follows the one without (0.4% per step measured), the ranks agree and a checkpoint resumes exactly
    fp8, plain = ranks(run, "fp8_activations"), ranks(run, "torchao")
    for r, p in zip(fp8, plain):
        assert r["packed_elements"] > 0 and p["packed_elements"] == 0
        assert r["fp8_forward_calls"] == 3 * 10
        assert r["losses"] == pytest.approx(p["losses"], rel=0.02) and r["losses"] != p["losses"]
        assert r["resumed"] == r["continued"]
    if run["stage"] < 3:
        assert fp8[0]["params"] == fp8[1]["params"]


def test_o3_with_compiled_layers_trains_and_resumes_as_with_eager_ones(run):
    # compile_fp8_layers under DeepSpeed (the default on FP8 GPUs): the compiled layers read the stored E4M3
    # weights and write FP8 gradients that the owners step from, as eager ones do
    eager = _o3(run)  # skipped under ZeRO-3, which refuses O3
    a, b = ranks(run, "O3_compiled")
    for r, e in zip((a, b), eager):
        assert r["compiled_layers"] == 3 and e["compiled_layers"] == 0
        assert r["fp8_forward_calls"] == 3 * 10
        assert r["losses"] == pytest.approx(e["losses"], rel=1e-3)
        assert r["resumed"] == r["continued"]
    assert a["params"] == b["params"]


def test_o3_under_zero3_names_what_to_use(run):
    if run["stage"] != 3:
        pytest.skip("ZeRO-3 only")
    error = run["scenarios"]["O3"]["error"]
    assert error.startswith("ValueError") and "zero_stage=3" in error and "FSDP2" in error and "1 or 2" in error


def test_o3_weights_keep_their_optimizer_groups_hyper_parameters(run):
    if run["stage"] == 3:
        pytest.skip("O3 runs under ZeRO-1/2")
    for r in ranks(run, "O3_groups"):
        assert r["o3_group_weight_decay"] == [0.1]  # the weights' group, not the biases' (0.0) nor the default
        assert r["resumed"] == r["continued"] and sum(r["losses"][-3:]) < 0.75 * sum(r["losses"][:3])
    for r in ranks(run, "O3"):
        assert r["o3_group_weight_decay"] == [0.01]  # AdamW's default


def test_o3_refuses_to_leave_an_optimizer_group_empty(run):
    if run["stage"] == 3:
        pytest.skip("ZeRO-3 is refused before the groups are looked at")
    error = run["scenarios"]["O3_weights_group"]["error"]
    assert error.startswith("ValueError") and "param group(s) [0] empty" in error and "LR scheduler" in error


def test_nothing_of_a_finished_run_outlives_accelerates_free_memory(run):
    # DeepSpeed's engine holds its model until destroyed, which Accelerate's free_memory() does (as it tells users to
    # between two trainings); after it, nothing lowprec installed may keep a parameter or the optimizer alive
    if run["stage"] == 3:
        pytest.skip("ZeRO-3 keeps the model alive after free_memory() without lowprec too (plain Accelerate, BF16, "
                    "a three-layer model on two CPU ranks: every parameter outlived its run, 2026-11-29)")
    ran = [name for name, s in run["scenarios"].items() if "ranks" in s]
    assert "torchao" in ran
    outlived = {name: [r["outlived"] for r in run["scenarios"][name]["ranks"]] for name in ran}
    assert all(o == [[], []] for o in outlived.values()), outlived
