"""The first step of TransformerEngine's DelayedScaling, cast with scales from its own tensors.

DelayedScaling casts each tensor with a scale computed from the amaxes of earlier steps, and TE starts every
scale at 1 with an empty amax history. So the first step casts with scale 1: an input above 448 saturates, and the
output gradients of a loss averaged over a batch of tokens (dL/dlogits is at most 1/8192 for 4 x 2048 tokens, and
smaller in the layers below) mostly fall under E5M2's smallest subnormal, 2**-16 = 1.5e-5, and are lost. (A
0.02-std weight lands among E4M3's subnormals, spacing 2**-9: a few percent of its size, about E4M3's own
precision.) On the d4096 proxy that first update took the loss from 6.37 to 6.47 where BF16's went to 5.60, and
te:delayed ended 1.98% above BF16's held-out loss after 300 steps (two seeds, eager; with
amax_compute_algo="most_recent" 0.82%, one seed), while current scaling, which has no such first step, ended 0.61%
below it (results/gpu/2026-11-29-h200-convergence-ec1ce24).

lowprec's TE Linear seeds the scales of its first FP8 forward (input, weight) and of its first backward (output
gradient) from the tensors about to be cast, with TE's own update rule (fp8_max / amax / 2**margin): the first step
is cast as current scaling would cast it, and TE's delayed scaling runs as configured from the second step on.
- A scale whose amax history is not empty (a checkpoint loaded before the first step) is left as it is.
- A zero or non-finite amax leaves the scale at 1: a non-finite amax never becomes a scale.
- On the device, no host sync; one amax per tensor, once per module (a Python flag ends it).
- An FP8 weight (quantized_model_init) or FP8 input was quantised with its own scale already: not touched.
`LOWPREC_TE_FIRST_SCALES=0` leaves TE's first step as TE makes it (scale 1), for the A/B.
"""

from __future__ import annotations

import torch

from ...kernels.scaling import tensor_amax
from ...utils.env import switch

ENV = "LOWPREC_TE_FIRST_SCALES"
# TE's slots for a Linear (one GEMM): FP8FwdTensors.GEMM1_INPUT, GEMM1_WEIGHT; FP8BwdTensors.GRAD_OUTPUT1.
# The same numbers in every TE 2.x; the GPU test checks them against TE's constants.
FWD_INPUT, FWD_WEIGHT, BWD_GRAD_OUTPUT = 0, 1, 0
# a module's `_lowprec_first_scales`: before its first FP8 forward, between that forward and its first backward, after
PENDING, BACKWARD, DONE = "pending", "backward", "done"


def enabled() -> bool:
    """`LOWPREC_TE_FIRST_SCALES`: 0 turns the seeding off; on by default."""
    return switch(ENV, "1 or unset: TE's DelayedScaling casts its first step with scales from that step's tensors; "
                       "0: with TE's initial scale of 1") is not False


def delayed_state(module: torch.nn.Module, key: str):
    """`module.fp8_meta[key]` ("scaling_fwd" / "scaling_bwd") when the module casts with DelayedScaling now."""
    meta = getattr(module, "fp8_meta", None) or {}
    recipe = meta.get("recipe")
    state = meta.get(key)
    if recipe is None or not recipe.delayed() or state is None or not hasattr(state, "amax_history"):
        return None
    return state


def _plain(tensor) -> bool:
    # TE's quantised tensors (FP8 weights, FP8 inputs) subclass torch.Tensor and carry their own scale
    return type(tensor) in (torch.Tensor, torch.nn.Parameter) and tensor.is_floating_point() and tensor.numel() > 0


@torch.no_grad()
def seed(state, index: int, tensor: torch.Tensor, fp8_max: float, margin: int) -> None:
    """Set `state.scale[index]` to TE's scale for `tensor`'s amax, if that slot's history is empty."""
    if not _plain(tensor):
        return
    amax = tensor_amax(tensor).to(state.scale.device)
    unseen = state.amax_history[:, index].eq(0).all()
    new = (fp8_max / amax) / (2.0 ** margin)
    ok = unseen & torch.isfinite(amax) & (amax > 0) & torch.isfinite(new)
    scale = state.scale[index]
    scale.copy_(torch.where(ok, new.to(scale.dtype), scale))


def seed_forward(module: torch.nn.Module, inp: torch.Tensor) -> str:
    """Before a forward of `module` in PENDING: seed its input and weight scales if it casts with DelayedScaling.
    Returns its phase after this forward: PENDING outside FP8 (the first FP8 forward seeds), BACKWARD once a
    DelayedScaling forward is seeded, DONE for other recipes and under LOWPREC_TE_FIRST_SCALES=0."""
    if not enabled():
        return DONE
    module.init_fp8_metadata()  # what TE's forward calls first; a no-op there once done here
    if not getattr(module, "fp8", False):
        return PENDING
    state = delayed_state(module, "scaling_fwd")
    if state is None:
        return DONE
    meta = module.fp8_meta
    fp8_max, margin = float(meta["fp8_max_fwd"]), int(meta["recipe"].margin)
    seed(state, FWD_INPUT, inp, fp8_max, margin)
    seed(state, FWD_WEIGHT, module.weight, fp8_max, margin)
    return BACKWARD


class _SeedGradScale(torch.autograd.Function):
    """Forward: the tensor as it is. Backward: seed the module's output-gradient scale from the gradient, once."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, module: torch.nn.Module) -> torch.Tensor:
        ctx.module = module
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        module = ctx.module
        state = delayed_state(module, "scaling_bwd")
        if state is not None and module._lowprec_first_scales == BACKWARD:
            meta = module.fp8_meta
            seed(state, BWD_GRAD_OUTPUT, grad, float(meta["fp8_max_bwd"]), int(meta["recipe"].margin))
        module._lowprec_first_scales = DONE
        return grad, None


class SeedsFirstScales:
    """Mixin for lowprec's TE Linear: its first DelayedScaling forward and backward cast with scales from their own
    tensors. `_lowprec_first_scales` goes PENDING -> BACKWARD -> DONE (see `seed_forward`); nothing while dynamo
    traces."""

    _lowprec_first_scales = PENDING

    def forward(self, inp, *args, **kwargs):
        if self._lowprec_first_scales == DONE or torch.compiler.is_compiling():
            return super().forward(inp, *args, **kwargs)
        if self._lowprec_first_scales == PENDING:
            self._lowprec_first_scales = seed_forward(self, inp)
        out = super().forward(inp, *args, **kwargs)
        if self._lowprec_first_scales != BACKWARD:
            return out
        if isinstance(out, tuple):  # return_bias=True: (output, bias)
            return (_seed_backward_of(out[0], self), *out[1:])
        return _seed_backward_of(out, self)


def _seed_backward_of(y: torch.Tensor, module: torch.nn.Module) -> torch.Tensor:
    # the gradient of `y` seeds `module`'s output-gradient scale before TE's backward casts it
    return _SeedGradScale.apply(y, module) if y.requires_grad else y
