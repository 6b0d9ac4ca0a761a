"""The storage knobs `weight_dtype` / `weight_grad_dtype` on any backend's layers (lowprec.optim.grad_store).

The MS-AMP levels' weight and weight-gradient columns, realised on any backend's converted Linears:
weights cast in place, gradients moved out of `.grad` into `GradStore`s, the stores averaged under
DDP by `FP8GradReducer`, clipped with the rest, checked against the plan. msamp's own layers realise
them natively: its part (`lowprec.backends.msamp.storage`) builds nothing and holds those layers as
the stores, for the reduction, the clipping and the optimizer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ...planning.engines import fsdp_shards
from ..context import BackendUnavailableError

if TYPE_CHECKING:
    from ...planning.plan import PrecisionPlan, TensorPrecision
    from .owner import Owner

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class WeightStorage:
    def __init__(self, owner: Owner):
        self.owner = owner
        self.grad_stores: list = []
        self.reducer = None  # averages the stores' FP8 gradients under DDP
        self.blockwise = None  # or block by block during the backward (LOWPREC_FP8_GRAD_OVERLAP=1)
        self.original_weight_dtypes: dict[str, torch.dtype] = {}

    # ----- what the knobs ask for --------------------------------------------------------------------
    def weight_dtype(self) -> torch.dtype | None:
        """The dtype converted Linear weights are stored in, or None: the model's own."""
        return DTYPES.get(self.owner.storage["weight_dtype"])

    def grad_store_dtype(self, weight_dtype: torch.dtype | None) -> torch.dtype | None:
        """The dtype a `GradStore` keeps converted weights' gradients in, or None: `.grad` as usual
        (`weight_dtype`: the weights' storage, None when not known yet)."""
        grad = self.owner.storage["weight_grad_dtype"]
        if grad == "fp8":
            return torch.float8_e4m3fn
        if grad == "bf16" and weight_dtype != torch.bfloat16:
            return torch.bfloat16
        return None

    def stores_weight_grads(self, param_dtype: torch.dtype) -> bool:
        """Whether converted Linears keep their weight gradients outside `.grad` in a model of `param_dtype`."""
        weight = self.weight_dtype()
        return self.grad_store_dtype(weight if weight is not None else param_dtype) is not None

    def check_engine(self) -> None:
        """Raise `BackendUnavailableError` where the engine cannot run the knobs in force."""
        owner = self.owner
        engine = owner.context.engine
        if engine == "single":
            return
        storage = owner.storage
        weight, grad = storage["weight_dtype"], storage["weight_grad_dtype"]
        if engine == "ddp":
            # DDP averages .grad in the weights' dtype, and FP8GradReducer the FP8 stores; nothing
            # averages a BF16 store yet.
            if grad == "bf16" and weight != "bf16":
                raise BackendUnavailableError(
                    f"FP8RecipeKwargs(backend={owner.name!r}, weight_grad_dtype='bf16') keeps the gradients of "
                    f"{weight or 'the model'}'s weights in BF16 outside .grad, which nothing averages under DDP in "
                    "this version of lowprec; use weight_grad_dtype='fp8' (averaged in FP8) or weight_dtype='bf16'"
                )
            return
        # Named as the user set them: a knob the level filled in is shown as part of the level.
        knobs = [k for k in ("weight_dtype", "weight_grad_dtype") if storage[k] not in (None, "fp32")]
        wanted = [f"{k}={storage[k]!r}" for k in knobs if getattr(owner.recipe, k) is not None]
        implied = [f"{k}={storage[k]!r}" for k in knobs if getattr(owner.recipe, k) is None]
        if implied:
            wanted.append(f"opt_level={storage['opt_level']!r} ({', '.join(implied)})")
        if wanted:
            raise BackendUnavailableError(
                f"FP8RecipeKwargs(backend={owner.name!r}): {', '.join(wanted)} runs on one process or under DDP in "
                f"this version of lowprec, not under {engine}: its low-precision weights and gradients need "
                "sharded FP8 gradient communication, which is not there yet. Keep these knobs unset there "
                "(optimizer_states works everywhere)"
            )

    # ----- building them -----------------------------------------------------------------------------
    def apply(self, root: nn.Module) -> None:
        """Store converted weights in `weight_dtype` and keep their gradients in stores, as planned."""
        from ...optim.grad_store import clear_in_zero_grad, install_grad_stores

        converted = [(name, m) for name, m in root.named_modules() if self.owner.converted_kind(m) == "linear"
                     and isinstance(getattr(m, "weight", None), nn.Parameter)]
        dtype = self.weight_dtype()
        if dtype is not None:
            for name, module in converted:
                weight = module.weight
                if weight.dtype != dtype:
                    self.original_weight_dtypes[(name + "." if name else "") + "weight"] = weight.dtype
                    weight.data = weight.data.to(dtype)  # the same Parameter: the optimizer keeps it
        by_dtype: dict[torch.dtype, list[nn.Module]] = {}
        for _, module in converted:
            store_dtype = self.grad_store_dtype(module.weight.dtype)
            if store_dtype is not None:
                by_dtype.setdefault(store_dtype, []).append(module)
        for store_dtype, modules in by_dtype.items():
            self.grad_stores += install_grad_stores(modules, store_dtype)
        clear_in_zero_grad(root, self.grad_stores)
        if self.owner.context.engine == "ddp" and self.grad_stores:
            from ...optim.grad_store import ignore_in_ddp

            ignore_in_ddp(root, [store.module for store in self.grad_stores])

    def setup_after_wrap(self, model: nn.Module) -> None:
        """After wrapping: `model.zero_grad()` of the wrapper clears the stores too, and under DDP the
        stored FP8 gradients are averaged by `FP8GradReducer` (DDP ignores those weights, so their
        initial values are broadcast from rank 0 here)."""
        if not self.grad_stores:
            return
        import torch.distributed as dist

        from ...optim.grad_store import clear_in_zero_grad

        clear_in_zero_grad(model, self.grad_stores)
        ddp = self.owner.context.engine == "ddp" and dist.is_available() and dist.is_initialized()
        if ddp and dist.get_world_size() > 1 and self.reducer is None:
            from ...optim.grad_reduce import FP8GradReducer

            self.reducer = FP8GradReducer(self.grad_stores)
            with torch.no_grad():
                for store in self.grad_stores:
                    dist.broadcast(store.weight.data, src=0)
            self.blockwise = self._blockwise(model)

    def _blockwise(self, model: nn.Module):
        """`BlockwiseReduction` of the stores where asked for (`LOWPREC_FP8_GRAD_OVERLAP=1`) and possible: an
        eager DDP wrapper (a model compiled whole runs the blocks' hooks inside its graph) over a model with a
        block list; None otherwise (one reduction after the backward)."""
        from ...optim.grad_overlap import BlockwiseReduction, overlap_requested
        from ...planning.selection import find_blocks

        if not overlap_requested() or not isinstance(model, nn.parallel.DistributedDataParallel):
            return None
        found = find_blocks(model.module)
        if found is None:
            return None
        return BlockwiseReduction(self.grad_stores, list(found[1]),
                                  will_sync=lambda: model.require_backward_grad_sync, model=model.module)

    def verify(self, model: nn.Module) -> None:
        """Raise `PlanMismatchError` where a converted weight or its gradient is not stored as planned."""
        from ...planning.plan import PlanMismatchError

        planned = self.weight_dtype()
        stored = {id(store.weight) for store in self.grad_stores}
        wrong = []
        for name, module in model.named_modules():
            weight = getattr(module, "weight", None)
            if self.owner.converted_kind(module) != "linear" or not isinstance(weight, nn.Parameter):
                continue
            if planned is not None and weight.dtype != planned:
                wrong.append(f"{name}.weight: planned {planned}, built {weight.dtype}")
            # a frozen weight has no gradient to store (the plan's module list says so)
            store = self.grad_store_dtype(weight.dtype) if weight.requires_grad else None
            if (store is not None) != (id(weight) in stored):
                wrong.append(f"{name}.weight: gradient store planned {store}, "
                             f"built {'one' if id(weight) in stored else 'none'}")
        if wrong:
            raise PlanMismatchError("the converted model does not store weights as its plan says:\n  "
                                    + "\n  ".join(wrong))

    # ----- during training ---------------------------------------------------------------------------
    def reduce_if_pending(self) -> None:
        if self.reducer is None:
            return
        # a backward hooked block by block averaged the gradients as it ended: nothing left for the single pass
        if self.blockwise is not None and self.blockwise.finish(pending=self.reducer.pending):
            self.reducer.pending = False
        self.reducer.reduce_if_pending()

    def mark_pending(self) -> None:
        if self.reducer is not None:
            self.reducer.mark_pending()

    def after_backward(self, sync_gradients: bool) -> None:
        if self.reducer is None:
            return
        # Every backward may add local gradient, also after a reduction (two backwards per step):
        # reducing again averages (mean + local) into mean + mean of the locals.
        self.reducer.mark_pending()
        # a backward DDP synchronised, hooked block by block, averaged the gradients as it ended (the current
        # stream waits for the side stream), whatever Accelerate's flag says
        if self.blockwise is not None and self.blockwise.finish():
            self.reducer.pending = False
        elif sync_gradients:
            self.reducer.reduce_if_pending()

    def clip_grad_norm_(self, parameters, max_norm: float, norm_type: float = 2.0) -> torch.Tensor | None:
        """Clip with the stored gradients counted; None: nothing stored, Accelerate clips."""
        if not self.grad_stores:
            return None
        from ...optim.grad_store import clip_grad_norm_

        self.reduce_if_pending()
        return clip_grad_norm_(parameters, self.grad_stores, max_norm, norm_type)

    def gradients_outside_grad(self) -> str | None:
        if self.grad_stores:
            return f"of converted Linears in {self.grad_stores[0].dtype} gradient stores, not in .grad"
        return None

    def restore_weight_dtypes(self, state_dict: dict) -> dict:
        """Weights stored in `weight_dtype` back in the dtype the model was built with."""
        dtypes = self.original_weight_dtypes
        if not dtypes:
            return state_dict
        return {k: v.to(dtypes[k]) if k in dtypes and isinstance(v, torch.Tensor) else v for k, v in state_dict.items()}

    # ----- in the plan -------------------------------------------------------------------------------
    def rows(self, rows: list[TensorPrecision], plan: PrecisionPlan) -> list[TensorPrecision]:
        """`rows` with the weight and weight-gradient entries the storage knobs change."""
        from ...optim.grad_overlap import reduction_timing
        from ...optim.low_bit_adam import in_place_update
        from ...planning.plan import TensorPrecision, short_dtype

        owner = self.owner
        if not plan.converted:
            return rows
        hp = plan.param_dtype
        weight = self.weight_dtype()
        weight_name = short_dtype(weight) if weight is not None else hp
        store = self.grad_store_dtype(weight if weight is not None else DTYPES.get(hp.lower()))

        def why(knob: str) -> str:
            value = getattr(owner.recipe, knob)
            return f"{knob}={value!r}" if value is not None else f"level {owner.storage['opt_level']}"

        out = []
        for row in rows:
            if row.kind == "grad_comm" and owner.context.engine == "ddp" and store == torch.float8_e4m3fn:
                row = TensorPrecision("grad_comm", f"FP8 E4M3, shared scale (FP8 Linear), {row.dtype} (rest)",
                                      "stored weight gradients: amax all-reduced (MAX), FP8 all_to_all, FP32 sum, "
                                      f"FP8 all_gather, {reduction_timing()}; the rest by DDP")
            elif row.kind == "weight" and weight is not None:
                row = TensorPrecision("weight", f"{weight_name} (FP8 Linear), {row.dtype} (rest)",
                                      f"{why('weight_dtype')}: {in_place_update(weight)}")
            elif row.kind == "weight_grad" and (store is not None or weight is not None):
                kept = {torch.float8_e4m3fn: "FP8 E4M3", torch.bfloat16: "BF16"}.get(store, weight_name)
                if store is None:
                    note = f"{why('weight_dtype')}: in .grad, in the weights' dtype"
                else:
                    note = f"{why('weight_grad_dtype')}: taken from .grad by a post-accumulate-grad hook"
                    if store == torch.float8_e4m3fn:
                        note += "; per-tensor power-of-2 scale, micro-batches dequantise + add + requantise"
                row = TensorPrecision("weight_grad", f"{kept} (FP8 Linear), {row.dtype} (rest)", note)
            out.append(row)
        return out

    # adjust_bytes already counts one rank's share under a sharding engine (msamp's O3, te's FP8 weights under FSDP2)
    def counts_per_rank(self) -> bool:
        return False

    def per_rank(self, out: dict[str, float]) -> dict[str, float]:
        """`out` as one rank holds it: FSDP shards weights, gradients, masters and optimizer states over the ranks
        (DeepSpeed's partitioning depends on its ZeRO stage, which the plan does not know: not counted)."""
        context = self.owner.context
        if fsdp_shards(context.engine, context.world_size) and not self.counts_per_rank():
            return {kind: value / context.world_size for kind, value in out.items()}
        return out

    def adjust_bytes(self, out: dict[str, float], plan: PrecisionPlan, param_dtype: torch.dtype) -> dict[str, float]:
        """`out` (bytes per parameter) with the converted weights' and gradients' storage in force."""
        size = param_dtype.itemsize
        weight = self.weight_dtype()
        store = self.grad_store_dtype(weight if weight is not None else param_dtype)
        if weight is not None or store is not None:
            share = plan.fp8_param_share  # the converted Linear weights' share of all parameters
            w_size = weight.itemsize if weight is not None else size
            g_size = store.itemsize if store is not None else w_size
            out["weight"] = share * w_size + (1 - share) * out["weight"]
            out["weight_grad"] = share * g_size + (1 - share) * out["weight_grad"]
        return out
