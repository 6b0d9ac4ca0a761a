"""What a plan's forward keeps for backward: the saved-activations section of the precision plan.

Model state is no longer where training memory peaks: the tensors autograd saves in the forward are. Of
those the plan can size the Linear layers' inputs (each layer keeps its own copy of its input: autocast and
every FP8 backend cast it per layer) from the layers' widths, in the dtype the backend keeps them in. The
rest (norm, activation-function, attention inputs, residuals) is the model code's choice, so the plan
says in which dtype it is kept and `lowprec bench` measures the whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..kernels.activations import GROUP
from .selection import ModuleDecision

# Below this many elements a saved tensor is a scale, an amax, a mask row or a bias: packing it saves
# next to nothing and costs a cast and a small kernel launch each way.
MIN_ELEMENTS = 2**14
# FP8 storage of lowprec's saved-tensor hooks: one byte per element and an int8 exponent per group
HOOKS_BYTES_PER_ELEMENT = 1 + 1 / GROUP
HOOKS_STORAGE = f"FP8 E4M3, a power-of-2 scale per {GROUP} values (activation_dtype='fp8')"
BASELINE_STORAGE = "BF16 (autocast's copy of the input)"
BASELINE_BYTES_PER_ELEMENT = 2.0


@dataclass(frozen=True)
class SavedInput:
    """What one Linear layer keeps of its input for the weight gradient: how it is stored, bytes per
    element (scales included), and whether the FP8 saved-tensor hooks can still shrink it."""

    storage: str
    bytes_per_element: float
    packable: bool = False


@dataclass(frozen=True)
class SavedActivations:
    """The saved-activations section of a plan: per token, for one block of the model's block list (or
    the whole model where it has none), the Linear layers' saved inputs in this plan and in BF16 AMP."""

    fp8_linear_inputs: str
    kept_linear_inputs: str
    other_tensors: str
    linear_bytes_per_token: float
    baseline_linear_bytes_per_token: float
    per: str
    loss: str | None = None  # what the loss keeps for backward (runtime/loss.py), where the planner knows the model

    def lines(self) -> list[str]:
        ratio = (self.linear_bytes_per_token / self.baseline_linear_bytes_per_token
                 if self.baseline_linear_bytes_per_token else 1.0)
        return [
            f"saved for backward (per token {self.per}):",
            f"  FP8 Linear inputs   {self.fp8_linear_inputs}",
            f"  kept Linear inputs  {self.kept_linear_inputs}",
            f"  all Linear inputs   estimated {_size(self.linear_bytes_per_token)} per token "
            f"(BF16 AMP {_size(self.baseline_linear_bytes_per_token)}: {ratio:.2f}x)",
            f"  other tensors       {self.other_tensors}",
            *([f"  loss                {self.loss}"] if self.loss else []),
        ]


def _size(n: float) -> str:
    return f"{n / 1024:.1f} KiB" if n >= 1024 else f"{n:.0f} B"


def saved_activations(modules: Sequence[ModuleDecision], fp8_input: SavedInput, activation_dtype: str | None,
                      blocks: tuple[str, int, str] | None, compiled: bool = False,
                      in_graph: bool = False, loss: str | None = None, fp32: str = "fp8",
                      recompute_fp8_copies: bool = False) -> SavedActivations:
    """The section for a plan whose Linear decisions are `modules`, whose backend keeps an FP8 layer's input
    as `fp8_input`; `blocks` is (block list name, count, block class) or None; `compiled`: the model is
    compiled whole (its graph decides what is saved); `in_graph`: compiled graphs encode what they save
    themselves (by default for a model compiled on one process; LOWPREC_FP8_ACTIVATIONS_IN_GRAPH); `loss`: what
    the model's loss keeps for backward (runtime/loss.py); `fp32`: how the FP32 tensors the hooks would encode are
    stored (fp8, bf16 or keep: LOWPREC_FP8_ACTIVATIONS_FP32); `recompute_fp8_copies`: the graphs cast their FP8
    Linears' inputs again in backward rather than keep them (LOWPREC_RECOMPUTE_FP8_COPIES)."""
    hooks = activation_dtype == "fp8"
    fp8 = fp8_input
    if hooks and fp8.packable:
        fp8 = SavedInput(f"{HOOKS_STORAGE}, packed from the backend's high-precision copy",
                         HOOKS_BYTES_PER_ELEMENT)
    kept = (SavedInput(HOOKS_STORAGE, HOOKS_BYTES_PER_ELEMENT) if hooks
            else SavedInput(BASELINE_STORAGE, BASELINE_BYTES_PER_ELEMENT))
    linears = [m for m in modules if m.kind == "linear"]
    if blocks is not None:
        name, count, kind = blocks
        linears = [m for m in linears if m.fqn.startswith(name + ".")]
        per, divisor = f"in one {kind} of {count}", count
    else:
        per, divisor = "in the whole model (no block list found)", 1
    widths = [(m.shape[1], m.convert) for m in linears if len(m.shape) == 2]
    this = sum(w * (fp8.bytes_per_element if convert else kept.bytes_per_element) for w, convert in widths)
    baseline = sum(w * BASELINE_BYTES_PER_ELEMENT for w, _ in widths)
    if hooks:
        others = (f"{HOOKS_STORAGE}, decoded for backward; parameters and their views, 8-bit tensors, tensors "
                  f"under {MIN_ELEMENTS} elements, attention's log-sum-exp, a loss's log-probabilities, rotary angles "
                  "and tables (a compiled graph's inputs without a gradient, an eager model's views of tensors with no "
                  "autograd history) and, through the Python hooks, FP32 tensors with no autograd history kept as "
                  "saved")
        if fp32 != "fp8":
            others += ("; FP32 tensors (the residual stream under autocast) "
                       + ("in BF16" if fp32 == "bf16" else "kept in FP32") + " (LOWPREC_FP8_ACTIVATIONS_FP32)")
        if compiled:
            others += "; compiled model: the tensors its graph saves for backward"
        if in_graph:
            others += ("; compiled graphs encode and decode theirs inside the graph "
                       "(LOWPREC_FP8_ACTIVATIONS_IN_GRAPH=0: through Python hooks after each graph)")
        if recompute_fp8_copies:
            others += ("; an FP8 Linear's transposed input, where cast from tensors the backward keeps anyway, cast "
                       "again in backward rather than kept (LOWPREC_RECOMPUTE_FP8_COPIES=0: kept)")
    else:
        others = ("as autograd saves them (BF16 under autocast, FP32 in norms computed in FP32); "
                  "activation_dtype='fp8' stores them in FP8")
    return SavedActivations(fp8_linear_inputs=fp8.storage, kept_linear_inputs=kept.storage, other_tensors=others,
                            linear_bytes_per_token=this / divisor, baseline_linear_bytes_per_token=baseline / divisor,
                            per=per, loss=loss)
