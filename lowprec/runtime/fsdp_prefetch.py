"""Explicit forward prefetch for a model under FSDP2: each group's forward asks for the next group's all-gather.

FSDP2 overlaps a group's all-gather with the previous group's compute implicitly, by issuing it when that group's
forward begins: early enough where the host runs ahead of the GPU, too late where the forward is bound by the host.
There the GPU waits for every all-gather the host has just issued: msamp O3 (36.6 ms of host time for 40.0 ms of
device time in the forward on two H200s, results/gpu/2026-11-30-h200x2-matrix-bdbfff9) and te with FP8 weights
(34.4 for 35.2, results/gpu/2026-11-29-h200x2-te-690e980) are, BF16 (19.1 for 40.0) is not. FSDP2's
`set_modules_to_forward_prefetch` issues the next group's all-gather right after a group's own is in place, before
its compute: "the same all-gather overlap behavior as the default ... except the prefetched all-gather is issued
earlier from the CPU" (torch's docstring).

The groups are chained in the order the first training forward runs them (recorded by forward pre-hooks, removed
once the chain is set), so that any architecture gets its own order, not the modules' registration order.
"""

from __future__ import annotations

import torch
from torch import nn


def _group_id(module: nn.Module) -> int:
    """Which FSDP2 group `module` belongs to: the modules of one `fully_shard([a, b, ...])` share its state (which
    FSDP2 runs the group's hooks and prefetches through once, at its first module's forward)."""
    from torch.distributed.fsdp import fully_shard

    return id(fully_shard.state(module))


class ForwardPrefetch:
    """Chains `model`'s FSDP2 groups for forward prefetch after its first training forward (see the module's doc).

    `depth` groups ahead (1: the next one, as FSDP2's implicit overlap, issued earlier; more holds more gathered
    weights at once). `order` is the chain once set (a group's modules' names), empty before. A group that runs
    twice in the first forward (weights shared between places) is chained at its first run only; a group that does
    not run in it is not chained."""

    def __init__(self, model: nn.Module, depth: int = 1):
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"ForwardPrefetch(depth={depth!r}): depth must be an integer >= 1 (the groups "
                             "prefetched ahead of each)")
        from torch.distributed.fsdp import FSDPModule

        # id(module) -> its group's representative (the group's first module in `modules()` order), for every
        # module of every group
        representative: dict[int, nn.Module] = {}
        self._state_of: dict[int, nn.Module] = {}
        for module in model.modules():
            if isinstance(module, FSDPModule):
                self._state_of[id(module)] = representative.setdefault(_group_id(module), module)
        if not self._state_of:
            raise ValueError("ForwardPrefetch: the model holds no fully_shard-ed module (FSDP2)")
        self.depth = depth
        self.order: list[str] = []
        self._names = {id(m): name or type(m).__name__ for name, m in model.named_modules()}
        self._ran: list[nn.Module] = []
        self._handles = [m.register_forward_pre_hook(self._record) for m in model.modules() if id(m) in self._state_of]
        self._handles.append(model.register_forward_hook(self._chain))

    @torch.compiler.disable  # a compiled block's hooks are traced with it: this one's list is Python state
    def _record(self, module: nn.Module, args) -> None:
        if not module.training:
            return
        group = self._state_of[id(module)]
        if all(g is not group for g in self._ran):
            self._ran.append(group)

    @torch.compiler.disable
    def _chain(self, model: nn.Module, args, output) -> None:
        if not self._ran:  # an evaluation forward: no order recorded yet
            return
        for i, group in enumerate(self._ran):
            ahead = self._ran[i + 1:i + 1 + self.depth]
            if ahead:
                group.set_modules_to_forward_prefetch(ahead)
        self.order = [self._names.get(id(g), type(g).__name__) for g in self._ran]
        self.remove()

    def remove(self) -> None:
        """Stop recording (the chain, once set, stays); the model's modules are no longer referenced from here."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._ran, self._state_of, self._names = [], {}, {}
