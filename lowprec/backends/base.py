"""The adapter protocol: what every FP8 backend provides.

A backend owns the three jobs of the precision table (DESIGN.md):
1. layer replacement (`candidate_kind`, `constraint`, `convert`, `gemm_precision`): the adapter's own,
2. optimizer-state precision (`optimizer_part`, `parts/optimizer.py`),
3. communication precision (`communication_part`, `parts/communication.py`),
plus the storage knobs of the MS-AMP levels (`storage_part`, `parts/storage.py`) and lifecycle hooks
(`post_optimizer_step`). An adapter names its parts in those three class attributes, which
`Backend.__init__` instantiates: the shared ones unless its layers or levels decide a job their own way
(msamp brings all three, TE a storage part for `fp8_weights`). The methods below of the old names hand
over to the parts, and the plan's rows and bytes per parameter come from them. What a backend supports
is declared in `lowprec.frontend.specs`, so a recipe is validated at construction without importing the
adapter or the backend's package.
"""

from __future__ import annotations

import contextlib
import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from ..frontend.specs import BackendSpec, RecipeInfo
from ..utils.imports import availability
from .context import BackendUnavailableError, RunContext
from .execution import LayerExecution
from .parts import GradientCommunication, OptimizerPrecision, WeightStorage

if TYPE_CHECKING:
    from ..frontend.recipe import FP8RecipeKwargs
    from ..planning.activations import SavedInput
    from ..planning.plan import PrecisionPlan, TensorPrecision


__all__ = ["Backend", "BackendUnavailableError", "RunContext"]


