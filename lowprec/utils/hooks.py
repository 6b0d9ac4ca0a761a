"""Parameter hooks that do not keep their owner alive.

A post-accumulate-grad hook lives in autograd's C++ AccumulateGrad node of its parameter, where Python's garbage
collector cannot see it: a hook that refers, however indirectly, back to its parameter (an optimizer, a module, an
object holding either) makes a cycle that is never collected, and the whole model and optimizer outlive the run
that used them. On the GPU host lowprec's steps in backward kept 13.9 GiB of the d4096 proxy allocated after their
run (results/gpu/2026-11-29-h200-inbackward-3ee32b5); te's and torchao's O1/O2 gradient stores did the same. The
hooks here reach their owner through a weak reference; the owner must be kept alive by something the collector can
see (the optimizer or the module it serves).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TypeVar

import torch
from torch.utils.hooks import RemovableHandle

Owner = TypeVar("Owner")


def weak_post_accumulate_grad_hook(param: torch.Tensor, owner: Owner,
                                   call: Callable[[Owner, torch.Tensor], None]) -> RemovableHandle:
    """Register on `param` a post-accumulate-grad hook that runs `call(owner, param)` while `owner` lives and does
    nothing once it is gone, holding `owner` weakly. `call` must not hold `owner` itself (a plain function or an
    unbound method)."""
    ref = weakref.ref(owner)

    def hook(tensor: torch.Tensor) -> None:
        live = ref()
        if live is not None:
            call(live, tensor)

    return param.register_post_accumulate_grad_hook(hook)
