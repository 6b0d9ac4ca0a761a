"""Averaging FP8 weight gradients under DDP while the backward still runs, one transformer block at a time.

`FP8GradReducer` averages every stored FP8 gradient in one pass once the backward is over: its bytes
cross the wire while the GPU waits. `BlockwiseReduction` splits the layers by transformer block and
averages a block's gradients as soon as autograd has finished that block, on a side CUDA stream, so the
wire time hides behind the backward of the blocks below it (DDP does the same for `.grad` buckets).

When a block is finished: a forward pre-hook on each block hooks the gradient of the block's input. That
gradient is complete only once every node between the input and the loss has run, and every Linear
of the block lies on such a path: when the hook fires, the block's weight gradients are written (msamp's
layers write theirs inside the node; a `GradStore` from its weight's AccumulateGrad, which autograd runs
as soon as it is ready). A block called several times in a forward is finished after its last call's
hook; a call whose input needs no gradient leaves its block to the end of the backward.

Order: every rank must issue the same collectives in the same order. Buckets start strictly in
backward order (the last block first), a bucket whose block is not finished holding back those after it,
and the end of the backward (a callback autograd runs when the backward is over, queued by the first
block's hook, as DDP does) starts whatever is left in the same order. The layers of no block, or of several,
form the last bucket. What ends a round is the backward itself, on every rank alike: not a forward (one rank
alone may run one, a preview) and not `Accelerator.backward` (a script may call `loss.backward()`, twice per
step). A backward in which no block's hook fired (every block's input needing no gradient) leaves its
gradients to the single pass. The collectives run on a process group of their own, so they never interleave
with DDP's on one communicator.

Streams (CUDA): a bucket runs on the side stream after the work queued so far; the end of the backward makes
the current stream wait for the side stream (a device-side wait: no host sync), so what runs next (the
optimizer, the next backward's accumulation) reads the averaged bytes. On CPU (gloo) buckets run inline, the
backward waiting for the collectives.
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist
from torch import nn

from ..utils.env import switch
from .grad_reduce import FP8GradReducer

ENV = "LOWPREC_FP8_GRAD_OVERLAP"


# Where unset, per engine: DDP overlaps (two H200s, d4096 proxy, msamp O2: 105.5 ms a step against 107.7 once
# after the backward, results/gpu/2026-11-27-h200x2-matrix-7ec8725); ZeRO-1/2 (msamp O3) not yet measured both ways.
DEFAULTS = {"ddp": True, "deepspeed": False}


def overlap_requested(engine: str = "ddp") -> bool:
    """`LOWPREC_FP8_GRAD_OVERLAP`: 1 averages the stored FP8 gradients block by block during the backward,
    0 once after it; unset, the engine's default (`DEFAULTS`: on under DDP, off under DeepSpeed)."""
    value = switch(ENV, "1: average FP8 weight gradients block by block during the backward; 0: once after it; "
                        "unset: per block under DDP, once after the backward under DeepSpeed")
    return DEFAULTS.get(engine, False) if value is None else value


def reduction_timing(engine: str = "ddp") -> str:
    """When the FP8 weight gradients are averaged under `engine`, for the plan's communication row."""
    if overlap_requested(engine):
        how = f"{ENV}=1" if os.environ.get(ENV, "").strip() else f"the {engine} default; {ENV}=0 turns it off"
        return (f"per transformer block as the backward finishes it, on a side stream ({how}; a model "
                "compiled whole or without a block list: once after the backward)")
    return "once after the backward"