class Backend(LayerExecution, ABC):
    """Base class of backend adapters. Subclasses register themselves in `lowprec.backends`; how their
    layers execute (hardware or emulated FP8, compiled one by one) is `LayerExecution`'s."""

    spec: ClassVar[BackendSpec]  # the declaration in lowprec.frontend.specs; the attributes below come from it
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
    # The parts `__init__` composes (lowprec/backends/parts): an adapter whose layers or level decide a
    # job their own way names a subclass (msamp: its FP8Linear realises the storage knobs itself).
    storage_part: ClassVar[type[WeightStorage]] = WeightStorage
    optimizer_part: ClassVar[type[OptimizerPrecision]] = OptimizerPrecision
    communication_part: ClassVar[type[GradientCommunication]] = GradientCommunication
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

    @classmethod
    def default_recipe_problem(cls, recipe: FP8RecipeKwargs, context: RunContext) -> str | None:
        """Where no recipe is named and this run's default is not the one the options were checked against at
        construction (TE: 'current' for a compiled model, 'delayed' otherwise), why the options do not fit the
        recipe that will run (an amax-history option on a current-scaling recipe), or None."""
        if recipe.recipe:
            return None
        name = cls.default_recipe_for(context)
        if name == cls.spec.default_recipe:
            return None
        try:
            cls.spec.check_recipe(recipe.replace(backend=cls.name, recipe=name))
        except ValueError as exc:
            why = " for a compiled model" if context.compiled else " in this run"
            return (f"FP8RecipeKwargs names no recipe, so backend {cls.name!r} runs its default{why}, {name!r}: "
                    f"{exc}")
        return None

    # ----- runtime ---------------------------------------------------------------------------
    def __init__(self, recipe: FP8RecipeKwargs, context: RunContext):
        self.recipe = recipe
        self.context = context
        # an alias ('tensorwise' for TE's 'current') becomes the recipe it names; the plan notes the mapping
        self.recipe_name = self.spec.recipe_name(recipe.recipe) if recipe.recipe else self.default_recipe_for(context)
        problem = self.default_recipe_problem(recipe, context)
        if problem is not None:
            raise ValueError(problem)
        self.info = self.recipes[self.recipe_name]
        problem = self.context_problem(self.recipe_name, context)
        if problem is not None:
            raise ValueError(f"FP8RecipeKwargs(backend={self.name!r}, recipe={self.recipe_name!r}) {problem}")
        self.fp8_format = recipe.fp8_format or self.info.formats[0]
        self.emulated, self.execution_note = self._decide_execution()
        self.weight_storage = self.storage_part(self)
        self.optimizer_precision = self.optimizer_part(self)
        self.communication = self.communication_part(self)
        self.weight_storage.check_engine()
        self.communication.check()

    # ----- the shared parts, under the names the Accelerator and the adapters use ----------------------
    @property
    def storage(self) -> dict[str, str | None]:
        """The storage knobs in force (explicit fields, else the level's row); see BackendSpec.storage."""
        return self.spec.storage(self.recipe)

    @property
    def grad_stores(self) -> list:
        """The layers or `GradStore`s holding converted weights' gradients outside `.grad`."""
        return self.weight_storage.grad_stores

    @property
    def store_reducer(self):
        """`FP8GradReducer` averaging the stores under DDP, once set up."""
        return self.weight_storage.reducer

    @property
    def comm_state(self):
        return self.communication.state

    @property
    def grad_comm_choice(self) -> str | None:
        """The gradient-communication dtype in force: `grad_comm_dtype`, or what the level sets."""
        return self.communication.choice

    def stores_weight_grads(self, param_dtype: torch.dtype) -> bool:
        """Whether converted Linears keep their weight gradients outside `.grad` (in stores, or on msamp's
        layers) in a model of `param_dtype`."""
        return self.weight_storage.stores_weight_grads(param_dtype)

    def apply_storage(self, root: nn.Module) -> None:
        self.weight_storage.apply(root)

    def setup_grad_stores(self, model: nn.Module) -> None:
        self.weight_storage.setup_after_wrap(model)

    def setup_grad_comm(self, model: nn.Module) -> None:
        self.communication.install(model)

    def verify_storage(self, model: nn.Module) -> None:
        self.weight_storage.verify(model)

    @abstractmethod
    def candidate_kind(self, module: nn.Module) -> str | None:
        """'linear' / 'layernorm' / 'rmsnorm' if this backend could convert `module`, else None."""

    @abstractmethod
    def constraint(self, module: nn.Module) -> str | None:
        """Why `module` cannot run in FP8 on this backend (e.g. shape), or None if it can."""

    @property
    def speed_scaling(self) -> str | None:
        """The scaling kind (`lowprec.planning.speed.PER_TENSOR`, ...) whose measured thresholds decide
        `skip_slow_shapes` for this backend's GEMMs; None: the backend has no speed rule."""
        return None

    def slow_shape(self, module: nn.Module) -> str | None:
        """Why FP8 would make `module` slower than high precision on this device, or None. Only for
        Linear-likes; None also where nothing was measured for the device (the plan notes it)."""
        from ..planning import speed

        if self.speed_scaling is None:
            return None
        return speed.slow_reason(self.context.device, self.speed_scaling, module.out_features, module.in_features)

    def slow_replacement(self, module: nn.Module, kind: str) -> str | None:
        """Why replacing a module other than a Linear (a norm) would make this run slower, or None.
        `skip_slow_shapes` keeps such a module as it is, as it keeps a slow Linear."""
        return None

    # The backend all-gathers converted weights in FP8 under FSDP2 (the weight row says so).
    gathers_fp8_weights: bool = False

    def gemm_precision(self, plan: PrecisionPlan) -> TensorPrecision:
        """The GEMM row of the precision table: the one row only the adapter can write."""
        raise NotImplementedError(
            f"{type(self).__name__} defines neither gemm_precision(plan) nor tensor_precisions(plan)")

    def saved_linear_input(self) -> SavedInput:
        """What each of this backend's FP8 Linear layers keeps of its input for backward (the plan's
        saved-activations section): by default its own FP8 cast with a per-tensor scale."""
        from ..planning.activations import SavedInput

        return SavedInput("FP8 E4M3, per-tensor scale (each layer's own cast)", 1.0)

    def tensor_precisions(self, plan: PrecisionPlan) -> list[TensorPrecision]:
        """The precision table row this backend realises, one entry per kind of `plan.TENSOR_KINDS`: the
        adapter's GEMM row, the engine's rows (communication part) as the storage part changes them, and
        the optimizer part's states."""
        rows = [self.gemm_precision(plan), *self.communication.rows(plan),
                self.optimizer_state_precision(plan.param_dtype)]
        return self.weight_storage.rows(rows, plan)

    @abstractmethod
    def convert(self, model: nn.Module, plan: PrecisionPlan) -> nn.Module:
        """Replace the modules the plan marks for conversion; returns the (possibly new) root."""

    @abstractmethod
    def is_converted(self, module: nn.Module) -> bool:
        """True if `module` is one of this backend's FP8 modules."""

    def converted_kind(self, module: nn.Module) -> str | None:
        """The kind ('linear', 'layernorm', 'rmsnorm') of one of this backend's modules, else None."""
        return "linear" if self.is_converted(module) else None

    def keeps_saved_tensors(self, module: nn.Module) -> bool:
        """Whether what `module` saves for backward is in a form of its own that `activation_dtype='fp8'` must
        leave as it is (plain tensors the library's autograd function split its FP8 tensors into)."""
        return False

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Raise ValueError, before any model is converted, if `wrap_optimizer` would refuse `optimizer`."""
        self.optimizer_precision.check(optimizer)

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, plan: PrecisionPlan) -> torch.optim.Optimizer:
        """Optimizer-state precision (parts/optimizer.py)."""
        return self.optimizer_precision.wrap(optimizer, plan)

    @property
    def opt_level(self) -> str | None:
        """The memory level in force (a backend may have a default when the recipe names none)."""
        return self.storage["opt_level"]

    @property
    def optimizer_states(self) -> str | None:
        """The optimizer-state storage in force ('fp8', 'e4m3+e4m3', ...), or None: the optimizer's own."""
        return self.optimizer_precision.states

    def optimizer_state_precision(self, param_dtype: str) -> TensorPrecision:
        return self.optimizer_precision.row(param_dtype)

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
        return self.weight_storage.gradients_outside_grad()

    def engine_config_problem(self, config: dict) -> str | None:
        """Why this backend cannot run under the engine's configuration (a DeepSpeed config dict: its
        ZeRO stage, fp16), or None. `prepare()` raises it before the engine wraps anything."""
        return self.communication.engine_config_problem(config)

    def before_engine_prepare(self, objects: list, accelerator=None) -> None:
        """Adjust, in place, the objects about to be handed to Accelerate's `prepare()` (after
        conversion, before the engine wraps them) where this backend's tensors need it.
        `accelerator`: the lowprec Accelerator preparing them (its engine plugins)."""
        self.communication.before_engine_prepare(objects, accelerator)

    def after_engine_prepare(self) -> None:
        """Undo what `before_engine_prepare` changed outside the objects (an engine plugin's settings), once
        Accelerate's `prepare()` returned or raised."""
        self.communication.after_engine_prepare()

    def setup_communication(self, model: nn.Module, plan: PrecisionPlan) -> None:
        """Install gradient / weight communication hooks on the wrapped model (DDP hook etc.)."""

    def after_backward(self, sync_gradients: bool) -> None:
        """Called by `Accelerator.backward`; `sync_gradients` is False inside accumulation windows."""
        self.weight_storage.after_backward(sync_gradients)
        self.communication.after_backward(sync_gradients)

    def clip_grad_norm_(self, parameters, max_norm: float, norm_type: float = 2.0) -> torch.Tensor | None:
        """Clip gradients the backend keeps outside `.grad`; None leaves clipping to Accelerate."""
        return self.weight_storage.clip_grad_norm_(parameters, max_norm, norm_type)

    def forward_context(self, model: nn.Module) -> Callable[[], contextlib.AbstractContextManager] | None:
        """A factory for the context every forward must run in (TE autocast), or None."""
        return None

    def post_optimizer_step(self, model: nn.Module) -> Callable[[], None] | None:
        """A callable to run after each real optimizer step, or None."""
        return None

    def after_load_state(self, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer] = ()) -> None:
        """After `Accelerator.load_state` replaced the weights and `optimizers`' state: refresh what this backend
        derived from them."""

    def plain_checkpoint_entries(self, state_dict: dict, prefix: str) -> None:
        """Before `Accelerator.save_state` writes a whole state dict (torch.save, safetensors; not DCP's shards): make
        this backend's tensor types among the entries under `prefix` plain, in place, so the file loads without it."""

    def complete_optimizer_state(self, optimizer: torch.optim.Optimizer, loading: bool = False) -> None:
        """Before `Accelerator.save_state` / `load_state` (`loading`) make `optimizer`'s state dict: give each parameter
        the state its first step would where this backend left some without it (DCP's `get_optimizer_state_dict` makes
        it only for an optimizer holding none), and before a load mark what the load must replace (te's masters)."""

    def portable_state_dict(self, state_dict: dict) -> dict:
        """The state dict as the original (unconverted) model would have it."""
        return type(self).strip_state_dict(self.restore_weight_dtypes(state_dict))

    def convert_own_entries(self, own: dict, incoming: dict) -> tuple[dict, list[str]]:
        """A checkpoint's entries of this backend's own scaling state (`incoming`, keys as in `own`, this model's
        state dict) saved under other settings: (those converted to fit this model, why others cannot load).
        Nothing to convert or refuse here; msamp resizes its amax windows and refuses unusable scales."""
        return {}, []

    @classmethod
    def strip_state_dict(cls, state_dict: dict) -> dict:
        """`state_dict` without the entries only this backend's modules add, and with tensors of its own
        types made plain: what can be undone without knowing how the model was converted
        (`lowprec.portable_state_dict` applies every backend's to a model of unknown origin)."""
        return state_dict

    def restore_weight_dtypes(self, state_dict: dict) -> dict:
        """Weights stored in `weight_dtype` back in the dtype the model was built with."""
        return self.weight_storage.restore_weight_dtypes(state_dict)

    def effective_options(self) -> dict[str, object]:
        """The recipe options as this backend applies them (defaults filled in), for the plan."""
        r = self.recipe
        out: dict[str, object] = {"fp8_format": self.fp8_format}
        if self.info.delayed:
            out["margin"] = r.margin if r.margin is not None else 0
            out["amax_history_len"] = r.amax_history_len if r.amax_history_len is not None else 1024
            out["amax_compute_algo"] = r.amax_compute_algo or "max"
            if self.info.reduces_amax:
                out["reduce_amax"] = r.reduce_amax is not False  # None: on, as TE's and NeMo's default
        out["use_autocast_during_eval"] = (
            r.use_autocast_during_eval if r.use_autocast_during_eval is not None else self.eval_fp8_default
        )
        if self.supports_fp8_weights:
            out["fp8_weights"] = bool(r.fp8_weights)
        out["skip_first_last"] = r.skip_first_last
        out["skip_first_blocks"], out["skip_last_blocks"] = r.skip_first_blocks, r.skip_last_blocks
        out["skip_slow_shapes"] = r.skip_slow_shapes
        out["opt_level"] = self.opt_level
        out["optimizer_states"] = self.optimizer_states
        if self.pads_inner_dim:
            out["pad_inner_dim"] = bool(r.pad_inner_dim)
        out["activation_dtype"] = r.activation_dtype
        return out

    def model_state_bytes(self, plan: PrecisionPlan, param_dtype: torch.dtype) -> dict[str, float]:
        """Bytes per parameter (on one rank, where FSDP shards them) of weight, gradient, master and Adam states: the
        optimizer part's states, the engine's weights and masters (communication part), as the storage
        part changes them."""
        size = param_dtype.itemsize
        out = {"weight": size, "weight_grad": size, "master_weight": 0,
               "optimizer_states": self.optimizer_precision.state_bytes(param_dtype)}
        out.update(self.communication.state_bytes(param_dtype))
        return self.weight_storage.per_rank(self.weight_storage.adjust_bytes(out, plan, param_dtype))

    def notes(self, plan: PrecisionPlan) -> list[str]:
        """Extra lines for the printed plan."""
        return []

    def engine_rows(self, hp: str, *, fp8_gather: bool = False) -> list[TensorPrecision]:
        """The gradient-communication, weight and master-weight rows as the engine realises them."""
        return self.communication.engine_rows(hp, fp8_gather=fp8_gather)
