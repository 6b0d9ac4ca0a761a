"""FP8 weight-gradient stores (te/torchao levels) under DDP: two CPU processes (gloo).

One torchrun launch of tests/distributed/stores_ddp.py with backend="torchao" (emulated) at O1, O2,
weight_grad_dtype="fp8" alone, and O2 with two micro-batches per step. DDP ignores the stored weights
and their buffers; `FP8GradReducer` averages the FP8 gradients once per optimizer step with a shared
scale, so every rank holds the same bytes and steps to the same parameters.
"""

from __future__ import annotations

import math
import os

import pytest
from conftest import scenario_ranks as ranks

pytestmark = pytest.mark.slow
pytest.importorskip("torchao")

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "distributed", "stores_ddp.py")
SCENARIOS = ["O1", "O2", "fp8_grads", "O2_accumulate"]
COMM = ["comm_fp8", "comm_bf16", "comm_fp32", "O1_comm_fp8"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from conftest import run_two_ranks

    result = run_two_ranks(SCRIPT, out=tmp_path_factory.mktemp("stores_ddp") / "result.json", ACCELERATE_USE_CPU="1")
    assert result["world_size"] == 2
    return result


@pytest.mark.parametrize("name", SCENARIOS)
def test_set_up_under_ddp_with_the_fp8_reducer(run, name):
    for r in ranks(run, name):
        assert r["engine"] == "ddp" and r["wrapped"] == "DistributedDataParallel"
        assert r["stores"] == ["torch.float8_e4m3fn"] * 3 and r["reducer"] == "all_to_all"
        assert r["optimizer"] == "LowBitAdamW"
        # DDP neither reduces the stored weights nor broadcasts the stores' buffers
        for layer in ("0", "2", "4"):
            assert f"{layer}.weight" in r["ddp_ignores"] and f"{layer}._lowprec_grad_data" in r["ddp_ignores"]
        assert not any(name.endswith(".bias") for name in r["ddp_ignores"])
        assert r["grad_comm"].startswith("FP8 E4M3")


@pytest.mark.parametrize("name", SCENARIOS + COMM)
def test_ranks_hold_identical_gradients_and_parameters_after_every_step(run, name):
    a, b = ranks(run, name)
    # each rank built its model from its own seed: prepare() broadcast rank 0's weights (DDP the rest,
    # the backend the weights DDP ignores)
    assert a["init_params"] == b["init_params"]
    for sa, sb in zip(a["steps"], b["steps"]):
        assert sa["stored_grads"] == sb["stored_grads"]  # after the FP8 reduction: the same bytes and scales
        assert sa["dense_grads"] == sb["dense_grads"]  # DDP's all-reduce of the rest
        assert sa["params"] == sb["params"]
        assert sa["clip_norm"] == sb["clip_norm"]


@pytest.mark.parametrize("name", SCENARIOS + COMM)
def test_loss_falls(run, name):
    for r in ranks(run, name):
        losses = [sum(s["losses"]) / len(s["losses"]) for s in r["steps"]]
        assert sum(losses[-3:]) / 3 < 0.7 * sum(losses[:3]) / 3, losses


def test_weights_are_fp16_under_the_levels(run):
    for name in ("O1", "O2", "O2_accumulate"):
        assert all(r["weight_dtypes"] == ["torch.float16"] for r in ranks(run, name))
    assert all(r["weight_dtypes"] == ["torch.float32"] for r in ranks(run, "fp8_grads"))


@pytest.mark.parametrize("name, row, hook", [("comm_fp8", "FP8 E4M3, shared scale", "FP8CommState"),
                                             ("comm_bf16", "BF16", None), ("comm_fp32", "FP32", None),
                                             ("O1_comm_fp8", "FP8 E4M3, shared scale (FP8 Linear), FP8 E4M3, shared "
                                              "scale (rest)", "FP8CommState")])
def test_grad_comm_dtype_registers_its_hook_and_shows_in_the_plan(run, name, row, hook):
    for r in ranks(run, name):
        assert r["grad_comm"] == row and r["comm_hook"] == hook
        assert r["nonfinite_blocks"] in (None, 0)
        if name.startswith("comm_"):
            assert r["stores"] == [] and r["optimizer"] == "AdamW"  # the knob alone changes nothing else


def test_fp8_hook_error_against_the_exact_fp32_mean(run):
    # Error bound: each rank's cast to E4M3 and the rounding of the mean each err by at most half an
    # E4M3 step (2**-4 relative at the top of a binade); over values spread across four decades the
    # relative L2 error of two such roundings stays below 2 * 2**-4 / sqrt(3) ~ 0.072. Values below
    # E4M3's subnormal range at the shared scale flush to zero and add a little: bound 0.08.
    hook = run["hook"]
    assert isinstance(hook, list), hook
    a, b = hook
    for dtype in ("torch.float32", "torch.bfloat16"):
        assert a[dtype]["digest"] == b[dtype]["digest"]  # every rank holds the same mean
        assert a[dtype]["dtype"] == dtype and a[dtype]["nonfinite_blocks"] == 0
        assert 0.005 < a[dtype]["rel_l2"] < 0.08, a[dtype]["rel_l2"]  # FP8-level error, not FP32's
    assert a["tiny_rel_l2"] < 0.08, a["tiny_rel_l2"]  # block scales: a tensor 10**6 below its neighbours survives


def test_fp8_hook_turns_an_inf_into_nan_in_its_block_only_and_counts_it(run):
    # No host sync tells the hook about the inf: its block keeps scale 1, the inf arrives as NaN (E4M3 has no
    # inf), so the step sees a non-finite gradient, never a saturated finite one; every other block is finite.
    for r in run["hook"]:
        assert math.isnan(r["inf"]["value_7"]) and r["inf"]["finite_elsewhere"]
        assert r["inf"]["first_block_finite_but_7"]
        assert r["inf"]["nonfinite_blocks"] == 1
        assert r["inf"]["host_reads"] == []  # nothing in the hook waits for the device
