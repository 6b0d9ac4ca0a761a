"""What a tensor's bytes are, behind the wrappers training engines put around them."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local_shard(t):
    """`t`'s local shard where it is a DTensor (FSDP2), else `t` itself; unlike `local_data`, a wrapper subclass in
    it (TE's Float8Tensor, a master's FP32 DTensor) stays as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


def local_data(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding `t`'s bytes on this process: a DTensor's local shard (FSDP2), and inside
    it a wrapper subclass's inner tensor (torchao's FP8 all-gather weight, msamp O3's FP16 master or
    stored E4M3 weight).
    Kernels that take raw pointers and byte counts need this: a wrapper reports no storage."""
    local = getattr(t, "_local_tensor", None)
    t = local if isinstance(local, torch.Tensor) else t
    for name in ("_tensor", "_data"):  # msamp's stored E4M3 weight (O3 under DeepSpeed) keeps its bytes in _data
        inner = getattr(t, name, None)
        if isinstance(inner, torch.Tensor):
            return inner
    return t
