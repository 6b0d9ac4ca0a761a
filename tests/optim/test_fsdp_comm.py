"""FP8 reduce-scatter under FSDP2 and grad_comm_dtype under `fully_shard`: two CPU processes (gloo).

One torchrun launch of tests/distributed/fsdp2_comm.py: `FP8ReduceScatter` against the exact FP32
reduce-scatter, and FSDP2 training of a torchao-converted MLP with each grad_comm_dtype.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.slow
pytest.importorskip("torchao")

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "distributed", "fsdp2_comm.py")
CASES = ["torch.float32-sum", "torch.float32-avg", "torch.bfloat16-sum", "torch.bfloat16-avg"]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    from conftest import run_two_ranks

    result = run_two_ranks(SCRIPT, out=tmp_path_factory.mktemp("fsdp2_comm") / "result.json")
    assert len(result) == 2
    return result


@pytest.mark.parametrize("case", CASES)
def test_fp8_reduce_scatter_error_against_the_exact_fp32_reduce_scatter(ranks, case):
    # One rounding to E4M3 per element (the cast; the sum is FP32): at most 2**-4 relative, about
    # 2**-4 / sqrt(3) ~ 0.036 RMS at the top of a binade and less below it. Bound 0.04 on the whole
    # shard and on the tensor 10**6 below its neighbours, which its own block scales keep.
    for r in ranks:
        numerics = r["numerics"][case]
        assert numerics["dtype"] == case.split("-")[0]  # written in the reduce dtype FSDP asked for
        assert 0.005 < numerics["block"] < 0.04, numerics  # FP8-level error, not FP32's
        assert numerics["block_tiny"] < 0.04, numerics
        assert numerics["nonfinite"] == 0
    # one scale per shard flushes that tensor to zero where the shard also holds values near 1
    assert max(r["numerics"][case]["per_shard_tiny"] for r in ranks) > 0.5


def test_fp8_reduce_scatter_turns_inf_into_nan_not_a_saturated_value(ranks):
    owner, other = (r["numerics"]["inf"] for r in ranks)
    assert owner["nan_at_5"] and not owner["finite_everywhere"] and owner["finite_outside_block_0"]
    assert other["finite_everywhere"]
    assert owner["nonfinite_blocks"] == other["nonfinite_blocks"] == 1  # every rank counts it


FP8_ROW = "FP8 E4M3, block scales (groups with FP8 Linears)"


@pytest.mark.parametrize("choice, row, comm", [("None", "BF16", None), ("bf16", "BF16", None), ("fp32", "FP32", None),
                                               ("fp8", FP8_ROW, "FP8ReduceScatter")])
def test_fsdp2_trains_with_each_grad_comm_dtype(ranks, choice, row, comm):
    reference = [r["train"]["fp32"]["losses"] for r in ranks]
    for r, ref in zip(ranks, reference):
        run = r["train"][choice]
        assert run["grad_comm"] == row and run["comm"] == comm
        losses = run["losses"]
        assert losses[-1] < 0.9 * losses[0], losses
        # FP8 (or BF16) reduction of the gradients moves the curve by far less than training does
        assert max(abs(a - b) for a, b in zip(losses, ref)) < 0.02 * ref[0]
    if comm is not None:
        # three sharded Linears reduce-scatter once per backward each (the root holds no parameters), 10 steps
        assert all(r["train"][choice]["comm_calls"] >= 30 and r["train"][choice]["nonfinite_blocks"] == 0
                   for r in ranks)
    # sharded parameters, gathered: the same model on both ranks
    assert ranks[0]["train"][choice]["param_sums"] == ranks[1]["train"][choice]["param_sums"]


def test_a_sharded_fp8_run_checkpoints_into_the_plain_model_and_resumes_exactly(ranks):
    for r in ranks:
        assert r["checkpoint"]["resumed"] == r["checkpoint"]["continued"]  # sharded state dicts: bit for bit
    rank0 = ranks[0]["checkpoint"]
    assert rank0["full_types"] == ["Tensor"]  # no FP8 weight subclass leaks into the full state dict
    assert rank0["full_keys"] == sorted(f"{i}.{p}" for i in (0, 2, 4) for p in ("bias", "weight"))


def test_fp8_optimizer_states_are_sharded_with_the_parameters(ranks):
    # optimizer_states="fp8" under FSDP2: lowprec's LowBitAdamW keeps E4M3 + FP16 moments as DTensor shards
    reference = [r["train"]["fp8"]["losses"] for r in ranks]
    for r, ref in zip(ranks, reference):
        run = r["train"]["fp8_states"]
        assert run["optimizer"] == "LowBitAdamW"
        assert run["state"] == ["DTensor torch.float16", "DTensor torch.float8_e4m3fn"]
        assert run["losses"][-1] < 0.9 * run["losses"][0]
        assert max(abs(a - b) for a, b in zip(run["losses"], ref)) < 0.02 * ref[0]
    assert ranks[0]["train"]["fp8_states"]["param_sums"] == ranks[1]["train"]["fp8_states"]["param_sums"]


def test_fp8_reduce_scatter_goes_only_on_groups_holding_fp8_layers(monkeypatch):
    # MS-AMP sends FP8 only for FP8 weights' gradients: a group of norms, or the root (embeddings, head), keeps
    # FSDP2's reduce-scatter in its reduce_dtype; a group holding an FP8 Linear (itself, or inside it) gets the FP8 one
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from lowprec.optim.comm_hooks import FP8ReduceScatter, install_fp8_reduce_scatter

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        fp8 = nn.Linear(8, 8)
        block = nn.Sequential(nn.LayerNorm(8), fp8)
        norms = nn.Sequential(nn.LayerNorm(8))
        model = nn.Sequential(block, norms, nn.Linear(8, 8))
        for m in (fp8, block, norms, model):  # the block around its FP8 Linear's group holds only its norm
            fully_shard(m, mesh=mesh)
        hooked = []
        monkeypatch.setattr(FSDPModule, "set_custom_reduce_scatter", lambda self, comm: hooked.append(self))
        comm = install_fp8_reduce_scatter(model, holds_fp8=lambda m: m is fp8)
        assert isinstance(comm, FP8ReduceScatter) and hooked == [fp8]
        hooked.clear()
        install_fp8_reduce_scatter(model)  # without a rule: every group, as before
        assert {id(m) for m in hooked} == {id(fp8), id(block), id(norms), id(model)}
        hooked.clear()
        with pytest.warns(UserWarning, match="no fully_shard-ed group holds an FP8 Linear"):
            install_fp8_reduce_scatter(model, holds_fp8=lambda m: False)  # nothing FP8 to send: said, not silent
        assert hooked == []
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("numel, n, block", [(4096, 2, 1024), (24, 3, 4), (5000, 2, 1024), (21, 3, 4)])
def test_shards_split_into_blocks_with_a_zero_pad_only_where_they_need_one(dtype, numel, n, block):
    # whole blocks are a view of the buffer (no padded copy); either way each shard's blocks start at its start
    from lowprec.optim.comm_hooks import _blocks

    flat = torch.randn(numel).to(dtype)
    chunk = numel // n
    blocks = -(-chunk // block)
    expected = torch.zeros(n, blocks * block)
    expected[:, :chunk] = flat.float().reshape(n, chunk)
    got = _blocks(flat, n, block)
    assert got.dtype == torch.float32 and torch.equal(got, expected.view(n, blocks, block))
