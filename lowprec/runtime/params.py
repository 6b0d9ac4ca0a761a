"""Parameters that conversion replaced, and the optimizers built on the old ones pointed at the new."""

from __future__ import annotations

import weakref

import torch
from torch import nn


class ReplacedParams:
    """Old Parameter -> the Parameter conversion put in its place.

    Keyed by identity: a WeakKeyDictionary would compare tensors with `==`, which is elementwise.
    The weak reference tells a live entry from a reused id() of a collected Parameter.
    """

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[weakref.ref, nn.Parameter]] = {}

    def add(self, old: torch.Tensor, new: torch.Tensor) -> None:
        self._by_id = {k: v for k, v in self._by_id.items() if v[0]() is not None}
        self._by_id[id(old)] = (weakref.ref(old), new)

    def get(self, old: torch.Tensor) -> torch.Tensor | None:
        entry = self._by_id.get(id(old))
        return entry[1] if entry is not None and entry[0]() is old else None

    def keep_only(self, params) -> None:
        """Forget the entries whose replacement is not among `params` any more, or whose old Parameter is gone.

        Called once the engine has wrapped the model: FSDP2 (fully_shard) makes DTensor shards of the
        replacements, and an entry would keep the whole unsharded replacement alive (for torchao's FP8
        all-gather weight it also holds the original Parameter): 4 bytes per converted weight element
        on every rank, for the rest of the run. (A weak reference to the replacement is no way out:
        torch refuses to swap_tensors a subclass Parameter that has one, which model.to() does.)"""
        live = {id(p) for p in params}
        self._by_id = {k: v for k, v in self._by_id.items() if v[0]() is not None and id(v[1]) in live}

    def __len__(self) -> int:
        return len(self._by_id)


def _first_not_none(a, b):
    return a if a is not None else b


def remap_optimizer_params(optimizers, replaced: ReplacedParams) -> None:
    """Point optimizers at the new Parameter objects where conversion replaced them."""
    if not len(replaced):
        return
    for opt in optimizers:
        for group in opt.param_groups:
            group["params"] = [_first_not_none(replaced.get(p), p) for p in group["params"]]
        for p in list(opt.state):
            new = replaced.get(p)
            if new is not None:
                opt.state[new] = opt.state.pop(p)
