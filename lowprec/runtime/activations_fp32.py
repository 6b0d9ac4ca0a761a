"""What `activation_dtype='fp8'` does with the FP32 tensors it would otherwise encode: `LOWPREC_FP8_ACTIVATIONS_FP32`.

Under autocast with FP32 parameters the residual stream is FP32: the embedding's output and each residual add, which
the norms save (4 bytes an element, twice a BF16 activation's). By default they are stored in FP8 like the rest;
`bf16` stores them in BF16 (2 bytes, a relative error of 2**-9 where FP8's is 2**-4: what a model trained in BF16
keeps anyway), `keep` leaves them in FP32. On the d4096 proxy (300 steps, two seeds each against six BF16 runs)
msamp O2's held-out loss was -0.80% of BF16's with them in FP8, -0.10% in BF16 and -0.39% kept, the last two at
0.18 / 0.56 GiB more peak (results/gpu/2026-11-28-h200x2-act8-seeds-6db774f): no better, so FP8 stays the default.
Rotary angles, and under the Python hooks FP32 tensors with no autograd history, are kept whatever this says.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

ENV = "LOWPREC_FP8_ACTIVATIONS_FP32"
POLICIES = ("fp8", "bf16", "keep")


def fp32_policy() -> str:
    """`LOWPREC_FP8_ACTIVATIONS_FP32`: fp8 (unset), bf16 or keep."""
    value = os.environ.get(ENV, "").strip().lower() or "fp8"
    if value not in POLICIES:
        raise ValueError(f"{ENV}={os.environ[ENV]!r} is not one of {', '.join(POLICIES)} (fp8: FP32 saved tensors "
                         "stored in FP8 like the rest, the default; bf16: in BF16; keep: left in FP32)")
    return value


class NarrowedTensor(NamedTuple):
    """An FP32 tensor stored in BF16 (`data`), with the dtype it comes back in."""

    data: torch.Tensor
    dtype: torch.dtype

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


def narrow(tensor: torch.Tensor) -> NarrowedTensor:
    """`tensor` in BF16 (a view's strides are not kept: the caller narrows contiguous tensors, or a graph's, whose
    backward takes the layout it computes)."""
    return NarrowedTensor(tensor.detach().to(torch.bfloat16), tensor.dtype)


def widen(saved: NarrowedTensor) -> torch.Tensor:
    """The tensor `narrow` stored, in its dtype (BF16's values, exactly)."""
    return saved.data.to(saved.dtype)