def _first_grad_input(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The block's hidden states: its first floating-point tensor argument."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value
    return None


class BlockwiseReduction:
    """`FP8GradReducer`s of the layers of each block of `blocks`, started as autograd finishes each block.

    `layers`: objects with the `FP8GradReducer` attributes whose `module` (or which themselves) is a
    module of the model; `blocks`: the model's transformer blocks in forward order. `will_sync()` says
    whether the backward about to run averages gradients (DDP's `require_backward_grad_sync`); only then
    are the blocks' inputs hooked. `model`, where given, is searched for modules outside a block that hold
    a layer's weight too (tied weights): such a layer's gradient is complete only at the end of the
    backward, so it goes to the last bucket. (A module of a block that the model also calls from outside the
    block is not detected.)
    """

    def __init__(self, layers, blocks: list[nn.Module], will_sync=lambda: True, group=None,
                 method: str = "all_to_all", model: nn.Module | None = None):
        layers = list(layers)
        holders: dict[int, set[int]] = {}  # id(Parameter) -> ids of the modules holding it
        for module in (model.modules() if model is not None else ()):
            for param in module.parameters(recurse=False):
                holders.setdefault(id(param), set()).add(id(module))
        owner: dict[int, set[int]] = {}
        for index, block in enumerate(blocks):
            inside = {id(m) for m in block.modules()}
            for layer in layers:
                if id(getattr(layer, "module", layer)) in inside:
                    held_outside = holders.get(id(getattr(layer, "weight", None)), set()) - inside
                    owner.setdefault(id(layer), set()).update({index, -1} if held_outside else {index})
        per_block: list[list] = [[] for _ in blocks]
        rest = []
        for layer in layers:
            where = owner.get(id(layer), set())
            (per_block[next(iter(where))] if len(where) == 1 else rest).append(layer)
        device = layers[0].fp8_grad_data.device if layers else None
        if group is None and dist.get_world_size() > 1:
            group = dist.new_group(list(range(dist.get_world_size())))  # every rank, in the same order
            if layers:
                # Set the group's communicator up now, not at the first bucket in the middle of a backward
                # beside DDP's own traffic (NCCL's set-up may wait on the whole device)
                dist.all_reduce(torch.zeros(1, device=device), group=group)
        # Backward order: the last block's bucket first; empty blocks have nothing to send.
        self.order = [i for i in reversed(range(len(blocks))) if per_block[i]]
        self.reducers = {i: FP8GradReducer(per_block[i], group, method) for i in self.order}
        self.rest = FP8GradReducer(rest, group, method) if rest else None
        self.layers = layers
        self.will_sync = will_sync
        self.stream = torch.cuda.Stream(device=device) if device is not None and device.type == "cuda" else None
        self._warned_no_block = False
        self.last_early = 0  # buckets the last hooked backward started before it ended
        self.averaged = False  # a hooked backward averaged the gradients since `finish()` last said so
        self._reset()
        self._handles = [block.register_forward_pre_hook(self._pre_forward(i), with_kwargs=True)
                         for i, block in enumerate(blocks) if per_block[i]]

    def _reset(self) -> None:
        self.calls: dict[int, int] = {}  # forward calls of each block since the last round ended
        self.done: dict[int, int] = {}  # of them, those whose input gradient arrived
        self.blind: set[int] = set()  # blocks called on an input needing no gradient: left to the end
        self.next = 0  # position in self.order of the next bucket to start
        self.started: list[int] = []
        self.queued = False  # the end-of-backward callback is queued

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # ---- during forward and backward -----------------------------------------------------------------
    def _drop_stale_round(self) -> None:
        """Forget a round whose backward raised (an out-of-memory error, say: autograd then drops the callback
        that would have ended it), once no backward runs: the current stream waits for what it started, and
        the next backward starts a round of its own instead of finding this one's counts."""
        if self.queued and torch._C._current_graph_task_id() == -1:
            if self.stream is not None:
                torch.cuda.current_stream().wait_stream(self.stream)
            self._reset()

    def _pre_forward(self, index: int):
        def hook(module, args, kwargs):
            self._drop_stale_round()
            # A forward under no_grad trains nothing; one inside the backward is activation recomputation,
            # whose gradients belong to the call already counted.
            if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1 or not self.will_sync():
                return None
            self.calls[index] = self.calls.get(index, 0) + 1
            x = _first_grad_input(args, kwargs)
            if x is None or not x.requires_grad:
                self.blind.add(index)
            else:
                x.register_hook(lambda grad: self._block_done(index))
            return None

        return hook

    def _block_done(self, index: int) -> None:
        if not self.queued:  # the first block this backward finished: end the round with the backward
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self.queued = True
        self.done[index] = self.done.get(index, 0) + 1
        while self.next < len(self.order):
            i = self.order[self.next]
            if i in self.blind or self.done.get(i, 0) < self.calls.get(i, 0) or i not in self.calls:
                return
            self._start(self.reducers[i])
            self.started.append(i)
            self.next += 1

    def _start(self, reducer: FP8GradReducer) -> None:
        if self.stream is None:
            reducer.reduce()
            return
        # after the backward's kernels queued so far (the block's gradients among them)
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            reducer.reduce()

    # ---- after the backward ----------------------------------------------------------------------------
    def _end_of_backward(self) -> None:
        """Autograd's callback when a hooked backward is over: the buckets it left, in order, the rest, and the
        current stream made to wait for them."""
        for i in self.order[self.next:]:
            self._start(self.reducers[i])
        if self.rest is not None:
            self._start(self.rest)
        if self.stream is not None:
            torch.cuda.current_stream().wait_stream(self.stream)
        self.last_early = len(self.started)
        self.averaged = True
        self._reset()

    def finish(self, pending: bool = True) -> bool:
        """Whether a hooked backward averaged the gradients since the last call (then the single pass has
        nothing left to do); False: none did, the single pass averages them. Forgets what forwards counted
        since (a forward with no backward after it, on one rank or all). `pending`: whether gradients await
        averaging; False where an earlier call took this round's answer already (the clipping's and the
        optimizer step's calls after the backward's), which is then no sign of blocks run without gradients."""
        averaged, self.averaged = self.averaged, False
        counted = bool(self.calls)
        self._drop_stale_round()
        if pending and not averaged and not counted and not self._warned_no_block:
            self._warned_no_block = True
            warnings.warn(f"lowprec: averaging the FP8 weight gradients block by block during the backward ({ENV}) "
                          "found no transformer block run with gradients before this step (blocks run under "
                          "torch.no_grad, as reentrant activation checkpointing runs them): they are averaged once "
                          "after the backward instead", stacklevel=3)
        if not self.queued:  # a round in a backward still under way is not for this call to end
            self._reset()
        return averaged
