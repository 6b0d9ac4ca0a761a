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

from ..engines import (
    BYTES,
    GRAD_COMM_MEANS,
    EnginePrecision,
    comm_dtype_name,
    default_engine_precision,
    grad_comm_problem,
)
from ..hardware import DeviceInfo
from ..specs import BackendSpec, RecipeInfo
from ..utils.imports import availability

if TYPE_CHECKING:
    from ..plan import PrecisionPlan, TensorPrecision
    from ..recipe import FP8RecipeKwargs


_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class BackendUnavailableError(RuntimeError):
    """The selected backend cannot run here (package missing, not in this version, or hardware)."""


@dataclass(frozen=True)
class RunContext:
    """Where the model will train: the facts a plan depends on besides the model itself."""

    device: DeviceInfo
    engine: str = "single"  # "single", "ddp", "fsdp2", "deepspeed", "fsdp1"
    world_size: int = 1
    compiled: bool = False  # the model will run under torch.compile
    # Where `compiled` comes from, when not from this run's own arguments (an AcceleratorState an earlier
    # Accelerator of the process set up): the plan says so, since the user did not ask for it here.
    compile_source: str = ""
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
    # The adapter's own layer realises weight_dtype / weight_grad_dtype (msamp's FP8Linear);
    # otherwise the base class casts converted weights and installs gradient stores.
    native_storage: ClassVar[bool] = False
    # The name of Accelerate's FP8BackendType whose parameter lookup this backend's weights need when
    # Accelerate remaps optimizer parameters (FSDP2); Accelerate sees NO everywhere else.
    accelerate_parameter_lookup: ClassVar[str | None] = None

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
        self.grad_stores: list = []
        self.store_reducer = None  # averages the stores' FP8 gradients under DDP
        self._original_weight_dtypes: dict[str, torch.dtype] = {}
        if not self.native_storage:
            self._check_storage_engine()
        self.comm_state = None  # the FP8 DDP hook's state, once registered
        problem = grad_comm_problem(self.grad_comm_choice, context.engine)
        if problem is not None:
            raise BackendUnavailableError(problem)

    @property
    def grad_comm_choice(self) -> str | None:
        """The gradient-communication dtype in force: `grad_comm_dtype`, or what the level sets."""
        return self.recipe.grad_comm_dtype

    # ----- storage knobs: weight_dtype, weight_grad_dtype (see lowprec.optim.grad_store) ------------
    @property
    def storage(self) -> dict[str, str | None]:
        """The storage knobs in force (explicit fields, else the level's row); see BackendSpec.storage."""
        return self.spec.storage(self.recipe)

    def weight_storage_dtype(self) -> torch.dtype | None:
        """The dtype converted Linear weights are stored in, or None: the model's own."""
        return _DTYPES.get(self.storage["weight_dtype"])

    def grad_store_dtype(self, weight_dtype: torch.dtype | None) -> torch.dtype | None:
        """The dtype a `GradStore` keeps converted weights' gradients in, or None: `.grad` as usual
        (`weight_dtype`: the weights' storage, None when not known yet)."""
        grad = self.storage["weight_grad_dtype"]
        if grad == "fp8":
            return torch.float8_e4m3fn
        if grad == "bf16" and weight_dtype != torch.bfloat16:
            return torch.bfloat16
        return None

    def stores_weight_grads(self, param_dtype: torch.dtype) -> bool:
        """Whether converted Linears keep their weight gradients outside `.grad` (in stores, or on msamp's
        layers) in a model of `param_dtype`."""
        if self.native_storage:
            return False
        weight = self.weight_storage_dtype()
        return self.grad_store_dtype(weight if weight is not None else param_dtype) is not None

    def _check_storage_engine(self) -> None:
        engine = self.context.engine
        if engine == "single":
            return
        storage = self.storage
        weight, grad = storage["weight_dtype"], storage["weight_grad_dtype"]
        if engine == "ddp":
            # DDP averages .grad in the weights' dtype, and FP8GradReducer the FP8 stores; nothing
            # averages a BF16 store yet.
            if grad == "bf16" and weight != "bf16":
                raise BackendUnavailableError(
                    f"FP8RecipeKwargs(backend={self.name!r}, weight_grad_dtype='bf16') keeps the gradients of "
                    f"{weight or 'the model'}'s weights in BF16 outside .grad, which nothing averages under DDP in "
                    "this version of lowprec; use weight_grad_dtype='fp8' (averaged in FP8) or weight_dtype='bf16'"
                )
            return
        # Named as the user set them: a knob the level filled in is shown as part of the level.
        knobs = [k for k in ("weight_dtype", "weight_grad_dtype") if storage[k] not in (None, "fp32")]
        wanted = [f"{k}={storage[k]!r}" for k in knobs if getattr(self.recipe, k) is not None]
        implied = [f"{k}={storage[k]!r}" for k in knobs if getattr(self.recipe, k) is None]
        if implied:
            wanted.append(f"opt_level={storage['opt_level']!r} ({', '.join(implied)})")
        if wanted:
            raise BackendUnavailableError(
                f"FP8RecipeKwargs(backend={self.name!r}): {', '.join(wanted)} runs on one process or under DDP in "
                f"this version of lowprec, not under {engine}: its low-precision weights and gradients need "
                "sharded FP8 gradient communication, which is not there yet. Keep these knobs unset there "
                "(optimizer_states works everywhere)"
            )

    def apply_storage(self, root: nn.Module) -> None:
        """Store converted weights in `weight_dtype` and keep their gradients in stores, as planned."""
        if self.native_storage:
            return
        from ..optim.grad_store import clear_in_zero_grad, install_grad_stores

        converted = [(name, m) for name, m in root.named_modules() if self.converted_kind(m) == "linear"
                     and isinstance(getattr(m, "weight", None), nn.Parameter)]
        dtype = self.weight_storage_dtype()
        if dtype is not None:
            for name, module in converted:
                weight = module.weight
                if weight.dtype != dtype:
                    self._original_weight_dtypes[(name + "." if name else "") + "weight"] = weight.dtype
                    weight.data = weight.data.to(dtype)  # the same Parameter: the optimizer keeps it
        by_dtype: dict[torch.dtype, list[nn.Module]] = {}
        for _, module in converted:
            store_dtype = self.grad_store_dtype(module.weight.dtype)
            if store_dtype is not None:
                by_dtype.setdefault(store_dtype, []).append(module)
        for store_dtype, modules in by_dtype.items():
            self.grad_stores += install_grad_stores(modules, store_dtype)
        clear_in_zero_grad(root, self.grad_stores)
        if self.context.engine == "ddp" and self.grad_stores:
            from ..optim.grad_store import ignore_in_ddp

            ignore_in_ddp(root, [store.module for store in self.grad_stores])

    def setup_grad_stores(self, model: nn.Module) -> None:
        """After wrapping: `model.zero_grad()` of the wrapper clears the stores too, and under DDP the
        stored FP8 gradients are averaged by `FP8GradReducer` (DDP ignores those weights, so their
        initial values are broadcast from rank 0 here)."""
        if not self.grad_stores:
            return
        import torch.distributed as dist

        from ..optim.grad_store import clear_in_zero_grad

        clear_in_zero_grad(model, self.grad_stores)
        ddp = self.context.engine == "ddp" and dist.is_available() and dist.is_initialized()
        if ddp and dist.get_world_size() > 1 and self.store_reducer is None:
            from ..optim.grad_reduce import FP8GradReducer

            self.store_reducer = FP8GradReducer(self.grad_stores)
            with torch.no_grad():
                for store in self.grad_stores:
                    dist.broadcast(store.weight.data, src=0)

    def setup_grad_comm(self, model: nn.Module) -> None:
        """Put in place the gradient communication `grad_comm_dtype` asks for: a communication hook on
        the DDP wrapper, or FP8 reduce-scatters on FSDP2's sharded modules. (FP32/BF16 under FSDP and
        DeepSpeed are the engines' own settings, applied before they wrap: `engines.apply_grad_comm_dtype`.)"""
        choice = self.grad_comm_choice
        engine = self.context.engine
        if choice == "fp8" and engine == "fsdp2":
            from ..optim.comm_hooks import install_fp8_reduce_scatter

            self.comm_state = install_fp8_reduce_scatter(model)
            return
        if choice is None or engine != "ddp":
            return
        ddp = model if isinstance(model, nn.parallel.DistributedDataParallel) else getattr(model, "_orig_mod", None)
        if not isinstance(ddp, nn.parallel.DistributedDataParallel):
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                raise RuntimeError(f"lowprec: grad_comm_dtype={choice!r} needs the DDP wrapper to hook, and "
                                   f"prepare() returned {type(model).__name__}")
            return  # one process: nothing is communicated
        model = ddp
        from ..optim.comm_hooks import FP8CommState, bf16_allreduce_hook, fp8_allreduce_hook, fp32_allreduce_hook

        if choice == "fp8":
            self.comm_state = FP8CommState(model.process_group)
            model.register_comm_hook(self.comm_state, fp8_allreduce_hook)
        else:
            hook = bf16_allreduce_hook if choice == "bf16" else fp32_allreduce_hook
            model.register_comm_hook(model.process_group, hook)

    def _reduce_stores_if_pending(self) -> None:
        if self.store_reducer is not None:
            self.store_reducer.reduce_if_pending()

    def verify_storage(self, model: nn.Module) -> None:
        """Raise `PlanMismatchError` where a converted weight or its gradient is not stored as planned."""
        from ..plan import PlanMismatchError

        planned = self.weight_storage_dtype()
        stored = {id(store.weight) for store in self.grad_stores}
        wrong = []
        for name, module in model.named_modules():
            weight = getattr(module, "weight", None)
            if self.converted_kind(module) != "linear" or not isinstance(weight, nn.Parameter):
                continue
            if planned is not None and weight.dtype != planned:
                wrong.append(f"{name}.weight: planned {planned}, built {weight.dtype}")
            # a frozen weight has no gradient to store (the plan's module list says so)
            store = self.grad_store_dtype(weight.dtype) if weight.requires_grad else None
            if not self.native_storage and (store is not None) != (id(weight) in stored):
                wrong.append(f"{name}.weight: gradient store planned {store}, "
                             f"built {'one' if id(weight) in stored else 'none'}")
        if wrong:
            raise PlanMismatchError("the converted model does not store weights as its plan says:\n  "
                                    + "\n  ".join(wrong))

    def storage_rows(self, rows: list[TensorPrecision], plan: PrecisionPlan) -> list[TensorPrecision]:
        """`rows` with the weight and weight-gradient entries the storage knobs change."""
        from ..plan import TensorPrecision, short_dtype

        if self.native_storage or not plan.converted:
            return rows
        hp = plan.param_dtype
        weight = self.weight_storage_dtype()
        weight_name = short_dtype(weight) if weight is not None else hp
        store = self.grad_store_dtype(weight if weight is not None else _DTYPES.get(hp.lower()))
        def why(knob: str) -> str:
            value = getattr(self.recipe, knob)
            return f"{knob}={value!r}" if value is not None else f"level {self.storage['opt_level']}"

        out = []
        for row in rows:
            if row.kind == "grad_comm" and self.context.engine == "ddp" and store == torch.float8_e4m3fn:
                row = TensorPrecision("grad_comm", f"FP8 E4M3, shared scale (FP8 Linear), {row.dtype} (rest)",
                                      "stored weight gradients: amax all-reduced (MAX), FP8 all_to_all, FP32 sum, "
                                      "FP8 all_gather, once per optimizer step; the rest by DDP")
            elif row.kind == "weight" and weight is not None:
                row = TensorPrecision("weight", f"{weight_name} (FP8 Linear), {row.dtype} (rest)",
                                      f"{why('weight_dtype')}: updated in place by LowBitAdam(W) in FP32 math, "
                                      "no master copy")
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
        too_new = self.info.max_capability is not None and dev.capability is not None
        if too_new and dev.capability >= self.info.max_capability:
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

    def slow_replacement(self, module: nn.Module, kind: str) -> str | None:
        """Why replacing a module other than a Linear (a norm) would make this run slower, or None.
        `skip_slow_shapes` keeps such a module as it is, as it keeps a slow Linear."""
        return None

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

            check_optimizer(optimizer, self.optimizer_states, backend=self.name, asked=self._states_asked)

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, plan: PrecisionPlan) -> torch.optim.Optimizer:
        """Optimizer-state precision: low-bit states replace Adam/AdamW with lowprec's low-bit Adam,
        which also reads the weight gradients kept in stores."""
        if self.optimizer_states is None:
            return optimizer
        from ..optim.levels import low_bit_optimizer

        new = low_bit_optimizer(optimizer, self.optimizer_states, backend=self.name, asked=self._states_asked)
        if self.grad_stores:
            new.attach_fp8_grads(self.grad_stores)
            new.add_fp8_pre_step(self._reduce_stores_if_pending)
        return new

    @property
    def opt_level(self) -> str | None:
        """The memory level in force (a backend may have a default when the recipe names none)."""
        return self.storage["opt_level"]

    @property
    def optimizer_states(self) -> str | None:
        """The optimizer-state storage in force ('fp8', 'e4m3+e4m3', ...), or None: the optimizer's own.

        Weights below FP32 or gradients in stores need lowprec's low-bit Adam (FP32 update math, reads
        the stores), with FP32 states unless asked otherwise."""
        states = self.storage["optimizer_states"]
        if states is None and not self.native_storage and self._needs_low_bit_adam():
            return "fp32"
        return states

    def _needs_low_bit_adam(self) -> bool:
        storage = self.storage
        return storage["weight_dtype"] in ("fp16", "bf16") or storage["weight_grad_dtype"] in ("fp8", "bf16")

    @property
    def _states_asked(self) -> str:
        """The option that asks for lowprec's low-bit Adam, as the user set it, for messages (the states in
        force are the level's or FP32, which the user may never have written)."""
        if self.recipe.optimizer_states is not None:
            return f"optimizer_states={self.recipe.optimizer_states!r}"
        level = self.storage["opt_level"]
        if level is not None:
            return f"opt_level={level!r}" + ("" if self.recipe.opt_level is not None else
                                             f" (backend {self.name!r}'s default)")
        knob = "weight_dtype" if self.storage["weight_dtype"] in ("fp16", "bf16") else "weight_grad_dtype"
        return self.spec.written(self.recipe, knob)

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

    def fp8_dtypes(self) -> tuple[torch.dtype, torch.dtype]:
        """The FP8 formats of (activations and weights, output gradients) under this recipe's format."""
        return torch.float8_e4m3fn, (torch.float8_e5m2 if self.fp8_format == "HYBRID" else torch.float8_e4m3fn)

    def scales_in_use(self, module: nn.Module) -> dict[str, float] | None:
        """The scales a converted layer's casts use now, where the backend keeps them (delayed scaling):
        {"input": ..., "weight": ..., "output_grad": ...}, any subset; None: computed from each tensor."""
        return None

    def gradients_outside_grad(self) -> str | None:
        """Where this backend keeps weight gradients that are not in `.grad` ("in FP8 stores"), or None:
        an optimizer `prepare()` did not wrap would not see them."""
        if self.grad_stores:
            return f"of converted Linears in {self.grad_stores[0].dtype} gradient stores, not in .grad"
        return None

    # ----- compile_fp8_layers ---------------------------------------------------------------------
    LAYER_COMPILE_BACKEND: ClassVar[str] = "inductor"  # torch.compile backend of compile_layers
    # torch.compile's `dynamic` for the layers (None: its default, static first, dynamic from the second shape)
    LAYER_COMPILE_DYNAMIC: ClassVar[bool | None] = None
    # Engines where compiling the layers was measured to pay (torchao, eager d4096 proxy): one H100
    # (results/gpu/2026-11-23-h100-eager-layers), FSDP2 and DeepSpeed ZeRO-2 on two H200s (1.19x BF16
    # against 0.60-0.67x with eager layers: results/gpu/2026-11-23-h200x2-zero-o3)
    LAYER_COMPILE_ENGINES: ClassVar[tuple[str, ...]] = ("single", "ddp", "fsdp2", "deepspeed")

    def layer_compile(self) -> tuple[bool, str]:
        """(whether `prepare()` compiles each converted layer one by one, why): `compile_fp8_layers`."""
        choice = self.recipe.compile_fp8_layers
        if self.context.compiled:
            return False, "the model is compiled whole (dynamo_backend)"
        if choice is not None:
            return choice, f"compile_fp8_layers={choice}"
        if not self.compiles_layers:
            return False, f"not measured to pay for backend {self.name!r}"
        if self.emulated:
            return False, "emulated: no FP8 speed to win"
        if self.context.engine not in self.LAYER_COMPILE_ENGINES:
            return False, f"not measured under {self.context.engine}"
        return True, "eager model on an FP8 GPU"

    def compile_layers(self, model: nn.Module) -> int:
        """Compile each converted layer of `model` (nn.Module.compile) where `layer_compile` says so;
        layers of one shape share a compiled graph. Returns how many were compiled."""
        if not self.layer_compile()[0]:
            return 0
        layers = [m for m in model.modules() if self.converted_kind(m) == "linear"]
        for layer in layers:
            layer.compile(backend=self.LAYER_COMPILE_BACKEND, dynamic=self.LAYER_COMPILE_DYNAMIC)
        return len(layers)

    def engine_config_problem(self, config: dict) -> str | None:
        """Why this backend cannot run under the engine's configuration (a DeepSpeed config dict: its
        ZeRO stage, fp16), or None. `prepare()` raises it before the engine wraps anything."""
        return None

    def before_engine_prepare(self, objects: list, accelerator=None) -> None:
        """Adjust, in place, the objects about to be handed to Accelerate's `prepare()` (after
        conversion, before the engine wraps them) where this backend's tensors need it.
        `accelerator`: the lowprec Accelerator preparing them (its engine plugins)."""

    def setup_communication(self, model: nn.Module, plan: PrecisionPlan) -> None:
        """Install gradient / weight communication hooks on the wrapped model (DDP hook etc.)."""

    def after_backward(self, sync_gradients: bool) -> None:
        """Called by `Accelerator.backward`; `sync_gradients` is False inside accumulation windows."""
        if self.store_reducer is None:
            return
        # Every backward may add local gradient, also after a reduction (two backwards per step):
        # reducing again averages (mean + local) into mean + mean of the locals.
        self.store_reducer.mark_pending()
        if sync_gradients:
            self.store_reducer.reduce_if_pending()

    def clip_grad_norm_(self, parameters, max_norm: float, norm_type: float = 2.0) -> torch.Tensor | None:
        """Clip gradients the backend keeps outside `.grad`; None leaves clipping to Accelerate."""
        if not self.grad_stores:
            return None
        from ..optim.grad_store import clip_grad_norm_

        self._reduce_stores_if_pending()
        return clip_grad_norm_(parameters, self.grad_stores, max_norm, norm_type)

    def forward_context(self, model: nn.Module) -> Callable[[], contextlib.AbstractContextManager] | None:
        """A factory for the context every forward must run in (TE autocast), or None."""
        return None

    def post_optimizer_step(self, model: nn.Module) -> Callable[[], None] | None:
        """A callable to run after each real optimizer step, or None."""
        return None

    def portable_state_dict(self, state_dict: dict) -> dict:
        """The state dict as the original (unconverted) model would have it."""
        return type(self).strip_state_dict(self.restore_weight_dtypes(state_dict))

    @classmethod
    def strip_state_dict(cls, state_dict: dict) -> dict:
        """`state_dict` without the entries only this backend's modules add, and with tensors of its own
        types made plain: what can be undone without knowing how the model was converted
        (`lowprec.portable_state_dict` applies every backend's to a model of unknown origin)."""
        return state_dict

    def restore_weight_dtypes(self, state_dict: dict) -> dict:
        """Weights stored in `weight_dtype` back in the dtype the model was built with."""
        dtypes = self._original_weight_dtypes
        if not dtypes:
            return state_dict
        return {k: v.to(dtypes[k]) if k in dtypes and isinstance(v, torch.Tensor) else v for k, v in state_dict.items()}

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
        weight = self.weight_storage_dtype()
        store = self.grad_store_dtype(weight if weight is not None else param_dtype)
        if not self.native_storage and (weight is not None or store is not None):
            share = plan.fp8_param_share  # the converted Linear weights' share of all parameters
            w_size = weight.itemsize if weight is not None else size
            g_size = store.itemsize if store is not None else w_size
            out["weight"] = share * w_size + (1 - share) * out["weight"]
            out["weight_grad"] = share * g_size + (1 - share) * out["weight_grad"]
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
        choice = self.grad_comm_choice
        if self.context.engine == "single":
            comm = TensorPrecision("grad_comm", "N/A (one process)")
        elif choice is not None:
            comm = TensorPrecision("grad_comm", comm_dtype_name(choice, self.context.engine),
                                   f"grad_comm_dtype={choice!r}: {GRAD_COMM_MEANS[self.context.engine, choice]}")
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

