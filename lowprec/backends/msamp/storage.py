"""msamp's weight storage: its FP8Linear realises the level's weight and weight-gradient columns itself.

The shared part casts other backends' converted weights and moves their gradients into `GradStore`s.
msamp's layers are built in the level's weight dtype and keep their FP8 weight gradients on themselves,
so this part builds nothing: at O1/O2 it holds the layers as its stores, and the shared part's DDP
reduction (`FP8GradReducer`), clipping, `zero_grad` and optimizer hand-over serve them as they serve
stores. At O3 the layers are no stores: FSDP2 reduce-scatters their gradients into `.grad`, and under
DeepSpeed `zero.ZeroFP8Weights` (the communication part's) averages them and steps their masters.
The plan's weight, master-weight and weight-gradient rows and bytes are the level's, per engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ...optim.grad_store import clear_in_zero_grad, ignore_in_ddp
from ...optim.low_bit_adam import in_place_update
from ..parts import WeightStorage

if TYPE_CHECKING:
    from ...planning.plan import PrecisionPlan, TensorPrecision
    from .owner import LevelOwner


class MSAMPStorage(WeightStorage):
    owner: LevelOwner

    def grad_store_dtype(self, weight_dtype: torch.dtype | None) -> torch.dtype | None:
        # O3's layers hold no gradient for the optimizer to read: FSDP2 reduces them into .grad, and
        # under DeepSpeed ZeroFP8Weights averages them and steps the masters itself.
        return None if self.owner.level == "O3" else super().grad_store_dtype(weight_dtype)

    def check_engine(self) -> None:
        """Nothing to refuse here: the adapter checked its level against the engine before its parts were
        built (`communication.engine_problem`); the shared check is of stores on other backends' layers."""

    def remember_dtypes(self, model: nn.Module, plan: PrecisionPlan) -> None:
        """Before conversion: the dtypes `restore_weight_dtypes` gives back to what the layers store in
        `weight_dtype` (their weights, and under O3 their biases too)."""
        for decision in plan.converted:
            fqn = "" if decision.fqn == "<root>" else decision.fqn
            module = model.get_submodule(fqn)
            prefix = fqn + "." if fqn else ""
            self.original_weight_dtypes[prefix + "weight"] = module.weight.dtype
            if self.owner.sharded and module.bias is not None:  # O3 stores the bias in the weight's dtype too
                self.original_weight_dtypes[prefix + "bias"] = module.bias.dtype

    def hold(self, root: nn.Module) -> None:
        """After conversion: hold the converted layers (`owner.layers`) as the level needs. Called by
        `convert` itself, so that a model converted without `apply_storage` trains as one prepared."""
        layers = self.owner.layers
        if self.owner.sharded:
            return  # gradients go through FSDP2's .grad; no stores, nothing for DDP
        if self.owner.zero_o3:  # zero.ZeroFP8Weights averages and reads the FP8 gradients, not the optimizer
            clear_in_zero_grad(root, layers)
            return
        # The layers hold their FP8 weight gradients as gradient stores do: the optimizer swap, clipping,
        # zero_grad and DDP reduction (FP8GradReducer) serve both. A frozen layer has none to hold, so it
        # is no store (nothing to average or step), as under torchao.
        self.grad_stores = [layer for layer in layers if layer.weight.requires_grad]
        frozen = [layer for layer in layers if not layer.weight.requires_grad]
        # DDP neither reduces their weights nor broadcasts their FP8 state (scales, amax histories); a
        # frozen weight DDP broadcasts at wrap like any other, as the stores' weights are (setup_after_wrap)
        ignore_in_ddp(root, self.grad_stores, buffer_prefix="")
        ignore_in_ddp(root, frozen, buffer_prefix="", weights=False)
        clear_in_zero_grad(root, layers)

    def apply(self, root: nn.Module) -> None:
        """Nothing to cast or install: the layers were built in the level's dtypes and held by `hold`."""

    def gradients_outside_grad(self) -> str | None:
        return None if self.owner.sharded else "in FP8 on its layers (FP8Linear)"

    # ----- in the plan -------------------------------------------------------------------------------
    def rows(self, rows: list[TensorPrecision], plan: PrecisionPlan) -> list[TensorPrecision]:
        """`rows` with the level's weight, master-weight and weight-gradient entries."""
        from ...planning.plan import TensorPrecision, short_dtype

        owner, hp = self.owner, plan.param_dtype
        wdt = short_dtype(owner.weight_dtype)
        per_step = "current per-tensor power-of-2 scale; micro-batches dequantise + add + requantise"
        if not plan.converted:
            # nothing becomes an FP8Linear: weights and their gradients stay as they are
            mine = [TensorPrecision("weight", hp), TensorPrecision("master_weight", "N/A"),
                    TensorPrecision("weight_grad", hp)]
        elif owner.sharded:
            mine = [
                TensorPrecision("weight", f"FP8 E4M3 (Linear), {hp} (rest)",
                                "all-gathered per use from the FP16 masters, one power-of-2 scale per tensor from "
                                "its amax over all ranks; freed when FSDP2 reshards"),
                TensorPrecision("master_weight", f"{wdt} (Linear), sharded over {owner.context.world_size} ranks "
                                "by FSDP2", "the FSDP2 parameter itself; LowBitAdamW updates it"),
                TensorPrecision("weight_grad", f"{wdt} shards (Linear), {hp} (rest)",
                                "from autograd to FSDP2's reduce-scatter (see grad comm), kept sharded in .grad"),
            ]
        elif owner.zero_o3:
            ep = owner.context.engine_precision
            rest, rest_master = ep.weight or hp, ep.master_weight or hp
            mine = [
                TensorPrecision("weight", f"FP8 E4M3 (Linear, every rank), {rest} (rest)",
                                "one power-of-2 scale per tensor, requantised from the master by its owner after each "
                                "step and broadcast"),
                TensorPrecision("master_weight", f"{wdt} (Linear, whole tensors over {owner.context.world_size} "
                                f"ranks), {rest_master} (rest)",
                                "MS-AMP's ZeRO assignment: largest first to the least-loaded rank"),
                TensorPrecision("weight_grad", f"FP8 E4M3 (Linear), {rest} (rest)", per_step),
            ]
        else:
            mine = [TensorPrecision("weight", f"{wdt} (Linear), {hp} (rest)", in_place_update(owner.weight_dtype)),
                    TensorPrecision("master_weight", "N/A"),
                    TensorPrecision("weight_grad", f"FP8 E4M3 (Linear), {hp} (rest)", per_step)]
        by_kind = {row.kind: row for row in mine}
        return [by_kind.get(row.kind, row) for row in rows]

    def counts_per_rank(self) -> bool:
        return self.owner.level == "O3"

    def adjust_bytes(self, out: dict[str, float], plan: PrecisionPlan, param_dtype: torch.dtype) -> dict[str, float]:
        """`out` with the level's weight, gradient and master bytes per parameter, per rank at O3."""
        share, size = plan.fp8_param_share, param_dtype.itemsize
        master, n = self.owner.weight_dtype.itemsize, self.owner.context.world_size
        if self.owner.sharded:
            # FSDP2 shards everything; the FP8 weight exists only while a layer runs
            mine = {"weight": (1 - share) * size / n, "weight_grad": (share * master + (1 - share) * size) / n,
                    "master_weight": share * master / n}
        elif self.owner.zero_o3:
            # FP8 weight and gradient everywhere, FP16 master on one rank per tensor; the rest as DeepSpeed
            # keeps it (`out`: BF16 weight and gradient, FP32 master partition)
            rest_w = out["weight"]
            mine = {"weight": share * 1 + (1 - share) * rest_w, "weight_grad": share * 1 + (1 - share) * rest_w,
                    "master_weight": share * master / n + (1 - share) * out["master_weight"] / n}
        else:
            mine = {"weight": share * master + (1 - share) * size, "weight_grad": share * 1 + (1 - share) * size,
                    "master_weight": 0.0}
        return {**out, **mine}
