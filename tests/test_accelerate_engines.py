"""lowprec.Accelerator through Accelerate's own FSDP2 and DDP preparation on two CPU processes
(tests/distributed/accelerate_engines.py): the optimizer each backend ends with steps every parameter of the
model, the FP8 Linears' weights among them, no gradient outlives `zero_grad`, `save_state` / `load_state` resume
exactly, and nothing of a finished run outlives it. te runs TE's stand-in (tests/backends/fake_te.py) as on an H100."""

from __future__ import annotations

import os

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "distributed", "accelerate_engines.py")
FSDP2 = ("msamp_O3", "msamp_O3_act8", "msamp_O3_act8_ac", "msamp_O3_fp8_comm", "msamp_O3_accumulate", "msamp_O3_ac",
         "torchao", "torchao_act8_ac", "torchao_bf16_states", "torchao_accumulate", "torchao_full_state_bf16_states",
         "te", "te_delayed", "te_full_state", "te_fp8_weights", "te_fp8_weights_full_state",
         "te_full_state_into_fp8_weights", "te_fp8_weights_full_state_out", "te_fp8_weights_full_state_out_bf16_states",
         "torchao_act8_compiled", "torchao_act8_compiled_in_graph")
DDP = ("ddp_msamp_O1", "ddp_msamp_O2", "ddp_msamp_O2_act8", "ddp_msamp_O2_fp8_comm", "ddp_torchao", "ddp_torchao_O2",
       "ddp_torchao_act8", "ddp_te", "ddp_te_fp8_weights", "ddp_te_into_fp8_weights",
       "ddp_te_fp8_weights_out")
SCENARIOS = FSDP2 + DDP
# TE's stand-in has no FusedAdam step (TE's is a CUDA kernel)
NO_STEP = ("te_fp8_weights", "te_fp8_weights_full_state", "ddp_te_fp8_weights", "te_fp8_weights_full_state_out",
           "te_fp8_weights_full_state_out_bf16_states", "ddp_te_fp8_weights_out")
STEPS_BEFORE_SAVE = 4  # accelerate_engines.STEPS


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    pytest.importorskip("torchao")
    from conftest import run_two_ranks

    return run_two_ranks(SCRIPT, ",".join(SCENARIOS), out=tmp_path_factory.mktemp("accelerate_engines") / "r.json",
                         timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("name", SCENARIOS)
def test_every_parameter_is_in_the_optimizer_after_accelerates_preparation(ranks, name):
    for rank in ranks:
        r = rank[name]
        assert "error" not in r, r.get("traceback")
        if name in FSDP2:
            assert r["engine"] == "fsdp2" and r["model"].startswith("FSDP")
        else:
            assert r["engine"] == "ddp" and r["model"] == "DistributedDataParallel"
        assert r["fp8_linears"] > 0
        # TE's FP8-only weights went back into group dicts AcceleratedOptimizer had replaced (until 2026-11-29):
        # here 0 of 15, and on the GPU no TE Linear trained under FSDP2
        assert r["fp8_weights_in_optimizer"] == r["fp8_linears"]
        assert r["params_in_optimizer"] == r["params"]


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in SCENARIOS if n not in NO_STEP])
def test_every_fp8_weight_trains_and_no_gradient_outlives_zero_grad(ranks, name):
    for rank in ranks:
        r = rank[name]
        assert r["fp8_weights_moved"] == r["fp8_linears"], r
        assert r["grads_after_zero_grad"] == 0, r
        assert r["losses"][-1] < r["losses"][0], r


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in SCENARIOS if n not in NO_STEP])
def test_save_state_resumes_exactly_and_exports_a_plain_checkpoint(ranks, name):
    # Under FSDP2 Accelerate's save_state/load_state go through torch.distributed.checkpoint. Until 2026-11-29 a TE
    # model could not resume there (its _extra_state entries change size after the first FP8 step: TE issue #1860),
    # and no LowBitAdamW (msamp O3, optimizer_states) could save (a torch.dtype in its groups)
    for rank in ranks:
        r = rank[name]
        assert r["resumed"] == r["continued"] and r["resumed_weights"] == r["continued_weights"], r
    assert ranks[0][name]["plain_loads"] is True  # get_state_dict loads into the plain model with strict=True


@pytest.mark.slow
@pytest.mark.parametrize("name", NO_STEP)
def test_te_fp8_weights_keep_tes_optimizer(ranks, name):
    assert all(rank[name]["optimizer_is_te"] for rank in ranks)


@pytest.mark.slow
@pytest.mark.parametrize("name", NO_STEP)
def test_te_fp8_weights_checkpoint_every_parameters_state_before_a_step(ranks, name):
    # FusedAdam holds the FP8 weights' seeded masters from prepare() on; DCP's optimizer state dict made no state
    # for the other parameters, and under FSDP2 Accelerate's load_state failed for the embeddings (one H200, 128d7a2)
    for rank in ranks:
        r = rank[name]
        assert "error" not in r, r.get("traceback")
        assert r["params_with_state"] == r["params"], r
        assert None not in r["saved_masters"], r["saved_masters"]
        assert r["loaded_masters"] == r["saved_masters"], (r["saved_masters"], r["loaded_masters"])
        # a load fills only what its template holds: without the groups' step count a resumed run restarts Adam's
        # bias correction
        assert r["loaded_steps"] == r["saved_steps"], r


