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
        assert sum(r["losses"][-3:]) < 0.75 * sum(r["losses"][:3])
    if run["stage"] < 3:
        assert a["params"] == b["params"]
