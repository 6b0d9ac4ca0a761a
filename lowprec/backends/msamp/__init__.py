"""MS-AMP levels O1, O2 and O3, implemented natively on current PyTorch (no `msamp` package).

The three jobs of the adapter, and the parts it brings for them (`storage_part`, `optimizer_part`,
`communication_part`):
1. layer replacement, the adapter's own: `nn.Linear` -> `FP8Linear` (FP16 weights, FP8 GEMMs, FP8
   weight gradients), and the GEMM row; the layers realise the level's weight and weight-gradient
   columns themselves, so `storage.MSAMPStorage` builds nothing and holds them as its stores;
2. optimizer-state precision: Adam/AdamW -> `lowprec.optim.LowBitAdam(W)` with the level's state
   dtypes (O1: FP32/FP32, O2 and O3: E4M3/FP16), reading the FP8 weight gradients: the shared part's,
   counted per rank at O3 (`optimizer.MSAMPOptimizerPrecision`);
3. communication precision: under DDP the FP8 weight gradients are averaged in FP8 with a shared
   scale (`FP8GradReducer`); other gradients go through DDP as usual. With `reduce_amax` (the default)
   the delayed scales' amaxes are all-reduced across ranks after each step
   (`communication.all_reduce_amaxes`; DDP, FSDP2 and DeepSpeed alike). O3 runs under FSDP2 (FP16
   masters sharded and all-gathered in E4M3, FP8 reduce-scatters across hosts) and DeepSpeed ZeRO-1/2 (converted
   weights kept out of DeepSpeed's optimizer): `communication.MSAMPCommunication`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from ...frontend.specs import backend_spec
from ...optim.levels import LEVEL_STATE_DTYPES
from ..base import Backend, BackendUnavailableError
from ..torchao import _is_mha_projection
from .communication import MSAMPCommunication, engine_problem
from .linear import META_PREFIX, WEIGHT_DTYPES, FP8Linear
from .optimizer import MSAMPOptimizerPrecision
from .storage import MSAMPStorage

if TYPE_CHECKING:
    from ...planning.plan import PrecisionPlan, TensorPrecision

__all__ = ["LEVEL_STATE_DTYPES", "FP8Linear", "MSAMPBackend"]

log = logging.getLogger(__name__)

DEFAULT_LEVEL = "O2"
DEFAULT_WINDOW = 16  # MS-AMP's DEFAULT_WINDOW_SIZE for input and output-gradient scales
# Eager FP8 layers against eager BF16 of the same engine, d4096 proxy, one H100 with each engine's own code
# path as a world of one: results/gpu/2026-11-25-h100-engines-world1 (call4); one process:
# 2026-11-23-h100-speed-head; compiled whole: 2026-11-23-h100-speed-head/widths_defaults.json.
EAGER_LAYERS_NOTE = (
    "eager FP8 layers (compile_fp8_layers=False): their casts, amaxes and scale updates run as separate kernels "
    "(d4096, one H100: 0.81-0.90x eager BF16 on one process, 0.99x under DDP, 0.84x at O3 under ZeRO-2); the "
    "default compiles them one by one there (1.15x, 1.31x, 1.32x), or compile the model (dynamo_backend='inductor': "
    "1.35x compiled BF16 on one process)"
)
# O3 under FSDP2, d4096 proxy, two H200s, steps 18-37 (past the 16-step warm-up): eager layers 1.17x BF16 FSDP2 at
# 0.73x its peak, compiled 0.99x at 0.79x (results/gpu/2026-11-27-h200x2-steady-e8bb2bd). The compiled step is
# bound by the host there (each gathered weight's graph call costs more than the eager kernels it fuses).
O3_FSDP2_EAGER_NOTE = (
    "O3 under FSDP2: the FP8 layers run eager by default, measured faster than compiled ones past the warm-up "
    "(d4096, two H200s: 1.17x BF16 FSDP2 at 0.73x its peak, against 0.99x at 0.79x), and stay eager (a graph break "
    "each) under a torch.compile of the model; compile_fp8_layers=True compiles them"
)
# Under FSDP2 each O3 layer group is an FSDP2 module: dynamo breaks a compiled block's graph around it anyway, and
# on torch 2.11 it failed tracing the layer (results/gpu/2026-11-28-h200-world1-6365b0b); eager_layers.py says more.
O3_FSDP2_COMPILED_NOTE = (
    "O3 under FSDP2 in a compiled model: the FP8 layers run eager (a graph break each, as FSDP2's hooks around each "
    "layer group make anyway), the rest of each block compiled; eager O3 layers measured faster than compiled ones "
    "under FSDP2"
)

# O3 under FSDP2 on two H200s of one host, d4096 proxy, steps 18-37, the same machine: gradients reduce-scattered in
# BF16 1.26x BF16 FSDP2, in FP8 1.16x, the same peak (results/gpu/2026-11-27-h200x2-gradcomm-f48b76f). On NVLink the
# FP8 reduce-scatter's passes (amax, cast, all_to_all, FP32 sum) cost more than the bytes it saves.
O3_FSDP2_COMM_NOTE = (
    "O3 under FSDP2 on one host: gradients are reduce-scattered in {dtype} (the FSDP plugin's reduce dtype), not in "
    "MS-AMP's FP8, which measured slower on one host (d4096, two H200s: BF16 1.26x BF16 FSDP2, FP8 1.16x, the same "
    "peak); across hosts (LOCAL_WORLD_SIZE < WORLD_SIZE) they go in FP8, half BF16's bytes on the slower link; "
    "grad_comm_dtype='fp8' asks for FP8 here too"
)


class MSAMPBackend(Backend):
    spec = backend_spec("msamp")
    storage_part = MSAMPStorage
    optimizer_part = MSAMPOptimizerPrecision
    communication_part = MSAMPCommunication
    ENGINES: ClassVar[tuple[str, ...]] = ("single", "ddp", "fsdp2")
    # One graph with symbolic shapes from the start: torch 2.11 fails (AssertionError in dynamo's
    # autograd.Function tracing) when a second layer shape re-traces FP8Linear's Function with dynamic
    # shapes, which compile_fp8_layers' default does; static-only or dynamic-from-the-start both trace
    # (benchmarks/diag_msamp_compile.py on an H100, results/gpu/2026-11-23-h100-speed-head).
    LAYER_COMPILE_DYNAMIC = True
    LAYER_COMPILE_VARIANTS_PER_SHAPE = 4  # x 2: warm-up (scales from the tensor at hand) and after it
    # LAYER_COMPILE_ENGINES: Backend's, every engine: compiled layers measured faster than eager ones under each
    # (EAGER_LAYERS_NOTE; two CPU processes check they train alike under DDP, FSDP2 and ZeRO-2), but at O3 under
    # FSDP2, where eager ones measured faster past the warm-up (layer_compile, O3_FSDP2_EAGER_NOTE)

    def __init__(self, recipe, context):
        self.level: str = recipe.opt_level or DEFAULT_LEVEL
        problem = engine_problem(self.level, context.engine)
        if problem is not None:
            raise BackendUnavailableError(problem)
        super().__init__(recipe, context)
        self.weight_dtype = WEIGHT_DTYPES[self.storage["weight_dtype"] or "fp16"]
        self.layers: list[FP8Linear] = []
        self.layer_names: list[str] = []

    # ----- selection ----------------------------------------------------------------------------
    @property
    def opt_level(self) -> str:
        return self.level

    @property
    def sharded(self) -> bool:
        """Level O3 under FSDP2: FP16 master shards, FP8 all-gather."""
        return self.level == "O3" and self.context.engine != "deepspeed"

    @property
    def reduce_amax(self) -> bool:
        """The recipe's `reduce_amax` in force (unset: on)."""
        return bool(self.effective_options()["reduce_amax"])

    @property
    def amax_reduction(self) -> bool:
        """Whether each step's input and output-gradient amaxes are all-reduced (MAX) across the ranks before
        the delayed scales are updated: `reduce_amax` under a data-parallel engine. Not for a model prepared
        for one process, even where a process group exists (a reference run on one rank, say): the other
        ranks would never join the collective."""
        return self.reduce_amax and self.context.engine != "single"

    @property
    def zero_o3(self) -> bool:
        """Level O3 under DeepSpeed ZeRO-1/2: FP8 weights and owner-held masters beside DeepSpeed."""
        return self.level == "O3" and self.context.engine == "deepspeed"

    @property
    def zero(self):
        """`zero.ZeroFP8Weights` under DeepSpeed O3 once `before_engine_prepare` ran, else None."""
        return self.communication.zero

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
        from ...planning.speed import PER_TENSOR

        # Per-tensor scaled FP8 GEMMs, as torchao's tensorwise recipe measures them.
        return PER_TENSOR

    def layer_compile(self) -> tuple[bool, str]:
        on, why = super().layer_compile()
        if on and self.recipe.compile_fp8_layers is None and self.sharded:
            return False, "O3 under FSDP2: eager layers measured faster past the warm-up"
        return on, why

    def later_compiles(self) -> str:
        # the layers' forward branches on the warm-up (scales from the tensor at hand), which ends once the window
        # has filled: each layer's delayed-scale variant compiles then (10-24 s on the d4096 proxy, two H200s)
        window = self.warm_up_steps()
        return "" if window == 0 else f", and once more at step {window} when the amax window has filled"

    def warm_up_steps(self) -> int:
        # scales from the tensor at hand until the amax window has filled, a graph of their own when compiled
        window = self.effective_options()["amax_history_len"]
        return 0 if window == 1 else window

    def effective_options(self) -> dict[str, object]:
        out = super().effective_options()
        r = self.recipe
        out["amax_history_len"] = r.amax_history_len if r.amax_history_len is not None else DEFAULT_WINDOW
        out["weight_dtype"] = self.storage["weight_dtype"] or "fp16"
        return out

    # ----- layer replacement ----------------------------------------------------------------------
    def convert(self, model: nn.Module, plan: PrecisionPlan) -> nn.Module:
        from ..convert import swap_planned_modules

        opts = self.effective_options()
        options = dict(weight_dtype=self.weight_dtype, fp8_format=self.fp8_format,
                       amax_history_len=opts["amax_history_len"], amax_compute_algo=opts["amax_compute_algo"],
                       margin=opts["margin"], emulate=self.emulated, fp8_eval=opts["use_autocast_during_eval"],
                       sharded_master=self.sharded)
        self.weight_storage.remember_dtypes(model, plan)
        layer_cls = FP8Linear
        if self.sharded and not self.layer_compile()[0]:  # eager O3 layers under FSDP2, in a compiled model too
            from .eager_layers import EagerFP8Linear

            layer_cls = EagerFP8Linear
        root = swap_planned_modules(model, plan, lambda module, _: layer_cls.from_float(module, **options))
        named = {}
        for name, m in root.named_modules():
            if isinstance(m, FP8Linear) and id(m) not in named:
                named[id(m)] = (name, m)
        self.layer_names = [name for name, _ in named.values()]
        self.layers = [m for _, m in named.values()]
        self.weight_storage.hold(root)
        return root

    # ----- step hooks -------------------------------------------------------------------------------
    def post_optimizer_step(self, model: nn.Module) -> Callable[[], None] | None:
        if self.zero_o3:
            return None  # stepped from after_backward, after DeepSpeed's own step

        def after_step():
            self.communication.update_delayed_scales()  # the step's amaxes all-reduced first (reduce_amax)
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

    def portable_state_dict(self, state_dict: dict) -> dict:
        if self.zero is not None and self.zero.optimizer is not None:
            # the true weights are the FP16 masters, one rank each: a collective, as under ZeRO-3
            masters = self.zero.full_masters()
            state_dict = {**state_dict, **{f"{name}.weight": masters[name] for name in masters
                                           if f"{name}.weight" in state_dict}}
        return super().portable_state_dict(state_dict)

    def convert_own_entries(self, own: dict, incoming: dict) -> tuple[dict, list[str]]:
        """An amax window saved with another `amax_history_len` keeps its most recent columns (zeros beyond
        them, as a fresh window has); a scale that is not a finite positive number is refused: the GEMMs would
        multiply by it once the warm-up is over. So is a window holding a negative amax, or a non-finite one past
        the step in progress (each step's update drops those: a scale would stay frozen for the window's length),
        and a negative step count."""
        converted, refused = {}, []
        for key, value in incoming.items():
            mine = own.get(key)
            if not isinstance(value, torch.Tensor) or not isinstance(mine, torch.Tensor):
                continue
            name = key.rsplit(".", 1)[-1]
            problem = _meta_problem(name, value)
            if problem is not None:
                refused.append(f"{key}: {problem}")
                continue
            if name == META_PREFIX + "amax_history" and value.dim() == 2 and value.shape != mine.shape \
                    and value.shape[0] == mine.shape[0]:
                window = torch.zeros_like(mine)
                keep = min(value.shape[1], mine.shape[1])
                window[:, :keep] = value[:, :keep].to(window.dtype)
                converted[key] = window
            elif name.startswith(META_PREFIX + "scale_") and value.numel() == 1 and not (
                    torch.isfinite(value).all() and (value > 0).all()):
                refused.append(f"{key} = {float(value)} (an FP8 scale must be finite and positive)")
        return converted, refused

    @classmethod
    def strip_state_dict(cls, state_dict: dict) -> dict:
        """Without FP8Linear's scaling metadata (amax histories, scales, the FP8 gradient buffers)."""
        return {k: v for k, v in state_dict.items() if not k.rsplit(".", 1)[-1].startswith(META_PREFIX)}

    # ----- plan ---------------------------------------------------------------------------------------
    def gemm_precision(self, plan: PrecisionPlan) -> TensorPrecision:
        from ...planning.plan import TensorPrecision

        if not plan.converted:
            return TensorPrecision("gemm", plan.param_dtype)  # nothing becomes an FP8Linear
        opts = self.effective_options()
        weights = ("as all-gathered" if self.sharded else "as stored" if self.zero_o3
                   else "from their current amax")
        ranks = ""
        if self.context.engine != "single":
            ranks = (", their amaxes all-reduced (MAX) across ranks once per step" if self.amax_reduction
                     else ", each rank's own amaxes (reduce_amax=False)")
        return TensorPrecision("gemm", {"HYBRID": "FP8 E4M3/E5M2", "E4M3": "FP8 E4M3"}[self.fp8_format],
                               f"power-of-2 per-tensor: inputs and output grads from the {opts['amax_compute_algo']} "
                               f"amax of the last {opts['amax_history_len']} steps (current amax while warming "
                               f"up){ranks}, weights {weights}")

    def notes(self, plan: PrecisionPlan) -> list[str]:
        notes = [f"level {self.level}: Adam/AdamW passed to prepare() becomes lowprec.optim.LowBitAdam(W) with "
                 f"{'sharded ' if self.sharded else ''}FP8+FP16 states; other optimizers are refused"]
        if self.zero_o3:
            notes.append(f"O3 under DeepSpeed ZeRO: model state {plan.model_state_bytes_per_param:.3g} bytes/param per "
                         "rank (converted Linears: 1 + 1 + 5/N: FP8 weight and gradient on every rank, FP16 master and "
                         "FP8+FP16 states on one); their weights are kept out of DeepSpeed's optimizer, stepped right "
                         "after it with the same hyper-parameters, clipped with DeepSpeed's gradient_clipping by the "
                         "norm over all gradients; call get_state_dict on every rank (the masters are gathered from "
                         "their owners)")
        elif self.sharded:
            notes.append(f"O3 under FSDP2: model state {plan.model_state_bytes_per_param:.3g} bytes/param per rank "
                         "(MS-AMP's ZeRO-2 O3: 1 + 6/N, whose FP8 weight copy stays on every rank); the converted "
                         "Linears of each transformer block are one FSDP2 group, apart from the block's other "
                         "parameters (FP16 masters cannot share a group with FP32 norms); where those are a few "
                         "(norms) and activation checkpointing is off, Accelerate shards them with the root, not as "
                         "a group per block")
        else:
            notes.append("FP8 weight gradients are not in .grad: clip with accelerator.clip_grad_norm_ (it includes "
                         "them)")
        if (self.sharded and self.context.world_size > 1 and self.recipe.grad_comm_dtype is None
                and self.context.hosts == 1):
            dtype = self.context.engine_precision.grad_reduce or "BF16"
            notes.append(O3_FSDP2_COMM_NOTE.format(dtype=dtype))
        if self.context.engine == "ddp":
            notes.append("DDP: FP8 weight gradients are averaged once per optimizer step, after the last backward")
        if self.sharded and self.context.compiled:
            notes.append(O3_FSDP2_COMPILED_NOTE)
        if not self.emulated and not self.context.compiled and not self.layer_compile()[0]:
            notes.append(O3_FSDP2_EAGER_NOTE if self.sharded else EAGER_LAYERS_NOTE)
        return notes


def _meta_problem(name: str, value: torch.Tensor) -> str | None:
    """Why a saved amax window or step count of an FP8Linear cannot be right, or None."""
    if name == META_PREFIX + "amax_history" and value.dim() == 2 and value.is_floating_point():
        done = value[:, 1:]  # column 0 is the step in progress: a NaN there is dropped by its update
        if (value < 0).any() or not torch.isfinite(done).all():
            return "an amax window holds amaxes >= 0, finite past the step in progress (column 0)"
    if name == META_PREFIX + "steps" and value.numel() == 1:
        steps = float(value)
        if not math.isfinite(steps) or steps < 0 or steps != int(steps):
            return f"the step count {value.item()} is not a whole number >= 0"
    return None
