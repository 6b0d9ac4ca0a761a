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

FSDP2 calls `fsdp_pre_all_gather` on the sharded local tensors it made when it wrapped the model; the weights
lowprec prepared are marked then (`fuse_gather_casts`), and torchao's class method, replaced once by `_pre_all_gather`,
casts a marked weight here and hands any other to torchao's own. The mark is a bool in the tensor's `__dict__`, so a
deep copy or a pickle of the weight keeps it (an override bound to the instance went along to a deep copy, where it
cast the original's shard, and pickled as an attribute the class lacks).
"""

from __future__ import annotations

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
    return cast_transpose(shard, scale.float(), fp8_dtype, amax, transpose=False)[0]


_MARK = "_lowprec_one_kernel_cast"
_torchao_pre_all_gather = None  # torchao's own method, once replaced


def _pre_all_gather(self, mesh):
    """`fsdp_pre_all_gather` of torchao's sharded weights: for one lowprec marked, its FP8 bytes and scale (as
    torchao's returns them) from one kernel; any other, torchao's own."""
    scale = self._precomputed_scale  # read once: the post-step hook re-assigns it
    # traced (FSDP2's hooks compiled, skip_fsdp_hooks=False), inductor fuses torchao's cast itself
    if (torch.compiler.is_compiling() or not vars(self).get(_MARK) or scale is None
            or self._tensor.numel() == 0):
        return _torchao_pre_all_gather(self, mesh)
    return (gather_cast(self._tensor, scale, self._dtype),), (scale,)


def supported() -> bool:
    """Whether torchao's `fsdp_pre_all_gather` is the one this cast stands in for: `(self, mesh)`, returning the
    shard's FP8 bytes and scale. A torchao that changed it keeps its own cast (the plan says so)."""
    import inspect

    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor as Weight

    method = _torchao_pre_all_gather or Weight.fsdp_pre_all_gather
    return list(inspect.signature(method).parameters) == ["self", "mesh"]


def _replace_torchaos_method() -> bool:
    global _torchao_pre_all_gather
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor as Weight

    if not supported():
        return False
    if Weight.fsdp_pre_all_gather is not _pre_all_gather:
        _torchao_pre_all_gather = Weight.fsdp_pre_all_gather
        Weight.fsdp_pre_all_gather = _pre_all_gather
    return True


def fuse_gather_casts(model: nn.Module) -> int:
    """Mark every FSDP2-sharded torchao weight of `model` for the one-kernel cast before its all-gather; returns
    how many (none where torchao's method is not the one it stands in for). Run once the model is wrapped: FSDP2
    makes the local tensors it gathers when it shards."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    if not _replace_torchaos_method():
        return 0
    count = 0
    for param in model.parameters():
        local = getattr(param, "_local_tensor", None)
        if isinstance(local, WeightWithDynamicFloat8CastTensor):
            setattr(local, _MARK, True)
            count += 1
    return count


def fused_gather_casts(model: nn.Module) -> int:
    """How many of `model`'s sharded weights are cast in one kernel (evidence for the harness and the tests)."""
    return sum(bool(vars(local).get(_MARK)) for p in model.parameters()
               if (local := getattr(p, "_local_tensor", None)) is not None)
