"""Optimizer-state precision, the part adapters share (msamp's extends it): lowprec's low-bit Adam where asked or
needed."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ...planning.plan import PrecisionPlan, TensorPrecision
    from .owner import Owner


class OptimizerPrecision:
    """The optimizer-state column of `owner`'s plan, and the optimizer `prepare()` hands back."""

    def __init__(self, owner: Owner):
        self.owner = owner

    @property
    def states(self) -> str | None:
        """The optimizer-state storage in force ('fp8', 'e4m3+e4m3', ...), or None: the optimizer's own.

        Weights below FP32 or gradients in stores need lowprec's low-bit Adam (FP32 update math, reads
        the stores), with FP32 states unless asked otherwise."""
        storage = self.owner.storage
        states = storage["optimizer_states"]
        if states is None and self._needs_low_bit_adam():
            return "fp32"
        return states

    def _needs_low_bit_adam(self) -> bool:
        storage = self.owner.storage
        return storage["weight_dtype"] in ("fp16", "bf16") or storage["weight_grad_dtype"] in ("fp8", "bf16")

    @property
    def asked(self) -> str:
        """The option that asks for lowprec's low-bit Adam, as the user set it, for messages (the states in
        force are the level's or FP32, which the user may never have written)."""
        owner = self.owner
        recipe, storage = owner.recipe, owner.storage
        if recipe.optimizer_states is not None:
            return f"optimizer_states={recipe.optimizer_states!r}"
        level = storage["opt_level"]
        if level is not None:
            return f"opt_level={level!r}" + ("" if recipe.opt_level is not None else
                                             f" (backend {owner.name!r}'s default)")
        knob = "weight_dtype" if storage["weight_dtype"] in ("fp16", "bf16") else "weight_grad_dtype"
        return owner.spec.written(recipe, knob)

    def check(self, optimizer: torch.optim.Optimizer) -> None:
        """Raise ValueError, before any model is converted, if `wrap` would refuse `optimizer`."""
        if self.owner.optimizer_states is not None:
            from ...optim.levels import check_optimizer

            check_optimizer(optimizer, self.owner.optimizer_states, backend=self.owner.name, asked=self.asked)

    def wrap(self, optimizer: torch.optim.Optimizer, plan: PrecisionPlan) -> torch.optim.Optimizer:
        """Low-bit states replace Adam/AdamW with lowprec's low-bit Adam, which also reads the weight
        gradients kept in stores."""
        states = self.owner.optimizer_states
        if states is None:
            return optimizer
        from ...optim.levels import low_bit_optimizer

        new = low_bit_optimizer(optimizer, states, backend=self.owner.name, asked=self.asked)
        storage = self.owner.weight_storage
        if storage.grad_stores:
            new.attach_fp8_grads(storage.grad_stores)
            new.add_fp8_pre_step(storage.reduce_if_pending)
            # gradients stored after this step are not averaged yet, also those of a `loss.backward()` called
            # directly (Accelerator.backward marks them itself)
            new.register_step_post_hook(lambda *_args, **_kwargs: storage.mark_pending())
        return new

    def row(self, param_dtype: str) -> TensorPrecision:
        """The optimizer-state column: the low-bit states in force, or the parameters' dtype."""
        from ...optim.levels import state_description
        from ...planning.plan import TensorPrecision

        states = self.owner.optimizer_states
        if states is None:
            return TensorPrecision("optimizer_states", f"{param_dtype}+{param_dtype}")
        why = (f"optimizer_states={states!r}" if self.owner.recipe.optimizer_states is not None
               else f"level {self.owner.opt_level}")
        return TensorPrecision("optimizer_states", state_description(states),
                               f"{why}: lowprec.optim.LowBitAdam(W), per-tensor power-of-2 scales")

    def state_bytes(self, param_dtype: torch.dtype) -> float:
        """Bytes per parameter of Adam's two moments as stored."""
        from ...optim.levels import state_bytes

        states = self.owner.optimizer_states
        return 2 * param_dtype.itemsize if states is None else state_bytes(states)
