"""The adapter protocol: what every FP8 backend provides.

A backend owns the three jobs of the precision table (DESIGN.md):
1. layer replacement (`candidate_kind`, `constraint`, `convert`, `forward_context`),
2. optimizer-state precision (`wrap_optimizer`),
3. communication precision (`setup_communication`),
plus lifecycle hooks (`post_optimizer_step`). What it supports is declared in `lowprec.specs`, so a
recipe is validated at construction without importing the adapter or the backend's package.
"""

from __future__ import annotations

import contextlib
import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from ..engines import BYTES, EnginePrecision, default_engine_precision
from ..hardware import DeviceInfo
from ..specs import BackendSpec, RecipeInfo
from ..utils.imports import availability

if TYPE_CHECKING:
    from ..plan import PrecisionPlan, TensorPrecision
    from ..recipe import FP8RecipeKwargs


class BackendUnavailableError(RuntimeError):
    """The selected backend cannot run here (package missing, not in this version, or hardware)."""


@dataclass(frozen=True)
class RunContext:
    """Where the model will train: the facts a plan depends on besides the model itself."""

    device: DeviceInfo
    engine: str = "single"  # "single", "ddp", "fsdp2", "deepspeed", "fsdp1"
    world_size: int = 1
    compiled: bool = False  # the model will run under torch.compile
    # What the engine does with precision; None: what Accelerate gives the engine by default.
    precision: EnginePrecision | None = None

    ENGINES: ClassVar[tuple[str, ...]] = ("single", "ddp", "fsdp2", "deepspeed", "fsdp1")

    def __post_init__(self):
        if self.engine not in self.ENGINES:
            raise ValueError(f"RunContext.engine={self.engine!r} is not one of {self.ENGINES}")

    @property
    def engine_precision(self) -> EnginePrecision:
        return self.precision if self.precision is not None else default_engine_precision(self.engine)


