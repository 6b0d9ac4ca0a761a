"""TransformerEngine adapter: nn.Linear / LayerNorm / RMSNorm -> TE modules, run under `te.autocast`."""

from __future__ import annotations

import contextlib
import copy
import logging
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from ...frontend.specs import backend_spec
from ...optim.levels import fused_adam_moments_problem
from ...utils.imports import require
from ...utils.modules import own_class
from ..base import Backend, BackendUnavailableError, RunContext
from ..torchao import _is_mha_projection
from . import first_scales
from .fsdp import FP8_WEIGHT_DTYPE, TECommunication, fp8_weights_problem
from .optimizer import (
    TEOptimizerPrecision,
    after_fused_adam_load,
    check_fused_adam_source,
    complete_fused_adam_state,
    from_adam_form,
    fused_adam_state_dtypes,
)
from .storage import TEWeightStorage

if TYPE_CHECKING:
    from ...planning.activations import SavedInput
    from ...planning.plan import PrecisionPlan, TensorPrecision

log = logging.getLogger(__name__)

# Last dimension (and out_features) multiple a recipe's FP8 GEMMs need. TE's hard floor is 16 for
# in_features and 8 for out_features; 16 both ways keeps the backward GEMMs aligned too. Block
# scaling documents 128 (not enforced by te.Linear, but its scale tiles assume it); MXFP8 checks 32.
_ALIGN = {"delayed": 16, "current": 16, "block": 128, "mxfp8": 32}


def _te_class_module(module: nn.Module) -> bool:
    mod = own_class(module).__module__
    return mod.startswith("transformer_engine") or mod == "lowprec.backends.te.modules"


# results/gpu/2026-11-24-h100-te-widths (H100, d4096 proxy, against BF16 of the same mode).
COMPILED_NOTE = (
    "compiled model: dynamo breaks the graph around every TE module, which then runs eagerly between compiled "
    "pieces (H100, d4096: 1.14x compiled BF16, where TE in an eager model measured 1.39x eager BF16 and "
    "backend='torchao' compiled 1.30x): leave the model uncompiled for TE, or compile it with backend='torchao'"
)


