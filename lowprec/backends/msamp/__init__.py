"""MS-AMP levels O1, O2 and O3, implemented natively on current PyTorch (no `msamp` package).

The three jobs of the adapter:
1. layer replacement: `nn.Linear` -> `FP8Linear` (FP16 weights, FP8 GEMMs, FP8 weight gradients);
2. optimizer-state precision: Adam/AdamW -> `lowprec.optim.LowBitAdam(W)` with the level's state
   dtypes (O1: FP32/FP32, O2 and O3: E4M3/FP16), reading the FP8 weight gradients;
3. communication precision: under DDP the FP8 weight gradients are averaged in FP8 with a shared
   scale (`FP8GradReducer`); other gradients go through DDP as usual.

O3 runs under FSDP2 only: the FP16 weights are masters that FSDP2 shards and all-gathers in E4M3
(`fsdp.FP8MasterWeight`), gradients are reduce-scattered in FP8 and kept sharded in `.grad`, and the
O2 states are sharded with them. Every converted layer is a FSDP2 group of its own
(`fully_shard_fp8_layers`): FSDP2 needs one parameter dtype per group, and the rest of the model
keeps its own.
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
# Where each level runs: O1/O2 keep whole FP8 gradients on every rank, O3 needs an engine that shards.
LEVEL_ENGINES: dict[str, tuple[str, ...]] = {"O1": ("single", "ddp"), "O2": ("single", "ddp"), "O3": ("fsdp2",)}


def _engine_problem(level: str, engine: str) -> str | None:
    if engine in LEVEL_ENGINES[level]:
        return None
    if level == "O3":
        if engine == "deepspeed":
            where = ("DeepSpeed ZeRO does not host it in this version of lowprec (its ZeRO optimizer keeps its own "
                     "BF16/FP32 copies of every weight); use FSDP2 (fsdp_version: 2)")
        elif engine == "fsdp1":
            where = "FSDP1 has no all-gather extension to send FP8 weights; use FSDP2 (fsdp_version: 2)"
        else:
            where = ("with nothing to shard across, use opt_level='O2' (FP16 weights, FP8 gradients, FP8+FP16 states: "
                     "6 bytes per parameter), or run under FSDP2")
        return (f"FP8RecipeKwargs(backend='msamp', opt_level='O3') shards FP16 master weights and the O2 optimizer "
                f"states across ranks and all-gathers the weights in FP8: it runs under FSDP2; under {engine!r} "
                f"{where}")
    return (f"backend 'msamp' at level {level} (FP8 weight gradients kept whole on its layers) runs on one process or "
            f"under DDP; engine {engine!r} is not supported at this level. Use opt_level='O3' under FSDP2 (sharded "
            "FP16 masters, FP8 all-gather and reduce-scatter), or backend='te' / 'torchao' with FSDP2 / DeepSpeed")


class MSAMPBackend(Backend):
    spec = backend_spec("msamp")
    native_storage = True
    ENGINES: ClassVar[tuple[str, ...]] = ("single", "ddp", "fsdp2")

    def __init__(self, recipe, context):
        self.level: str = recipe.opt_level or DEFAULT_LEVEL
        problem = _engine_problem(self.level, context.engine)
        if problem is not None:
            raise BackendUnavailableError(problem)
        super().__init__(recipe, context)
        self.weight_dtype = WEIGHT_DTYPES[self.storage["weight_dtype"] or "fp16"]
        self.layers: list[FP8Linear] = []
        self._original_dtypes: dict[str, torch.dtype] = {}

    # ----- selection ----------------------------------------------------------------------------
    @property
    def opt_level(self) -> str:
        return self.level

    @property
    def sharded(self) -> bool:
        """Level O3: FP16 master shards, FP8 all-gather (under FSDP2)."""
        return self.level == "O3"

    @property
    def grad_comm_choice(self) -> str | None:
        # O3's row: gradients reduce-scattered in FP8 unless the recipe names another dtype
        return self.recipe.grad_comm_dtype or ("fp8" if self.sharded else None)

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
                       margin=opts["margin"], emulate=self.emulated, fp8_eval=opts["use_autocast_during_eval"],
                       sharded_master=self.sharded)
        for decision in plan.converted:
            fqn = "" if decision.fqn == "<root>" else decision.fqn
            module = model.get_submodule(fqn)
            prefix = fqn + "." if fqn else ""
            self._original_dtypes[prefix + "weight"] = module.weight.dtype
            if self.sharded and module.bias is not None:  # O3 stores the bias in the weight's dtype too
                self._original_dtypes[prefix + "bias"] = module.bias.dtype
        root = swap_planned_modules(model, plan, lambda module, _: FP8Linear.from_float(module, **options))
        self.layers = list({id(m): m for m in root.modules() if isinstance(m, FP8Linear)}.values())
        if self.sharded:
            return root  # gradients go through FSDP2's .grad; no stores, nothing for DDP
        # The layers hold their FP8 weight gradients as gradient stores do: the base adapter's
        # optimizer swap, clipping, zero_grad and DDP reduction (FP8GradReducer) serve both.
        self.grad_stores = self.layers
        # DDP neither reduces their weights nor broadcasts their FP8 state (scales, amax histories)
        ignore_in_ddp(root, self.layers, buffer_prefix="")
        clear_in_zero_grad(root, self.layers)
        return root

    # ----- engine ----------------------------------------------------------------------------------
    def before_engine_prepare(self, objects: list, accelerator=None) -> None:
        """O3 under Accelerate's FSDP2 plugin: shard each converted layer as a FSDP2 group of its own,
        with the plugin's settings, before Accelerate shards the rest around them (FSDP2 needs one
        parameter dtype per group), and point the optimizer at the sharded parameters.

        While Accelerate prepares, the layers' parameters are frozen: under mixed precision it upcasts
        every trainable parameter that is not FP32, which would make FP32 masters of the FP16 ones.
        `setup_communication` thaws them once Accelerate is done."""
        if not self.sharded or accelerator is None:
            return
        from torch.distributed.fsdp import MixedPrecisionPolicy

        from .fsdp import fully_shard_fp8_layers

        plugin = accelerator.state.fsdp_plugin
        if plugin.cpu_ram_efficient_loading:
            raise ValueError(
                "FP8RecipeKwargs(backend='msamp', opt_level='O3') cannot be used with the FSDP plugin's "
                "cpu_ram_efficient_loading=True in this version of lowprec (that path rebuilds the model on the meta "
                "device and reloads a full state dict around lowprec's FP8 layers); set "
                "fsdp_cpu_ram_efficient_loading: false"
            )
        mesh = getattr(accelerator, "torch_device_mesh", None)
        if mesh is not None:
            mesh = mesh[tuple(accelerator.parallelism_config.fsdp_dim_names)]
        kwargs = dict(mesh=mesh, reshard_after_forward=plugin.reshard_after_forward, offload_policy=plugin.cpu_offload,
                      mp_policy=plugin.mixed_precision_policy or MixedPrecisionPolicy())
        before = {id(p): (layer, name) for layer in self.layers for name, p in layer.named_parameters(recurse=False)}
        for model in (o for o in objects if isinstance(o, nn.Module)):
            fully_shard_fp8_layers(model, **kwargs)
        for opt in (o for o in objects if isinstance(o, torch.optim.Optimizer)):
            for group in opt.param_groups:
                group["params"] = [getattr(*before[id(p)]) if id(p) in before else p for p in group["params"]]
        self._frozen = [p for layer in self.layers for p in layer.parameters(recurse=False) if p.requires_grad]
        for p in self._frozen:
            p.requires_grad_(False)

    def setup_communication(self, model: nn.Module, plan: PrecisionPlan) -> None:
        super().setup_communication(model, plan)
        for p in getattr(self, "_frozen", ()):
            p.requires_grad_(True)
        self._frozen = []

    # ----- step hooks -------------------------------------------------------------------------------
    def post_optimizer_step(self, model: nn.Module) -> Callable[[], None] | None:
        def after_step():
            update_delayed_scales(self.layers)
            if self.sharded:  # O3: the next gathers' weight scales, in one all-reduce
                from .fsdp import precompute_weight_scales

                precompute_weight_scales([layer.weight for layer in self.layers])
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
        return None if self.sharded else "in FP8 on its layers (FP8Linear)"

    def portable_state_dict(self, state_dict: dict) -> dict:
        dtypes = self._original_dtypes  # state-dict key -> the dtype the unconverted model had
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
        if self.sharded:
            n = self.context.world_size
            return [
                TensorPrecision("gemm", gemm, scaling.replace("weights from their current amax",
                                                               "weights as all-gathered")),
                comm,
                TensorPrecision("weight", f"FP8 E4M3 (Linear), {hp} (rest)",
                                "all-gathered per use from the FP16 masters, one power-of-2 scale per tensor from "
                                "its amax over all ranks; freed when FSDP2 reshards"),
                TensorPrecision("master_weight", f"{wdt} (Linear), sharded over {n} ranks by FSDP2",
                                "the FSDP2 parameter itself; LowBitAdamW updates it"),
                TensorPrecision("weight_grad", f"{wdt} shards (Linear), {hp} (rest)",
                                "from autograd to FSDP2's reduce-scatter (see grad comm), kept sharded in .grad"),
                self.optimizer_state_precision(hp),
            ]
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
        if self.sharded:
            # per rank: FSDP2 shards everything; the FP8 weight exists only while a layer runs
            n, master = self.context.world_size, self.weight_dtype.itemsize
            return {
                "weight": (1 - share) * size / n,
                "weight_grad": (share * master + (1 - share) * size) / n,
                "master_weight": share * master / n,
                "optimizer_states": float(state_bytes(self.optimizer_states)) / n,
            }
        return {
            "weight": share * self.weight_dtype.itemsize + (1 - share) * size,
            "weight_grad": share * 1 + (1 - share) * size,
            "master_weight": 0.0,
            "optimizer_states": float(state_bytes(self.optimizer_states)),
        }

    def notes(self, plan: PrecisionPlan) -> list[str]:
        notes = [f"level {self.level}: Adam/AdamW passed to prepare() becomes lowprec.optim.LowBitAdam(W) with "
                 f"{'sharded ' if self.sharded else ''}FP8+FP16 states; other optimizers are refused"]
        if self.sharded:
            notes.append(f"O3 under FSDP2: model state {plan.model_state_bytes_per_param:.3g} bytes/param per rank "
                         "(MS-AMP's ZeRO-2 O3: 1 + 6/N, whose FP8 weight copy stays on every rank); each converted "
                         "Linear is a FSDP2 group of its own (its FP16 parameters cannot share one with FP32 norms)")
        else:
            notes.append("FP8 weight gradients are not in .grad: clip with accelerator.clip_grad_norm_ (it includes "
                         "them)")
        if self.context.engine == "ddp":
            notes.append("DDP: FP8 weight gradients are averaged once per optimizer step, after the last backward")
        if not self.emulated:
            notes.append("compile the model (dynamo_backend='inductor') to fuse the casts into neighbouring kernels")
        return notes
