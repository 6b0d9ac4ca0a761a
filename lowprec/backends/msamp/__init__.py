"""MS-AMP levels O1 and O2, implemented natively on current PyTorch (no `msamp` package).

The three jobs of the adapter:
1. layer replacement: `nn.Linear` -> `FP8Linear` (FP16 weights, FP8 GEMMs, FP8 weight gradients);
2. optimizer-state precision: Adam/AdamW -> `lowprec.optim.LowBitAdam(W)` with the level's state
   dtypes (O1: FP32/FP32, O2: E4M3/FP16), reading the FP8 weight gradients;
3. communication precision: under DDP the FP8 weight gradients are averaged in FP8 with a shared
   scale (`FP8GradReducer`); other gradients go through DDP as usual.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from ...optim.grad_store import clear_in_zero_grad, ignore_in_ddp
from ...optim.levels import LEVEL_STATE_DTYPES, state_bytes
from ...specs import backend_spec
from ..base import Backend, BackendUnavailableError
from ..torchao import _is_mha_projection
from .linear import META_PREFIX, WEIGHT_DTYPES, FP8Linear, update_delayed_scales

if TYPE_CHECKING:
    from ...plan import PrecisionPlan, TensorPrecision

__all__ = ["LEVEL_STATE_DTYPES", "FP8Linear", "MSAMPBackend"]

log = logging.getLogger(__name__)

DEFAULT_LEVEL = "O2"
DEFAULT_WINDOW = 16  # MS-AMP's DEFAULT_WINDOW_SIZE for input and output-gradient scales


class MSAMPBackend(Backend):
    spec = backend_spec("msamp")
    native_storage = True
    ENGINES: ClassVar[tuple[str, ...]] = ("single", "ddp")

    def __init__(self, recipe, context):
        super().__init__(recipe, context)
        if context.engine not in self.ENGINES:
            raise BackendUnavailableError(
                f"backend 'msamp' (FP8 weight gradients on its layers, level O1 or O2, O2 by default) runs on one "
                f"process or under DDP; engine {context.engine!r} is not supported in this version of lowprec. Use "
                "backend='te' or backend='torchao' with FSDP2 / DeepSpeed"
            )
        self.level: str = recipe.opt_level or DEFAULT_LEVEL
        self.weight_dtype = WEIGHT_DTYPES[self.storage["weight_dtype"] or "fp16"]
        self.layers: list[FP8Linear] = []
        self._original_dtypes: dict[str, torch.dtype] = {}

    # ----- selection ----------------------------------------------------------------------------
    @property
    def opt_level(self) -> str:
        return self.level

    def candidate_kind(self, module: nn.Module) -> str | None:
        if isinstance(module, nn.Linear) and not _is_mha_projection(module):
            return "linear"
        return None

    def is_converted(self, module: nn.Module) -> bool:
        return isinstance(module, FP8Linear)

    def constraint(self, module: nn.Module) -> str | None:
        bad = [f"{name}={dim}" for name, dim in (("in_features", module.in_features),
                                                   ("out_features", module.out_features)) if dim % 16]
        return f"{', '.join(bad)} not divisible by 16 (FP8 GEMM requirement)" if bad else None

    @property
    def speed_scaling(self) -> str:
        from ...speed import PER_TENSOR

        # Per-tensor scaled FP8 GEMMs, as torchao's tensorwise recipe measures them.
        return PER_TENSOR

    def effective_options(self) -> dict[str, object]:
        out = super().effective_options()
        r = self.recipe
        out["amax_history_len"] = r.amax_history_len if r.amax_history_len is not None else DEFAULT_WINDOW
        out["weight_dtype"] = self.storage["weight_dtype"] or "fp16"
        return out

    # ----- layer replacement ----------------------------------------------------------------------
    def convert(self, model: nn.Module, plan: PrecisionPlan) -> nn.Module:
        from ...convert import swap_planned_modules

        opts = self.effective_options()
        options = dict(weight_dtype=self.weight_dtype, fp8_format=self.fp8_format,
                       amax_history_len=opts["amax_history_len"], amax_compute_algo=opts["amax_compute_algo"],
                       margin=opts["margin"], emulate=self.emulated, fp8_eval=opts["use_autocast_during_eval"])
        for decision in plan.converted:
            module = model.get_submodule("" if decision.fqn == "<root>" else decision.fqn)
            self._original_dtypes[decision.fqn] = module.weight.dtype
        root = swap_planned_modules(model, plan, lambda module, _: FP8Linear.from_float(module, **options))
        self.layers = list({id(m): m for m in root.modules() if isinstance(m, FP8Linear)}.values())
        # The layers hold their FP8 weight gradients as gradient stores do: the base adapter's
        # optimizer swap, clipping, zero_grad and DDP reduction (FP8GradReducer) serve both.
        self.grad_stores = self.layers
        # DDP neither reduces their weights nor broadcasts their FP8 state (scales, amax histories)
        ignore_in_ddp(root, self.layers, buffer_prefix="")
        clear_in_zero_grad(root, self.layers)
        return root

    # ----- step hooks -------------------------------------------------------------------------------
    def post_optimizer_step(self, model: nn.Module) -> Callable[[], None] | None:
        def after_step():
            update_delayed_scales(self.layers)
            if self.store_reducer is not None:
                self.store_reducer.mark_pending()

        return after_step

    # ----- checkpoints --------------------------------------------------------------------------------
    def scales_in_use(self, module: nn.Module) -> dict[str, float] | None:
        if not isinstance(module, FP8Linear) or module.in_time():
            return None  # warming up: every scale comes from the tensor at hand
        scale_x, scale_g, _ = (float(s) for s in module.scales)
        return {"input": scale_x, "output_grad": scale_g}  # the weight's scale is current

    def gradients_outside_grad(self) -> str | None:
        return "in FP8 on its layers (FP8Linear)"

    def portable_state_dict(self, state_dict: dict) -> dict:
        dtypes = {("" if fqn == "<root>" else fqn + ".") + "weight": dtype
                  for fqn, dtype in self._original_dtypes.items()}
        state_dict = {k: v.to(dtypes[k]) if k in dtypes and isinstance(v, torch.Tensor) else v
                      for k, v in state_dict.items()}
        return self.strip_state_dict(state_dict)

    @classmethod
    def strip_state_dict(cls, state_dict: dict) -> dict:
        """Without FP8Linear's scaling metadata (amax histories, scales, the FP8 gradient buffers)."""
        return {k: v for k, v in state_dict.items() if not k.rsplit(".", 1)[-1].startswith(META_PREFIX)}

    # ----- plan ---------------------------------------------------------------------------------------
    def tensor_precisions(self, plan: PrecisionPlan) -> list[TensorPrecision]:
        from ...plan import TensorPrecision

        hp = plan.param_dtype
        opts = self.effective_options()
        wdt = {torch.float32: "FP32", torch.float16: "FP16", torch.bfloat16: "BF16"}[self.weight_dtype]
        gemm = {"HYBRID": "FP8 E4M3/E5M2", "E4M3": "FP8 E4M3"}[self.fp8_format]
        scaling = (f"power-of-2 per-tensor: inputs and output grads from the {opts['amax_compute_algo']} amax of "
                   f"the last {opts['amax_history_len']} steps (current amax while warming up), weights from "
                   "their current amax")
        comm, _, _ = self.engine_rows(hp)
        if not plan.converted:
            # nothing becomes an FP8Linear: weights, their gradients and their reduction stay as they are
            return [TensorPrecision("gemm", hp), comm, TensorPrecision("weight", hp),
                    TensorPrecision("master_weight", "N/A"), TensorPrecision("weight_grad", hp),
                    self.optimizer_state_precision(hp)]
        if self.context.engine == "ddp":
            comm = TensorPrecision("grad_comm", f"FP8 E4M3, shared scale (Linear), {comm.dtype} (rest)",
                                   "weight grads: amax all-reduced (MAX), FP8 all_to_all, FP32 sum, FP8 all_gather")
        return [
            TensorPrecision("gemm", gemm, scaling),
            comm,
            TensorPrecision("weight", f"{wdt} (Linear), {hp} (rest)"),
            TensorPrecision("master_weight", "N/A"),
            TensorPrecision("weight_grad", f"FP8 E4M3 (Linear), {hp} (rest)",
                            "current per-tensor power-of-2 scale; micro-batches dequantise + add + requantise"),
            self.optimizer_state_precision(hp),
        ]

    def model_state_bytes(self, plan: PrecisionPlan, param_dtype: torch.dtype) -> dict[str, float]:
        share = plan.fp8_param_share
        size = param_dtype.itemsize
        return {
            "weight": share * self.weight_dtype.itemsize + (1 - share) * size,
            "weight_grad": share * 1 + (1 - share) * size,
            "master_weight": 0.0,
            "optimizer_states": float(state_bytes(self.optimizer_states)),
        }

    def notes(self, plan: PrecisionPlan) -> list[str]:
        notes = [
            f"level {self.level}: Adam/AdamW passed to prepare() becomes lowprec.optim.LowBitAdam(W); other "
            "optimizers are refused (they cannot read FP8 weight gradients)",
            "FP8 weight gradients are not in .grad: clip with accelerator.clip_grad_norm_ (it includes them)",
        ]
        if self.context.engine == "ddp":
            notes.append("DDP: FP8 weight gradients are averaged once per optimizer step, after the last backward")
        if not self.emulated:
            notes.append("compile the model (dynamo_backend='inductor') to fuse the casts into neighbouring kernels")
        return notes