class Backend(ABC):
    """Base class of backend adapters. Subclasses register themselves in `lowprec.backends`."""

    spec: ClassVar[BackendSpec]  # the declaration in lowprec.specs; the attributes below come from it
    name: ClassVar[str]
    display_name: ClassVar[str]
    package: ClassVar[str | None]
    recipes: ClassVar[Mapping[str, RecipeInfo]]
    default_recipe: ClassVar[str]
    supports_emulation: ClassVar[bool]
    opt_levels: ClassVar[tuple[str | None, ...]]
    eval_fp8_default: ClassVar[bool]
    eval_fp8_configurable: ClassVar[bool]
    pads_inner_dim: ClassVar[bool]
    supports_fp8_weights: ClassVar[bool]
    weight_dtypes: ClassVar[tuple[str, ...]]
    # The FP8 module keeps the original Parameter objects (torchao); otherwise conversion makes new
    # ones, and a Linear whose weight is tied to another module must stay as it is.
    reuses_parameters: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        spec = cls.__dict__.get("spec")
        if spec is not None:
            for f in dataclasses.fields(spec):
                if f.name not in ("adapter", "aliases"):
                    setattr(cls, f.name, getattr(spec, f.name))

    # ----- static validation (no optional package imported) ---------------------------------
    @classmethod
    def recipe_info(cls, recipe: FP8RecipeKwargs) -> RecipeInfo:
        return cls.spec.recipe_info(recipe)

    @classmethod
    def check_recipe(cls, recipe: FP8RecipeKwargs) -> None:
        """Raise ValueError for a combination of options this backend cannot honour."""
        cls.spec.check_recipe(recipe)

    @classmethod
    def default_recipe_for(cls, context: RunContext) -> str:
        """The recipe used when the user names none; a backend may choose by context."""
        return cls.default_recipe

    @classmethod
    def context_problem(cls, recipe_name: str, context: RunContext) -> str | None:
        """Why `recipe_name` cannot run in `context` (e.g. not under torch.compile), or None."""
        return None

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        if cls.package is None:
            return True, ""
        return availability(cls.package)

    # ----- runtime ---------------------------------------------------------------------------
    def __init__(self, recipe: FP8RecipeKwargs, context: RunContext):
        self.recipe = recipe
        self.context = context
        self.recipe_name = recipe.recipe or self.default_recipe_for(context)
        self.info = self.recipes[self.recipe_name]
        problem = self.context_problem(self.recipe_name, context)
        if problem is not None:
            raise ValueError(f"FP8RecipeKwargs(backend={self.name!r}, recipe={self.recipe_name!r}) {problem}")
        self.fp8_format = recipe.fp8_format or self.info.formats[0]
        self.emulated, self.execution_note = self._decide_execution()

    def _decide_execution(self) -> tuple[bool, str]:
        """Hardware FP8 or emulation, with the reason. Raises if neither is possible."""
        dev = self.context.device
        need = self.info.min_capability
        hw_ok = dev.type == "cuda" and dev.capability is not None and dev.capability >= need
        if self.info.max_capability is not None and dev.capability is not None:
            hw_ok = hw_ok and dev.capability < self.info.max_capability
        if self.recipe.emulate:
            return True, "emulated (emulate=True): FP8 numerics, high-precision matmuls, no speed-up"
        if hw_ok:
            return False, f"hardware FP8 on {dev.describe()}"
        why = (
            f"{dev.describe()} has no FP8 tensor cores"
            if not dev.fp8_gemm
            else f"recipe {self.recipe_name!r} needs sm_{need[0]}{need[1]}+, {dev.describe()} is older"
        )
        if self.info.max_capability is not None and dev.capability is not None and dev.capability >= self.info.max_capability:
            why = f"recipe {self.recipe_name!r} is not supported on {dev.describe()}"
        if self.recipe.emulate is False or not self.supports_emulation:
            raise BackendUnavailableError(
                f"backend {self.name!r} recipe {self.recipe_name!r} cannot run here: {why}"
                + ("" if self.supports_emulation else f", and {self.display_name} has no emulation mode")
                + ("; emulate=False forbids emulation" if self.recipe.emulate is False else "")
            )
        return True, f"emulated: {why}. FP8 numerics are exact, matmuls run in high precision, no speed-up"

    @abstractmethod
    def candidate_kind(self, module: nn.Module) -> str | None:
        """'linear' / 'layernorm' / 'rmsnorm' if this backend could convert `module`, else None."""

    @abstractmethod
    def constraint(self, module: nn.Module) -> str | None:
        """Why `module` cannot run in FP8 on this backend (e.g. shape), or None if it can."""

    @property
    def speed_scaling(self) -> str | None:
        """The scaling kind (`lowprec.speed.PER_TENSOR`, ...) whose measured thresholds decide
        `skip_slow_shapes` for this backend's GEMMs; None: the backend has no speed rule."""
        return None

    def slow_shape(self, module: nn.Module) -> str | None:
        """Why FP8 would make `module` slower than high precision on this device, or None. Only for
        Linear-likes; None also where nothing was measured for the device (the plan notes it)."""
        from .. import speed

        if self.speed_scaling is None:
            return None
        return speed.slow_reason(self.context.device, self.speed_scaling, module.out_features, module.in_features)

    @abstractmethod
    def tensor_precisions(self, plan: PrecisionPlan) -> list[TensorPrecision]:
        """The precision table row this backend realises, one entry per tensor kind."""

    @abstractmethod
    def convert(self, model: nn.Module, plan: PrecisionPlan) -> nn.Module:
        """Replace the modules the plan marks for conversion; returns the (possibly new) root."""

    @abstractmethod
    def is_converted(self, module: nn.Module) -> bool:
        """True if `module` is one of this backend's FP8 modules."""

    def converted_kind(self, module: nn.Module) -> str | None:
        """The kind ('linear', 'layernorm', 'rmsnorm') of one of this backend's modules, else None."""
        return "linear" if self.is_converted(module) else None

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Raise ValueError, before any model is converted, if `wrap_optimizer` would refuse `optimizer`."""
        if self.optimizer_states is not None:
            from ..optim.levels import check_optimizer

            check_optimizer(optimizer, self.optimizer_states, backend=self.name, option=self._states_option)

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, plan: PrecisionPlan) -> torch.optim.Optimizer:
        """Optimizer-state precision: low-bit states replace Adam/AdamW with lowprec's low-bit Adam."""
        if self.optimizer_states is None:
            return optimizer
        from ..optim.levels import low_bit_optimizer

        return low_bit_optimizer(optimizer, self.optimizer_states, backend=self.name, option=self._states_option)

    @property
    def opt_level(self) -> str | None:
        """The memory level in force (a backend may have a default when the recipe names none)."""
        return self.recipe.opt_level

    @property
    def optimizer_states(self) -> str | None:
        """The optimizer-state storage in force ('fp8', 'e4m3+e4m3', ...), or None: the optimizer's own."""
        from ..optim.levels import LEVEL_STATES

        if self.recipe.optimizer_states is not None:
            return self.recipe.optimizer_states
        return LEVEL_STATES[self.opt_level] if self.opt_level is not None else None

    @property
    def _states_option(self) -> str:
        return "optimizer_states" if self.recipe.optimizer_states is not None else "opt_level"

    def optimizer_state_precision(self, param_dtype: str) -> TensorPrecision:
        """The optimizer-state column: the low-bit states in force, or the parameters' dtype."""
        from ..optim.levels import state_description
        from ..plan import TensorPrecision

        states = self.optimizer_states
        if states is None:
            return TensorPrecision("optimizer_states", f"{param_dtype}+{param_dtype}")
        why = (f"optimizer_states={states!r}" if self.recipe.optimizer_states is not None
               else f"level {self.opt_level}")
        return TensorPrecision("optimizer_states", state_description(states),
                               f"{why}: lowprec.optim.LowBitAdam(W), per-tensor power-of-2 scales")

    def setup_communication(self, model: nn.Module, plan: PrecisionPlan) -> None:
        """Install gradient / weight communication hooks on the wrapped model (DDP hook etc.)."""

    def after_backward(self, sync_gradients: bool) -> None:
        """Called by `Accelerator.backward`; `sync_gradients` is False inside accumulation windows."""

    def clip_grad_norm_(self, parameters, max_norm: float, norm_type: float = 2.0) -> torch.Tensor | None:
        """Clip gradients the backend keeps outside `.grad`; None leaves clipping to Accelerate."""
        return None

    def forward_context(self, model: nn.Module) -> Callable[[], contextlib.AbstractContextManager] | None:
        """A factory for the context every forward must run in (TE autocast), or None."""
        return None

    def post_optimizer_step(self, model: nn.Module) -> Callable[[], None] | None:
        """A callable to run after each real optimizer step, or None."""
        return None

    def portable_state_dict(self, state_dict: dict) -> dict:
        """The state dict as the original (unconverted) model would have it."""
        return state_dict

    def effective_options(self) -> dict[str, object]:
        """The recipe options as this backend applies them (defaults filled in), for the plan."""
        r = self.recipe
        out: dict[str, object] = {"fp8_format": self.fp8_format}
        if self.info.delayed:
            out["margin"] = r.margin if r.margin is not None else 0
            out["amax_history_len"] = r.amax_history_len if r.amax_history_len is not None else 1024
            out["amax_compute_algo"] = r.amax_compute_algo or "max"
        out["use_autocast_during_eval"] = (
            r.use_autocast_during_eval if r.use_autocast_during_eval is not None else self.eval_fp8_default
        )
        if self.supports_fp8_weights:
            out["fp8_weights"] = bool(r.fp8_weights)
        out["skip_first_last"] = r.skip_first_last
        out["skip_slow_shapes"] = r.skip_slow_shapes
        out["opt_level"] = self.opt_level
        out["optimizer_states"] = self.optimizer_states
        if self.pads_inner_dim:
            out["pad_inner_dim"] = bool(r.pad_inner_dim)
        return out

    def model_state_bytes(self, plan: PrecisionPlan, param_dtype: torch.dtype) -> dict[str, float]:
        """Bytes per parameter of weight, gradient, master weight and optimizer states (Adam-type)."""
        from ..optim.levels import state_bytes

        size = param_dtype.itemsize
        states = 2 * size if self.optimizer_states is None else state_bytes(self.optimizer_states)
        out = {"weight": size, "weight_grad": size, "master_weight": 0, "optimizer_states": states}
        out.update(self.engine_state_bytes(param_dtype))
        return out

    def notes(self, plan: PrecisionPlan) -> list[str]:
        """Extra lines for the printed plan."""
        return []

    def engine_rows(self, hp: str, *, fp8_gather: bool = False) -> list[TensorPrecision]:
        """The gradient-communication, weight and master-weight rows as the engine realises them.

        `hp` is the parameters' dtype; `fp8_gather` says the backend all-gathers weights in FP8.
        """
        from ..plan import TensorPrecision

        ep = self.context.engine_precision
        why = f"from {ep.source}" if ep.source else ""
        if self.context.engine == "single":
            comm = TensorPrecision("grad_comm", "N/A (one process)")
        else:
            comm = TensorPrecision("grad_comm", ep.grad_reduce or hp, why if ep.grad_reduce else "")
        weight = ep.weight or hp
        if fp8_gather:
            weight = f"{weight} (all-gathered as FP8 E4M3)"
        elif ep.param_gather and ep.param_gather != weight:
            weight = f"{weight} (all-gathered as {ep.param_gather})"
        master = TensorPrecision("master_weight", f"{ep.master_weight} ({self.context.engine})" if ep.master_weight
                                 else "N/A", why if ep.master_weight else "")
        return [comm, TensorPrecision("weight", weight, why if weight != hp else ""), master]

    def engine_state_bytes(self, param_dtype: torch.dtype) -> dict[str, float]:
        """Bytes per parameter the engine changes: DeepSpeed's BF16 weights/grads + FP32 masters."""
        ep = self.context.engine_precision
        out: dict[str, float] = {}
        if ep.weight is not None:
            out["weight"] = out["weight_grad"] = float(BYTES.get(ep.weight, param_dtype.itemsize))
        if ep.master_weight is not None:
            out["master_weight"] = float(BYTES.get(ep.master_weight, 4))
        return out