class TEBackend(Backend):
    spec = backend_spec("te")
    storage_part = TEWeightStorage  # fp8_weights: FP8-only weights, FP32 masters in FusedAdam
    optimizer_part = TEOptimizerPrecision  # fp8_weights: optimizer_states are FusedAdam's moments
    communication_part = TECommunication  # fp8_weights under FSDP2: around Accelerate's preparation (fsdp.py)

    def __init__(self, recipe, context):
        super().__init__(recipe, context)
        # Weak: a module id() can be reused once the module is gone.
        self._rms_variants: weakref.WeakKeyDictionary[nn.Module, str | None] = weakref.WeakKeyDictionary()
        self._hp_weights: dict[int, torch.Tensor] = {}
        if self.recipe.fp8_weights:
            problem = fp8_weights_problem(self.recipe_name, context.engine, self.recipe.reduce_amax)
            if problem is not None:
                raise BackendUnavailableError(problem)
            problem = fused_adam_moments_problem(self.recipe_name, self.optimizer_states)
            if problem is not None:
                raise ValueError(problem)
        # TE's own check reads the local GPU: only ask when planning for it and TE is there to ask
        if (self.recipe_name == "block" and not self.emulated and torch.cuda.is_available()
                and context.device.type == "cuda" and self.availability()[0]):
            ok, reason = self._te().is_fp8_block_scaling_available(return_reason=True)
            if not ok:
                raise BackendUnavailableError(
                    f"FP8RecipeKwargs(backend='te', recipe='block') cannot run here: {reason}")

    @classmethod
    def default_recipe_for(cls, context: RunContext) -> str:
        # DelayedScaling is TE's default but does not compile; current scaling does (and is faster
        # compiled: results/gpu/2026-11-22-h100-te)
        return "current" if context.compiled else cls.default_recipe

    @classmethod
    def context_problem(cls, recipe_name: str, context: RunContext) -> str | None:
        if context.compiled and recipe_name == "delayed":
            return ("cannot run under torch.compile: TransformerEngine rejects DelayedScaling inside compiled code. "
                    "Use recipe='current' (per-tensor current scaling, compilable), or turn compilation off.")
        return None

    @staticmethod
    def _te():
        return require("transformer_engine", feature="backend='te'")

    @property
    def gathers_fp8_weights(self) -> bool:
        # fp8_weights under FSDP2: the sharded parameter is TE's Float8Tensor, gathered as FP8 bytes (fsdp.py)
        return bool(self.recipe.fp8_weights) and self.context.engine == "fsdp2"

    # ----- which modules -------------------------------------------------------------------
    def candidate_kind(self, module: nn.Module) -> str | None:
        if isinstance(module, nn.Linear) and not _is_mha_projection(module):
            return "linear"
        if isinstance(module, nn.LayerNorm):
            return "layernorm"
        name = type(module).__name__
        has_weight = isinstance(getattr(module, "weight", None), torch.Tensor)
        if isinstance(module, nn.RMSNorm) or (name.endswith("RMSNorm") and has_weight):
            return "rmsnorm"
        return None

    def is_converted(self, module: nn.Module) -> bool:
        return _te_class_module(module) and own_class(module).__name__ in ("Linear", "LayerNorm", "RMSNorm")

    def converted_kind(self, module: nn.Module) -> str | None:
        return own_class(module).__name__.lower() if self.is_converted(module) else None

    def keeps_saved_tensors(self, module: nn.Module) -> bool:
        # TE's Linear saves its quantized input and weight split into plain tensors (prepare_for_saving): the
        # FP8 data (1 byte, kept anyway) and, under `block`, FP32 scale_inv tensors of tokens x hidden/128,
        # which packing would round. Its norms save a high-precision input: theirs are packed.
        return self.converted_kind(module) == "linear"

    def constraint(self, module: nn.Module) -> str | None:
        kind = self.candidate_kind(module)
        if kind == "linear":
            align = _ALIGN[self.recipe_name]
            bad = [f"{n}={d}" for n, d in (("in_features", module.in_features), ("out_features", module.out_features))
                   if d % align]
            if bad:
                return f"{', '.join(bad)} not divisible by {align} (TE {self.recipe_name!r} FP8 GEMM requirement)"
            return None
        if kind == "layernorm":
            if not module.elementwise_affine:
                return "LayerNorm without affine parameters (te.LayerNorm always has weight and bias)"
            if module.bias is None:
                return "LayerNorm(bias=False) (te.LayerNorm always has a bias)"
            return None
        weight = getattr(module, "weight", None)
        if weight is None or weight.dim() != 1:
            return "RMSNorm without a 1-D weight (te.RMSNorm needs one)"
        if self.rms_variant(module) is None:
            return f"{type(module).__name__} does not compute x * rsqrt(mean(x^2) + eps) * w (or * (1 + w)); kept as is"
        return None

    def rms_variant(self, module: nn.Module) -> str | None:
        """'standard' (x̂·w), 'zero_centered' (x̂·(1+w), Gemma) or None (something else)."""
        if module not in self._rms_variants:
            self._rms_variants[module] = self._probe_rms(module)
        return self._rms_variants[module]

    @staticmethod
    @torch.no_grad()
    def _probe_rms(module: nn.Module) -> str | None:
        if module.weight.is_meta:
            # Planning on the meta device (e.g. FSDP ranks that load weights later): probe a CPU
            # copy with random weights; class names do not tell x*w from x*(1+w) reliably.
            try:
                module = copy.deepcopy(module).to_empty(device="cpu")
                module.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
            except Exception:  # noqa: BLE001 - an unprobeable norm stays in high precision
                return None
        weight = module.weight
        from .modules import rmsnorm_eps

        eps = rmsnorm_eps(module)
        x = torch.randn(4, weight.numel(), generator=torch.Generator().manual_seed(0)).to(weight.device)
        with torch.autocast(weight.device.type, enabled=False):
            y = module(x.to(weight.dtype)).float()
        base = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        w = weight.float()
        tol = dict(rtol=2e-2, atol=1e-3) if weight.dtype != torch.float32 else dict(rtol=1e-4, atol=1e-5)
        if torch.allclose(y, base * w, **tol):
            return "standard"
        if torch.allclose(y, base * (1 + w), **tol):
            return "zero_centered"
        return None

    @property
    def speed_scaling(self) -> str:
        from ...planning.speed import MXFP8, TE_COMPILED, TE_EAGER

        # Measured per-tensor (delayed eager, current compiled). Block scaling adds scale handling to
        # the same GEMMs, so where per-tensor FP8 loses, block scaling loses too (a lower bound on its
        # slow shapes). MXFP8 runs other kernels, on Blackwell only: it keeps thresholds of its own.
        if self.recipe_name == "mxfp8":
            return MXFP8
        return TE_COMPILED if self.context.compiled else TE_EAGER

    # ----- recipe and context ----------------------------------------------------------------
    def te_recipe(self):
        self._te()
        from transformer_engine.common import recipe as R

        fmt = R.Format.HYBRID if self.fp8_format == "HYBRID" else R.Format.E4M3
        opts = self.effective_options()
        if self.recipe_name == "delayed":
            return R.DelayedScaling(margin=opts["margin"], fp8_format=fmt, amax_history_len=opts["amax_history_len"],
                                    amax_compute_algo=opts["amax_compute_algo"], reduce_amax=opts["reduce_amax"])
        if self.recipe_name == "current":
            return R.Float8CurrentScaling(fp8_format=fmt)
        if self.recipe_name == "block":
            return R.Float8BlockScaling(fp8_format=fmt)
        return R.MXFP8BlockScaling(fp8_format=fmt)

    def forward_context(self, model: nn.Module) -> Callable[[], contextlib.AbstractContextManager]:
        te = self._te()
        recipe = self.te_recipe()
        eval_fp8 = self.effective_options()["use_autocast_during_eval"]
        # amax_reduction_group=None is the world group: with reduce_amax (the default) DelayedScaling keeps
        # one scale per tensor across data-parallel replicas (the only parallelism lowprec runs); other
        # recipes ignore it.
        return lambda: te.autocast(enabled=model.training or eval_fp8, recipe=recipe)

    # ----- layer replacement -------------------------------------------------------------------
    def convert(self, model: nn.Module, plan: PrecisionPlan) -> nn.Module:
        from ..convert import swap_planned_modules
        from .modules import from_float

        te = self._te()
        device = None
        quantized_init = None
        # Under FSDP2 FP8-only weights are nominally FP32: the dtype Accelerate gives every other trainable
        # parameter there, which it would otherwise give them by dequantising (fsdp.py)
        linear_dtype = FP8_WEIGHT_DTYPE if self.gathers_fp8_weights else None
        if self.recipe.fp8_weights:
            # FP8-only weights are quantised on the GPU at construction.
            device = self.fp8_weight_device()
            recipe = self.te_recipe()

            def quantized_init():
                return te.quantized_model_init(enabled=True, recipe=recipe)

        def build(module: nn.Module, decision) -> nn.Module:
            zero_centered = decision.kind == "rmsnorm" and self.rms_variant(module) == "zero_centered"
            init = quantized_init if decision.kind == "linear" else None
            new = from_float(module, decision.kind, zero_centered=zero_centered, device=device, quantized_init=init,
                             dtype=linear_dtype if init is not None else None)
            if init is not None:
                self._hp_weights[id(new.weight)] = module.weight.detach().to(new.weight.device, torch.float32).clone()
            return new

        return swap_planned_modules(model, plan, build)

    @staticmethod
    def fp8_weight_device() -> torch.device:
        """Where FP8-only weights are built: TE quantises them on the current GPU."""
        return torch.device("cuda", torch.cuda.current_device())

    def take_hp_weight(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The FP32 copy of an FP8-only `weight` from before its quantisation (once), or None."""
        return self._hp_weights.pop(id(weight), None)

    # ----- optimizer-state precision ------------------------------------------------------------
    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, plan: PrecisionPlan) -> torch.optim.Optimizer:
        if not self.recipe.fp8_weights:
            return super().wrap_optimizer(optimizer, plan)
        check_fused_adam_source(optimizer)
        defaults = optimizer.defaults
        fused_adam = self._te().optimizers.FusedAdam
        decoupled = isinstance(optimizer, torch.optim.AdamW) or defaults.get("decoupled_weight_decay", False)
        # Keep the hyper-parameters and keys others added (a scheduler's initial_lr); drop torch's
        # implementation switches (foreach, fused, capturable, ...), which FusedAdam has its own of.
        torch_switches = set(defaults) - {"lr", "betas", "eps", "weight_decay"}
        groups = [{k: v for k, v in group.items() if k not in torch_switches} for group in optimizer.param_groups]
        new = fused_adam(
            groups,
            lr=defaults["lr"], betas=defaults["betas"], eps=defaults["eps"], weight_decay=defaults["weight_decay"],
            adam_w_mode=bool(decoupled), master_weights=True, master_weight_dtype=torch.float32,
            **fused_adam_state_dtypes(self.optimizer_states),
        )
        new.register_load_state_dict_pre_hook(from_adam_form)  # a checkpoint saved without fp8_weights loads
        seeded = 0
        if self.gathers_fp8_weights:
            # Under FSDP2 the masters are seeded from the shards once Accelerate has sharded the weights
            # (fsdp.TECommunication.install): state seeded now would belong to the unsharded parameters.
            log.info("lowprec: %s -> TE FusedAdam(master_weights=True); FP32 masters seeded after FSDP2 sharding",
                     type(optimizer).__name__)
            return new
        for group in new.param_groups:
            for p in group["params"]:
                hp = self._hp_weights.pop(id(p), None)
                if hp is not None:
                    new.initialize_state(p, store_param_remainders=False)
                    new.set_scaled_state(p, "master_param", hp)  # exact FP32 master, not the FP8 round trip
                    seeded += 1
        if self._hp_weights:
            warnings.warn(
                "lowprec: some FP8-only weights were not in the optimizer passed to prepare(); their FP32 master "
                "copies will start from the FP8 values", stacklevel=3,
            )
            self._hp_weights.clear()
        log.info("lowprec: %s -> TE FusedAdam(master_weights=True), %d FP32 masters seeded", type(optimizer).__name__,
                 seeded)
        return new

    def complete_optimizer_state(self, optimizer: torch.optim.Optimizer, loading: bool = False) -> None:
        if self.recipe.fp8_weights and isinstance(optimizer, self._te().optimizers.FusedAdam):
            complete_fused_adam_state(optimizer, loading)

    def plain_checkpoint_entries(self, state_dict: dict, prefix: str) -> None:
        if self.recipe.fp8_weights:
            from .modules import dequantize_entries

            dequantize_entries(state_dict, prefix)

    def after_load_state(self, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer] = ()) -> None:
        if self.recipe.fp8_weights:
            for optimizer in optimizers:
                if isinstance(optimizer, self._te().optimizers.FusedAdam):
                    after_fused_adam_load(optimizer)

    @classmethod
    def strip_state_dict(cls, state_dict: dict) -> dict:
        from .modules import portable_state_dict

        return portable_state_dict(state_dict)

    # ----- plan ---------------------------------------------------------------------------------
    def saved_linear_input(self) -> SavedInput:
        from ...planning.activations import SavedInput

        # TE saves its quantized input (the column-wise FP8 copy the weight gradient's GEMM reads)
        return {
            "delayed": SavedInput("FP8 E4M3, per-tensor scale (TE's cast)", 1.0),
            "current": SavedInput("FP8 E4M3, per-tensor scale (TE's cast)", 1.0),
            "block": SavedInput("FP8 E4M3, an FP32 scale per 128 values (TE's cast)", 1 + 4 / 128),
            "mxfp8": SavedInput("FP8 E4M3, an E8M0 scale per 32 values (TE's cast)", 1 + 1 / 32),
        }[self.recipe_name]

    def gemm_precision(self, plan: PrecisionPlan) -> TensorPrecision:
        from ...planning.plan import TensorPrecision

        opts = self.effective_options()
        gemm = {"HYBRID": "FP8 E4M3/E5M2", "E4M3": "FP8 E4M3"}[self.fp8_format]
        scaling = {
            "delayed": f"delayed per-tensor: scale from the {opts.get('amax_compute_algo')} amax of the last "
                       f"{opts.get('amax_history_len')} steps, margin {opts.get('margin')}, "
                       + ("amax reduced across ranks" if opts.get("reduce_amax")
                          else "each rank's own amax (reduce_amax=False)"),
            "current": "per-tensor from the amax of the current tensor",
            "block": "1x128 blocks (activations, gradients), 128x128 blocks (weights), power-of-2 scales",
            "mxfp8": "1x32 blocks with E8M0 (power-of-2) scales",
        }[self.recipe_name]
        return TensorPrecision("gemm", gemm, scaling)

    def slow_replacement(self, module: nn.Module, kind: str) -> str | None:
        # TE's norms run in high precision like the model's own; their gain is a fused eager kernel. Compiled,
        # each is a graph break (dynamo skips TE's norm kernels: rmsnorm_fwd in the graph_break counts of
        # results/gpu/2026-11-24-h100-te-widths), where inductor would fuse the model's own norm.
        if self.context.compiled:
            return ("compiled model: TE's norm would be a graph break, and it runs in high precision either way "
                    "(torch.compile fuses the model's own)")
        return None

    def _kept_only_because_compiled(self, plan: PrecisionPlan) -> bool:
        """Whether the compiled-model rule kept a Linear that an eager model would run in FP8."""
        from ...planning.speed import TE_EAGER, slow_reason

        return any(m.rule == "skip_slow_shapes" and m.kind == "linear"
                   and slow_reason(self.context.device, TE_EAGER, *m.shape) is None for m in plan.modules)

    def notes(self, plan: PrecisionPlan) -> list[str]:
        notes = ["TE FP8 GEMMs need batch x sequence divisible by 8 at run time (pad sequences)"]
        if not self.effective_options()["use_autocast_during_eval"]:
            notes.append("eval runs in high precision (use_autocast_during_eval=False)")
        if self.recipe_name == "delayed":
            first = ("the first step cast with scales from its own tensors (TE starts them at 1)"
                     if first_scales.enabled()
                     else f"the first step cast with TE's initial scales of 1 ({first_scales.ENV}=0)")
            notes.append(f"DelayedScaling: {first}; checkpoints keep scales and amax histories without pickle; "
                         "not compilable")
        if self.recipe.fp8_weights:
            moments = self.optimizer_state_precision(plan.param_dtype).dtype
            notes.append(f"fp8_weights: Adam/AdamW is replaced by TE FusedAdam(master_weights=True), moments {moments}")
        if self.gathers_fp8_weights:
            n = self.context.world_size
            m = self.optimizer_precision.state_bytes(torch.float32)
            notes.append(f"fp8_weights under FSDP2: model state {plan.model_state_bytes_per_param:.3g} bytes/param per "
                         f"rank over {n} ranks (FP8 Linears: (1 + 4 + 4 + {m:g})/N: FP8 weight, FP32 gradient, FP32 "
                         f"master and {moments} Adam moments, all sharded); TE's Float8Tensor shards are all-gathered "
                         "as FP8 bytes, the rest as FSDP2's mixed-precision policy says")
        if self.context.compiled and (plan.converted or self._kept_only_because_compiled(plan)):
            notes.append(COMPILED_NOTE)
        return notes
