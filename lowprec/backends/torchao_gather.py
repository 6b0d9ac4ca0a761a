"""torchao's FP8 weight all-gather under FSDP2, each shard cast to FP8 in one kernel.

Before every all-gather (forward, and again in backward where FSDP2 reshards after forward) torchao's
`WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather` casts the rank's FP32 shard eagerly, outside any
compiled graph: a multiply into a new FP32 tensor, a clamp into another, a copy to FP8. On the d4096 proxy as a
world of one those three kernels were about 14 ms of an 82 ms step (56 casts of 28 weights), and the FP8 all-gather
ran 1.18x compiled BF16 FSDP2 where BF16 all-gathers with the cast inside the compiled layer ran 1.29x
(results/gpu/2026-11-29-h200-world1-1a9b081). With the scale precomputed after the optimizer step (lowprec's
post-step hook) the cast here is lowprec's one-pass Triton kernel (`kernels.cast`): it reads the shard once and
writes the FP8 bytes. The same bits as torchao's for every finite value; an inf becomes NaN rather than a finite
+-max (a non-finite weight never comes out finite). Before the first step, with no precomputed scale, torchao's own
cast runs (it all-reduces the amax).

FSDP2 calls `fsdp_pre_all_gather` on the sharded local tensor it made, so the override is the instance's own,
installed after the model is wrapped (`fuse_gather_casts`); torchao's class is left as it is.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from ..kernels.cast import cast_transpose
from ..kernels.scaling import quantize

# what the kernel's amax output is written to: the precomputed scale is already known, nobody reads it
_scratch: dict[torch.device, torch.Tensor] = {}


def gather_cast(shard: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """`shard * scale` in `fp8_dtype`, saturated at the format's max, inf and NaN as NaN: one kernel on CUDA."""
    if shard.dim() != 2 or shard.device.type != "cuda":
        return quantize(shard, scale, fp8_dtype)
    amax = _scratch.get(shard.device)
    if amax is None:
        amax = _scratch[shard.device] = torch.zeros((), dtype=torch.float32, device=shard.device)
    return cast_transpose(shard, scale.reshape(()), fp8_dtype, amax, transpose=False)[0]


def _pre_all_gather(self, mesh):
    """`fsdp_pre_all_gather` of one sharded torchao weight: its FP8 bytes and scale, as torchao's returns them."""
    scale = self._precomputed_scale  # read once: the post-step hook re-assigns it
    if scale is None or self._tensor.numel() == 0:
        return type(self).fsdp_pre_all_gather(self, mesh)
    return (gather_cast(self._tensor, scale, self._dtype),), (scale,)


def fuse_gather_casts(model: nn.Module) -> int:
    """Give every FSDP2-sharded torchao weight of `model` the one-kernel cast before its all-gather; returns how
    many. Run once the model is wrapped: FSDP2 makes the local tensors it gathers when it shards."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    count = 0
    for param in model.parameters():
        local = getattr(param, "_local_tensor", None)
        if isinstance(local, WeightWithDynamicFloat8CastTensor):
            local.fsdp_pre_all_gather = types.MethodType(_pre_all_gather, local)
            count += 1
    return count


def fused_gather_casts(model: nn.Module) -> int:
    """How many of `model`'s sharded weights carry the one-kernel cast (evidence for the harness and the tests)."""
    return sum(getattr(getattr(getattr(p, "_local_tensor", None), "fsdp_pre_all_gather", None), "__func__", None)
               is _pre_all_gather for p in model.parameters())
