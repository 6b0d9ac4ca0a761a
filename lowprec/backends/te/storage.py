"""TE's weight storage: the shared part's knobs, and `fp8_weights`, where TE keeps converted Linear
weights in FP8 only, quantised at init and after each step by FusedAdam from its FP32 masters
(single process, DDP, and FSDP2 with per-tensor recipes, where the FP8 weights are FSDP2's shards and
everything is counted per rank: fsdp.py; the adapter refuses FSDP1 and DeepSpeed). `fp8_weights` and
the storage knobs are one choice (`FP8RecipeKwargs` refuses both), so the shared part changes nothing
it changes."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..parts import WeightStorage

if TYPE_CHECKING:
    from ...planning.plan import PrecisionPlan, TensorPrecision


class TEWeightStorage(WeightStorage):
    def rows(self, rows: list[TensorPrecision], plan: PrecisionPlan) -> list[TensorPrecision]:
        from ...planning.plan import TensorPrecision

        rows = super().rows(rows, plan)
        if not self.owner.recipe.fp8_weights:
            return rows
        hp = plan.param_dtype
        mine = {"weight": TensorPrecision("weight", f"FP8 E4M3 (Linear), {hp} (rest)",
                                          "quantised at init and after each step by FusedAdam"),
                "master_weight": TensorPrecision("master_weight", "FP32 (TE FusedAdam)")}
        if self.owner.gathers_fp8_weights:
            n = self.owner.context.world_size
            rest = self.owner.engine_rows(hp)[1].dtype  # the rest as FSDP2's mixed-precision policy gathers it
            scale = {"delayed": "one delayed scale per tensor, its amaxes all-reduced across ranks",
                     "current": "one scale per tensor from its amax all-reduced over the FSDP2 mesh"
                     }[self.owner.recipe_name]
            mine = {"weight": TensorPrecision(
                        "weight", f"FP8 E4M3 (Linear, sharded over {n} ranks, all-gathered as FP8), {rest} (rest)",
                        f"TE's Float8Tensor is the FSDP2 shard: its FP8 bytes are all-gathered ({scale}); "
                        "requantised after each step by FusedAdam"),
                    "master_weight": TensorPrecision("master_weight", f"FP32 (TE FusedAdam), sharded over {n} ranks",
                                                     "one FP32 shard per FP8 weight shard, seeded from the weight "
                                                     "before quantisation")}
        return [mine.get(row.kind, row) for row in rows]

    def counts_per_rank(self) -> bool:
        return bool(self.owner.recipe.fp8_weights and self.owner.gathers_fp8_weights)

    def adjust_bytes(self, out: dict[str, float], plan: PrecisionPlan, param_dtype: torch.dtype) -> dict[str, float]:
        out = super().adjust_bytes(out, plan, param_dtype)
        if self.owner.recipe.fp8_weights:
            # Converted Linear weights: 1 byte plus a 4-byte FP32 master; the rest unchanged.
            share = plan.fp8_param_share
            out["weight"] = share * 1 + (1 - share) * param_dtype.itemsize
            out["master_weight"] = share * 4
            if self.owner.gathers_fp8_weights:
                # FSDP2 shards everything, per rank: FP8 weight shards, FP32 gradient shards (the FP8
                # weights are nominally FP32, fsdp.py), FP32 master shards, FusedAdam's moments (optimizer.py)
                n = self.owner.context.world_size
                out["weight_grad"] = share * 4 + (1 - share) * out["weight_grad"]
                out = {k: v / n for k, v in out.items()}
        return out
