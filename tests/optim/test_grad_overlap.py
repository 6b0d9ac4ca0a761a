"""`LOWPREC_FP8_GRAD_OVERLAP=1`: DDP's stored FP8 weight gradients averaged block by block while the backward
runs (`lowprec.optim.grad_overlap.BlockwiseReduction`), on two CPU processes (gloo).

The reduction of a bucket is the reduction of its layers alone (per-tensor shared scales, an elementwise
FP32 sum), so averaging early changes no byte: every backward's stored gradients and every step's parameters
must equal those of the run that averages once after the backward, bitwise. A bucket started before its
block's gradients are written would average stale bytes and break that equality (checked by hand: starting
every bucket at the first hook changes every scenario's gradients). What the overlap adds is timing: how many
blocks' buckets started before the backward ended.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from lowprec.optim.grad_overlap import ENV, overlap_requested, reduction_timing

HERE = os.path.dirname(__file__)
SCRIPT = os.path.join(HERE, "..", "distributed", "blockwise_ddp.py")
BLOCKS = 3  # blockwise_ddp.BLOCKS: two converted Linears each; embed and head are the last bucket


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from conftest import run_two_ranks

    ranks = run_two_ranks(SCRIPT, "run", out=tmp_path_factory.mktemp("blockwise") / "result.json")
    assert [r["world_size"] for r in ranks] == [2, 2]
    return ranks


def scenario(run, name: str) -> list[dict]:
    entries = [r["scenarios"][name] for r in run]
    for entry in entries:
        assert "error" not in entry, entry.get("error")
    return entries


SCENARIOS = ["plain", "accumulation", "two_backwards", "recompute", "data_into_block0", "stores", "preview_on_rank0"]
# blocks whose buckets each backward started before it ended, where not one per block and backward
EARLY = {"accumulation": [0, BLOCKS, 0, BLOCKS], "two_backwards": [BLOCKS] * 4, "data_into_block0": [BLOCKS - 1] * 3}


def assert_same_bytes_as_the_single_pass(ranks: list[dict], name: str) -> None:
    """Scenario `name` of blockwise_ddp.py (CPU or GPU, DDP or ZeRO): with the switch on, every backward's stored
    gradients and every step's parameters are those of the single pass, bitwise; the buckets started during
    each backward are the expected ones; both ranks hold the same parameters after every step."""
    for rank in ranks:
        entry = rank["scenarios"][name]
        assert "error" not in entry, entry.get("error")
        off, on = entry["off"], entry["on"]
        assert (off["blockwise"], on["blockwise"]) == (False, True)
        for i, (a, b) in enumerate(zip(off["backwards"], on["backwards"], strict=True)):
            assert a["sync"] == b["sync"]
            assert a["grads"] == b["grads"], f"backward {i}: stored gradients differ"
        assert on["params"] == off["params"]
        assert [b["early"] for b in on["backwards"]] == EARLY.get(name, [BLOCKS] * 3)
    assert ranks[0]["scenarios"][name]["on"]["params"] == ranks[1]["scenarios"][name]["on"]["params"]


@pytest.mark.slow
@pytest.mark.parametrize("name", SCENARIOS)
def test_blockwise_averaging_changes_no_byte(run, name):
    assert_same_bytes_as_the_single_pass(run, name)


@pytest.mark.slow
def test_stores_are_averaged_every_step_with_loss_backward_called_directly(run):
    ranks = scenario(run, "stores_direct")
    for mode in ("off", "on"):
        assert ranks[0][mode]["params"] == ranks[1][mode]["params"], mode
    assert ranks[0]["on"]["params"] == ranks[0]["off"]["params"]  # one backward a step: the same bytes


@pytest.mark.slow
def test_loss_backward_called_directly_twice_a_step_keeps_ranks_in_step(run):
    # without Accelerator.backward nothing ends a round but the backward itself; the single pass (off) averages
    # once at the step, so its bytes differ by FP8 rounding: what must hold is that both ranks agree
    ranks = scenario(run, "direct_two_backwards")
    assert [b["early"] for b in ranks[0]["on"]["backwards"]] == [BLOCKS] * 4
    for mode in ("off", "on"):
        assert ranks[0][mode]["params"] == ranks[1][mode]["params"], mode
    # each backward averaged as under Accelerator.backward: the same bytes as the two_backwards scenario
    assert ranks[0]["on"]["params"] == scenario(run, "two_backwards")[0]["on"]["params"]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "early"), [
    ("plain", [BLOCKS] * 3),
    ("accumulation", [0, BLOCKS, 0, BLOCKS]),  # a backward without sync hooks nothing and sends nothing
    ("two_backwards", [BLOCKS] * 4),
    ("recompute", [BLOCKS] * 3),  # checkpointed blocks: the recomputation is not counted as a call
    ("data_into_block0", [BLOCKS - 1] * 3),  # block 0's input needs no gradient: its bucket waits for the end
    ("stores", [BLOCKS] * 3),  # torchao's layers with FP8 GradStores (AccumulateGrad hooks)
])
def test_buckets_start_during_the_backward(run, name, early):
    for rank in scenario(run, name):
        assert [b["early"] for b in rank["on"]["backwards"]] == early
        assert rank["on"]["buckets"] == [2] * BLOCKS
        assert rank["on"]["rest"] == (1 if name == "data_into_block0" else 2)  # embed (if a Linear) and head


@pytest.fixture(scope="module")
def zero_run(tmp_path_factory):
    pytest.importorskip("deepspeed")
    from conftest import run_two_ranks

    ranks = run_two_ranks(SCRIPT, "zero", out=tmp_path_factory.mktemp("blockwise_zero") / "result.json", timeout=600,
                          DS_ACCELERATOR="cpu", ACCELERATE_USE_DEEPSPEED="true")
    assert [r["world_size"] for r in ranks] == [2, 2]
    return ranks


ZERO_SCENARIOS = ["plain", "accumulation", "recompute"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ZERO_SCENARIOS)
def test_o3_under_zero2_averages_block_by_block_to_the_same_bytes(zero_run, name):
    # msamp O3 under DeepSpeed ZeRO-2: lowprec averages its FP8 layers' gradients beside DeepSpeed, and with the
    # switch on does it block by block during the backward instead of at the step
    assert_same_bytes_as_the_single_pass(zero_run, name)
    for rank in zero_run:
        grad_comm = rank["scenarios"][name]["on"]["grad_comm"]
        assert "per transformer block" in grad_comm and "the rest by DeepSpeed" in grad_comm


@pytest.mark.slow
def test_the_plan_says_when_gradients_are_averaged(run):
    rank = scenario(run, "plain")[0]
    assert "once after the backward" in rank["off"]["grad_comm"]
    assert "per transformer block" in rank["on"]["grad_comm"] and ENV in rank["on"]["grad_comm"]


@pytest.mark.parametrize("engine", ["ddp", "deepspeed"])
@pytest.mark.parametrize("value", [None, "", "0", "1", " 1 "])
def test_the_switch(monkeypatch, value, engine):
    if value is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, value)
    # unset: DDP overlaps (measured faster on two H200s), DeepSpeed does not (not yet measured both ways)
    expected = value.strip() == "1" if value and value.strip() else engine == "ddp"
    assert overlap_requested(engine) is expected
    timing = reduction_timing(engine)
    assert ("per transformer block" in timing) is expected
    if expected:  # the plan says how to turn it off where it is the default, and what turned it on otherwise
        assert (f"{ENV}=0 turns it off" if not (value and value.strip()) else f"{ENV}=1") in timing


@pytest.mark.parametrize("value", ["yes", "2", "true", "on"])
def test_a_bad_switch_names_the_variable_and_its_values(monkeypatch, value):
    monkeypatch.setenv(ENV, value)
    with pytest.raises(ValueError, match=rf"{ENV}=.*not one of '0', '1'"):
        overlap_requested()


# ---- the round's bookkeeping, on one process (buckets recorded, nothing sent) -------------------------------
class _Layer:
    """What BlockwiseReduction reads of a layer: its module, weight and FP8 gradient buffer."""

    def __init__(self, module):
        self.module, self.weight = module, module.weight
        self.fp8_grad_data = torch.zeros(module.weight.shape, dtype=torch.float8_e4m3fn)


@pytest.fixture
def one_process(monkeypatch):
    """A world of one, and the order in which buckets start (each bucket named by its layers' indices)."""
    import torch.distributed as dist

    from lowprec.optim.grad_reduce import FP8GradReducer

    started = []
    monkeypatch.setattr(FP8GradReducer, "reduce", lambda self: started.append([id(layer) for layer in self.layers]))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield started
    finally:
        dist.destroy_process_group()


def _blocks(n: int = 3):
    torch.manual_seed(0)
    blocks = [nn.Linear(8, 8) for _ in range(n)]
    return blocks, [_Layer(block) for block in blocks]


def _forward(blocks, x):
    for block in blocks:
        x = torch.tanh(block(x))
    return x.square().sum()


def test_a_backward_that_raises_leaves_no_round_behind(one_process):
    from lowprec.optim.grad_overlap import BlockwiseReduction

    blocks, layers = _blocks()
    reduction = BlockwiseReduction(layers, blocks)
    x = torch.randn(4, 8, requires_grad=True)
    # An error in the middle of the backward (after the last block's bucket started): autograd drops the
    # callback that would have ended the round
    h = torch.tanh(blocks[0](x))
    h.register_hook(lambda grad: (_ for _ in ()).throw(RuntimeError("out of memory")))
    for block in blocks[1:]:
        h = torch.tanh(block(h))
    with pytest.raises(RuntimeError, match="out of memory"):
        h.square().sum().backward()
    assert one_process == [[id(layers[2])]]
    assert reduction.finish() is False  # the round never ended: the single pass averages this step's gradients
    one_process.clear()
    for _ in range(2):  # later steps: every bucket starts during its backward again, in backward order
        _forward(blocks, x).backward()
        assert one_process == [[id(layers[i])] for i in (2, 1, 0)] and reduction.last_early == 3
        assert reduction.finish() is True
        one_process.clear()


def test_a_backward_that_raises_before_the_next_forward_is_forgotten_there(one_process):
    from lowprec.optim.grad_overlap import BlockwiseReduction

    blocks, layers = _blocks()
    reduction = BlockwiseReduction(layers, blocks)
    x = torch.randn(4, 8, requires_grad=True)
    loss = _forward(blocks, x)
    blocks[0].weight.register_hook(lambda grad: (_ for _ in ()).throw(RuntimeError("out of memory")))
    with pytest.raises(RuntimeError):
        loss.backward()
    assert reduction.queued
    blocks[0].weight._backward_hooks.clear()
    one_process.clear()
    _forward(blocks, x).backward()  # no finish() in between: the forward drops the stale round
    assert one_process == [[id(layers[i])] for i in (2, 1, 0)] and reduction.finish() is True


def test_a_weight_held_outside_its_block_goes_to_the_last_bucket(one_process):
    from lowprec.optim.grad_overlap import BlockwiseReduction

    blocks, layers = _blocks()
    head = nn.Linear(8, 8)
    head.weight = blocks[1].weight  # tied: its gradient is complete only at the end of the backward
    model = nn.ModuleDict({"blocks": nn.ModuleList(blocks), "head": head})
    reduction = BlockwiseReduction(layers, blocks, model=model)
    assert reduction.order == [2, 0] and reduction.rest.layers == [layers[1]]
    assert BlockwiseReduction(layers, blocks).order == [2, 1, 0]  # without the model nothing tells


def test_blocks_run_without_gradients_are_said_once(one_process):
    from torch.utils.checkpoint import checkpoint

    from lowprec.optim.grad_overlap import ENV, BlockwiseReduction

    blocks, layers = _blocks()
    reduction = BlockwiseReduction(layers, blocks)
    x = torch.randn(4, 8, requires_grad=True)
    for step in range(2):
        h = x
        for block in blocks:  # reentrant checkpointing runs each block under no_grad
            h = checkpoint(lambda t, b=block: torch.tanh(b(t)), h, use_reentrant=True)
        h.square().sum().backward()
        assert one_process == []  # nothing started during the backward
        if step == 0:
            with pytest.warns(UserWarning, match=rf"\({ENV}\) found no transformer block run with gradients"):
                assert reduction.finish() is False
        else:
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("error")
                assert reduction.finish() is False


def test_a_round_already_told_is_no_sign_of_blocks_without_gradients(one_process):
    """The backward's call takes the round's answer; the clipping's and the step's calls after it (nothing pending)
    say nothing: they warned of blocks run without gradients on every DDP run that clipped."""
    import warnings

    from lowprec.optim.grad_overlap import BlockwiseReduction

    blocks, layers = _blocks()
    reduction = BlockwiseReduction(layers, blocks)
    x = torch.randn(4, 8, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            _forward(blocks, x).backward()
            assert reduction.finish() is True  # after the backward: the hooked round averaged them
            assert reduction.finish(pending=False) is False  # clipping, then the step: nothing left to average
            assert reduction.finish(pending=False) is False
    with pytest.warns(UserWarning, match="found no transformer block"):  # pending with no block run: said
        assert reduction.finish() is False