@pytest.mark.slow
@pytest.mark.parametrize("name, says", [
    ("msamp_O3", "optimizer_0: Missing key in checkpoint state_dict: optimizer.param_groups.0.amsgrad"),
    ("torchao", "pytorch_model_fsdp_0: Missing key in checkpoint state_dict: model.model.layers.0.self_attn"),
    ("torchao_bf16_states", "was saved as torch.bfloat16 and this run keeps it as torch.float8_e4m3fn"),
])
def test_a_sharded_checkpoint_of_another_configuration_is_refused_before_anything_loads(ranks, name, says):
    # DCP loads the model before the optimizer: msamp O3's checkpoint into torchao loaded the weights, then failed on
    # the optimizer's entries; BF16 moments cast into E4M3 ones by value would have been off by their scale
    for rank in ranks:
        r = rank[name]
        assert r["refused"] and says in r["refused"] and "nothing was loaded" in r["refused"], r["refused"]
        assert r["untouched_by_the_refusal"] is True


@pytest.mark.slow
def test_a_full_state_checkpoint_of_other_optimizer_states_is_converted(ranks):
    # FULL_STATE_DICT loads through the optimizer's own load_state_dict: BF16 moments into torch's FP32 AdamW
    for rank in ranks:
        # the step after the load as the continued run's, but for the two optimizers' own FP32 rounding (1.7e-6)
        assert rank["torchao_full_state_bf16_states"]["converted_step_vs_continued"] < 1e-4


@pytest.mark.parametrize("name", ["te_full_state_into_fp8_weights", "ddp_te_into_fp8_weights"])
def test_a_checkpoint_saved_without_fp8_weights_resumes_with_them(ranks, name):
    # Adam's form (a step per parameter, no masters) into TE's FusedAdam, whose own load fails on a state named
    # "step": every trainable parameter has its moments and a master from the loaded weight (not the fresh model's,
    # which FSDP2's full-state load on two processes kept where the checkpoint had no entry), with a warning; the
    # groups have the steps taken on every rank (that load gave rank 0 alone its count: the ranks agree after it)
    for rank in ranks:
        r = rank[name]
        assert r["converted_state_keys"] == ["exp_avg", "exp_avg_sq", "master_param"], r
        assert r["converted_params_without_state"] == 0 and r["converted_masters_off_weights"] == 0, r
        assert r["converted_weights_as_saved"] and r["converted_group_steps"] == [STEPS_BEFORE_SAVE], r
        (warning,) = [w for w in r["converted_warnings"] if "no FP32 master weights" in w]
        assert "restarts" not in warning


@pytest.mark.parametrize("name", ["te_fp8_weights_full_state_out", "te_fp8_weights_full_state_out_bf16_states",
                                  "ddp_te_fp8_weights_out"])
def test_a_checkpoint_saved_with_fp8_weights_resumes_without_them(ranks, name):
    # TE's FusedAdam form (a step per group, FP32 masters) into torch's AdamW (and LowBitAdamW with BF16 moments, whose
    # own load dropped rank 0's masters): on every rank each parameter's step is
    # its group's and its weight its master (set off the weight before the save), no FusedAdam entry left. Under
    # FSDP2's full state dict rank 0 alone read the file, and its group step made the ranks' step agreement wait for
    # ever (until 2026-11-29); the others kept a fresh count and the model file's FP8 weights
    for rank in ranks:
        r = rank[name]
        assert "error" not in r, r.get("traceback")
        assert r["out_masters"] == r["out_params"] > 0, r
        assert "master_param" not in r["out_state_keys"] and r["out_group_keys_with_step"] == 0, r
        assert {"exp_avg", "exp_avg_sq", "step"} <= set(r["out_state_keys"]), r
        assert r["out_steps_as_saved"] == r["out_params"] and r["out_weights_from_masters"] == r["out_masters"], r


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in SCENARIOS if "act8" in n])
def test_fp8_activations_are_stored_through_accelerates_engines(ranks, name):
    # activation_dtype='fp8' under FSDP2 (with the plugin's activation checkpointing too) and DDP: tensors saved
    # for backward were packed, and the run trains and resumes (the tests above)
    # (inside compiled graphs, counted once when a graph compiles: traced_packed)
    assert all(rank[name]["packed_elements"] > 0 or rank[name]["traced_packed"] > 0 for rank in ranks)


@pytest.mark.slow
@pytest.mark.parametrize("name", SCENARIOS)
def test_nothing_of_a_finished_run_outlives_it(ranks, name):
    # each rank's model parameters and optimizer, collected once the scenario dropped them: a gradient store's hook
    # holding its layer kept torchao's O2 model alive under DDP (15 parameters a rank) until 799fdf4
    assert all(rank[name]["outlived"] == [] for rank in ranks), [rank[name]["outlived"] for rank in ranks]


@pytest.mark.slow
def test_fp8_activations_under_fsdp2_in_a_compiled_model_through_hooks_or_inside_the_graphs(ranks):
    # multi.sh's 'ingraph' A/B on two CPU ranks: Accelerate's regional compilation under FSDP2, the saved tensors
    # encoded by the Python hooks after each graph (an engine's default) or inside the compiled graphs
    # (LOWPREC_FP8_ACTIVATIONS_IN_GRAPH=1); both train alike and resume exactly (the other tests above)
    for rank in ranks:
        hooks, graphs = rank["torchao_act8_compiled"], rank["torchao_act8_compiled_in_graph"]
        assert hooks["packed_elements"] > 0 and hooks["traced_packed"] == 0
        assert graphs["traced_packed"] > 0
        assert graphs["losses"] == pytest.approx(hooks["losses"], rel=0.02)
