"""TE's optimizer-state precision. With `fp8_weights`, TE's FusedAdam is the optimizer (it holds the FP32 masters
that requantise the FP8-only weights after each step) and `optimizer_states` chooses the dtypes it keeps Adam's
moments in, its `exp_avg_dtype` / `exp_avg_sq_dtype`; without, lowprec's low-bit Adam, as for every backend.

What TE's FusedAdam does with each (transformer_engine/pytorch/optimizers/fused_adam.py): BF16 moments (both) go to
its kernel as they are; FP16 and FP8 ones, each with one FP32 scale per tensor, are unscaled to FP32 copies for the
step's kernel and scaled back after it, so a step holds FP32 moments of a parameter group for its duration.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch

from ...utils.tensors import local_shard
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


def complete_fused_adam_state(optimizer: torch.optim.Optimizer, loading: bool = False) -> None:
    """Give each trainable parameter of TE's FusedAdam without state the state its first step would make (its
    `initialize_state`, as `step` calls it), and each group its step count.
    With fp8_weights the FP8 weights' masters are seeded at prepare(), before any step, so the optimizer holds some
    state and DCP's `get_optimizer_state_dict`, which makes state (by a step at learning rate 0) only where there is
    none at all, would save and load the FP8 weights' alone: Accelerate's FSDP2 load_state then failed with "Missing
    optimizer state for parameter 'model.embed_tokens.weight'" (one H200, 128d7a2). A load fills only the entries
    its template has, so the groups' "step" too, or a resumed run would restart Adam's bias correction. `loading`:
    each master is marked for the load to replace (below)."""
    for group in optimizer.param_groups:
        if "step" not in group:
            # FusedAdam (lowprec builds it with capturable=False: an int count) adds 1 to it as it starts from 1
            # without it: the first step is 1 either way
            group["step"] = 0
        for p in group["params"]:
            if p.requires_grad and not optimizer.state.get(p):
                remainders = bool(getattr(optimizer, "store_param_remainders", False)) and p.dtype == torch.bfloat16
                optimizer.initialize_state(p, store_param_remainders=remainders)
            master = optimizer.state.get(p, {}).get("master_param")
            if loading and master is not None and master.is_floating_point():
                # NaN until the load replaces it: a load that keeps what it has no entry for (FSDP2's full state dict
                # on several processes, from a checkpoint saved without fp8_weights) would otherwise leave the
                # masters of the model before the load, which the next step writes into the FP8 weights;
                # `seed_missing_masters` seeds what stayed NaN from the loaded weights
                local_shard(master).fill_(float("nan"))


def requantize_from_masters(optimizer: torch.optim.Optimizer) -> None:
    """Write each FP8-only weight of TE's FusedAdam(master_weights=True) from its FP32 master, as its step does after
    each update (`quantize_` of the local shard). After a load the masters are what the run continues from: a
    checkpoint written whole holds the weights dequantised (`modules.dequantize_entries`), which the load quantises
    again with scales of its own, not necessarily the bytes the step wrote."""
    from .modules import is_te_tensor

    if not getattr(optimizer, "master_weights", False):
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            local = local_shard(p)
            if is_te_tensor(local) and "master_param" in optimizer.state.get(p, {}):
                with torch.no_grad():
                    local.quantize_(optimizer.get_unscaled_state(p, "master_param"))


def from_adam_form(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """FusedAdam's load_state_dict pre-hook: a checkpoint of Adam's form (saved without fp8_weights) with its moments
    in FP32 (LowBitAdamW's dequantised with their scales) and its steps made the groups' (`optim.fused_adam_form`);
    the masters it lacks are seeded after the load (`seed_missing_masters`)."""
    from ...optim.fused_adam_form import per_group_steps
    from ...optim.low_bit_adam import plain_adam_state_dict

    converted = per_group_steps(plain_adam_state_dict(state_dict))
    if converted is not state_dict:
        # TE's load_state_dict makes each state again from the dict it was given, not from a hook's result (torch's
        # part of the load takes that): the states go into the given dict's, entry by entry
        state_dict["state"].clear()
        state_dict["state"].update(converted["state"])
    return converted


def seed_missing_masters(optimizer: torch.optim.Optimizer) -> int:
    """After a load: give each parameter of TE's FusedAdam(master_weights=True) that has state but no FP32 master one
    from its weight (an FP8-only weight's dequantised value), as `initialize_state` does; returns how many. A checkpoint
    of Adam's form (saved without fp8_weights) holds moments and no masters, and FusedAdam's step reads one for every
    parameter."""
    from .modules import is_te_tensor

    seeded = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p)
            if not state:
                continue
            master = local_shard(state.get("master_param"))
            # a master the load gave stays; one all NaN was marked before the load (complete_fused_adam_state) and
            # kept by it; an empty shard has nothing to seed
            if master is not None and (master.numel() == 0 or not master.is_floating_point()
                                       or not master.isnan().all()):
                continue
            local = local_shard(p)
            value = local.dequantize(dtype=torch.float32) if is_te_tensor(local) else local.detach().float()
            optimizer.set_scaled_state(p, "master_param", value.clone())
            seeded += 1
    return seeded


def after_fused_adam_load(optimizer: torch.optim.Optimizer) -> None:
    """After a load into TE's FusedAdam (fp8_weights): masters for the parameters the checkpoint had none for (one of
    Adam's form), with a warning, then every FP8-only weight written from its master."""
    seeded = seed_missing_masters(optimizer)
    if seeded:
        # FSDP2's full-state load on several processes keeps only the entries FusedAdam's own state dict has: Adam's
        # per-parameter steps are dropped before any hook sees them
        restart = any(not group.get("step") for group in optimizer.param_groups)
        warnings.warn(f"lowprec: the optimizer checkpoint had no FP32 master weights (saved without fp8_weights): "
                      f"{seeded} masters start from the weights as loaded, the FP8 ones rounded to FP8"
                      + ("; Adam's step count did not load (FSDP2's full state dict keeps no per-parameter step), "
                         "its bias correction restarts" if restart else ""), stacklevel=4)
    requantize_from_masters(optimizer)


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
