"""TE's optimizer-state precision. With `fp8_weights`, TE's FusedAdam is the optimizer (it holds the FP32 masters
that requantise the FP8-only weights after each step) and `optimizer_states` chooses the dtypes it keeps Adam's
moments in, its `exp_avg_dtype` / `exp_avg_sq_dtype`; without, lowprec's low-bit Adam, as for every backend.

What TE's FusedAdam does with each (transformer_engine/pytorch/optimizers/fused_adam.py): BF16 moments (both) go to
its kernel as they are; FP16 and FP8 ones, each with one FP32 scale per tensor, are unscaled to FP32 copies for the
step's kernel and scaled back after it, so a step holds FP32 moments of a parameter group for its duration.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..parts import OptimizerPrecision

if TYPE_CHECKING:
    from ...planning.plan import TensorPrecision

FP32_MOMENTS_BYTES = 8.0  # FusedAdam's default: exp_avg and exp_avg_sq in FP32


def fused_adam_state_dtypes(states: str | None) -> dict[str, torch.dtype]:
    """FusedAdam's `exp_avg_dtype` / `exp_avg_sq_dtype` for `optimizer_states` (None: its FP32 default). The recipe
    refused what FusedAdam cannot keep (E5M2) when it was made."""
    from ...optim.levels import FUSED_ADAM_STATE_DTYPES, state_pair

    if states is None:
        return {"exp_avg_dtype": torch.float32, "exp_avg_sq_dtype": torch.float32}
    m, v = state_pair(states)
    return {"exp_avg_dtype": FUSED_ADAM_STATE_DTYPES[m], "exp_avg_sq_dtype": FUSED_ADAM_STATE_DTYPES[v]}


def check_fused_adam_source(optimizer: torch.optim.Optimizer) -> None:
    """Raise ValueError if `optimizer` cannot become TE's FusedAdam(master_weights=True) as it is (fp8_weights)."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        raise ValueError(
            "FP8RecipeKwargs(fp8_weights=True) needs master weights: lowprec moves torch.optim.Adam / AdamW to "
            f"TransformerEngine's FusedAdam(master_weights=True); got {type(optimizer).__name__}"
        )
    unsupported = [k for k in ("amsgrad", "maximize") if optimizer.defaults.get(k)]
    if unsupported:
        # FusedAdam has neither: dropping them would silently train another optimizer
        raise ValueError(
            f"FP8RecipeKwargs(fp8_weights=True) moves {type(optimizer).__name__} to TransformerEngine's FusedAdam, "
            f"which has no {' / '.join(unsupported)}; set {', '.join(k + '=False' for k in unsupported)} or "
            "fp8_weights=False"
        )


def moments_problem(recipe_name: str, states: str | None) -> str | None:
    """Why FusedAdam cannot keep `states` under TE's `recipe_name` with fp8_weights, or None. Both moments in BF16
    go to its kernels as stored, and the kernel that steps delayed-scaling FP8 weights (`multi_tensor_adam_fp8`)
    takes FP32 moments only; any other choice is unscaled to FP32 for it."""
    if recipe_name == "delayed" and states is not None and set(fused_adam_state_dtypes(states).values()) == {
            torch.bfloat16}:
        return (f"FP8RecipeKwargs(backend='te', recipe='delayed', fp8_weights=True, optimizer_states={states!r}): "
                "TE's FusedAdam hands BF16 moments to its kernel as stored, and its kernel for delayed-scaling FP8 "
                "weights takes FP32 moments only; use recipe='current', or optimizer_states 'fp16', 'fp8' or a pair "
                "that is not both 'bf16'")
    return None


def complete_fused_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Give each trainable parameter of TE's FusedAdam without state the state its first step would make (its
    `initialize_state`, as `step` calls it), and each group its step count.
    With fp8_weights the FP8 weights' masters are seeded at prepare(), before any step, so the optimizer holds some
    state and DCP's `get_optimizer_state_dict`, which makes state (by a step at learning rate 0) only where there is
    none at all, would save and load the FP8 weights' alone: Accelerate's FSDP2 load_state then failed with "Missing
    optimizer state for parameter 'model.embed_tokens.weight'" (one H200, 128d7a2). A load fills only the entries
    its template has, so the groups' "step" too, or a resumed run would restart Adam's bias correction."""
    for group in optimizer.param_groups:
        if "step" not in group:
            # FusedAdam (lowprec builds it with capturable=False: an int count) adds 1 to it as it starts from 1
            # without it: the first step is 1 either way
            group["step"] = 0
        for p in group["params"]:
            if p.requires_grad and not optimizer.state.get(p):
                remainders = bool(getattr(optimizer, "store_param_remainders", False)) and p.dtype == torch.bfloat16
                optimizer.initialize_state(p, store_param_remainders=remainders)


def requantize_from_masters(optimizer: torch.optim.Optimizer) -> None:
    """Write each FP8-only weight of TE's FusedAdam(master_weights=True) from its FP32 master, as its step does after
    each update (`quantize_` of the local shard). After a load the masters are what the run continues from: a
    checkpoint written whole holds the weights dequantised (`modules.dequantize_entries`), which the load quantises
    again with scales of its own, not necessarily the bytes the step wrote."""
    from torch.distributed.tensor import DTensor

    from .modules import is_te_tensor

    if not getattr(optimizer, "master_weights", False):
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            local = p.to_local() if isinstance(p, DTensor) else p
            if is_te_tensor(local) and "master_param" in optimizer.state.get(p, {}):
                with torch.no_grad():
                    local.quantize_(optimizer.get_unscaled_state(p, "master_param"))


class TEOptimizerPrecision(OptimizerPrecision):
    @property
    def fused_adam(self) -> bool:
        return bool(self.owner.recipe.fp8_weights)

    def check(self, optimizer: torch.optim.Optimizer) -> None:
        # before the model is converted: with fp8_weights, what FusedAdam takes, not lowprec's low-bit Adam
        if self.fused_adam:
            check_fused_adam_source(optimizer)
        else:
            super().check(optimizer)

    def row(self, param_dtype: str) -> TensorPrecision:
        if not self.fused_adam:
            return super().row(param_dtype)
        from ...optim.levels import state_description
        from ...planning.plan import TensorPrecision

        states = self.owner.optimizer_states
        if states is None:
            return TensorPrecision("optimizer_states", "FP32+FP32", "TE FusedAdam's default")
        kinds = set(fused_adam_state_dtypes(states).values())
        how = ("FP32, its default" if kinds == {torch.float32} else "read by its kernel as stored"
               if kinds == {torch.bfloat16} else "unscaled to FP32 copies for each step's kernel (FP16 and FP8 "
               "moments with one FP32 scale per tensor)")
        return TensorPrecision("optimizer_states", state_description(states),
                               f"optimizer_states={states!r}: TE FusedAdam, {how}")

    def state_bytes(self, param_dtype: torch.dtype) -> float:
        if self.fused_adam and self.owner.optimizer_states is None:
            return FP32_MOMENTS_BYTES
        return super().state_bytes(param_dtype)
