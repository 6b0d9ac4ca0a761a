"""`FP8RecipeKwargs`: what should be low precision, independent of the backend that does it."""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from accelerate.utils import KwargsHandler
from torch import nn

from . import named_recipes
from .env import read_fp8_env
from .parsing import parse_field
from .specs import TE_REMOVED_OPTIONS, auto_order, backend_spec, registered_specs

log = logging.getLogger(__name__)

ModuleFilter = Callable[[nn.Module, str], bool]


# What a field left as None (by the caller, the environment and a named recipe) becomes at construction.
_UNSET = {"backend": "auto", "exclude": (), "skip_first_last": False, "skip_slow_shapes": True,
          "skip_first_blocks": 0, "skip_last_blocks": 0}


def _check_filter(fn) -> None:
    if fn is not None and not _callable_as_filter(fn):
        raise ValueError(
            f"FP8RecipeKwargs.module_filter_fn={fn!r} must be callable as "
            "fn(module, fqn) -> bool (torchao's module_filter_fn: the module and its fully qualified name)"
        )


def _callable_as_filter(fn) -> bool:
    """Whether `fn` can be called with two positional arguments (a callable whose signature Python cannot read,
    some builtins, is taken on trust)."""
    if not callable(fn):
        return False
    try:
        inspect.signature(fn).bind(None, "")
    except TypeError:
        return False
    except ValueError:
        return True
    return True


@dataclass
class FP8RecipeKwargs(KwargsHandler):
    """What should be low precision, for any backend.

    Every field left as None is read from `ACCELERATE_FP8_<FIELD>` (what `accelerate launch` exports
    from a config file's `fp8_config:` section), then falls back to the backend's default; the
    resolved values are shown by the precision plan (`lowprec plan`; `prepare()` prints its summary).
    A field assigned later is parsed and checked with the others as at construction (a refused value leaves
    the field as it was); None there means the default, not the environment.

    Args:
        backend: "auto" (best available here), "te", "msamp" or "torchao" ("ao" accepted).
        recipe: the backend's scaling recipe, e.g. torchao "tensorwise" / "rowwise" /
            "rowwise_with_gw_hp". None: the backend's default.
        fp8_format: "HYBRID" (E4M3 forward, E5M2 gradients) or "E4M3" (everywhere).
        margin: delayed scaling only: scale = 2**-margin * fp8_max / amax. With backend "auto" it asks for
            delayed scaling: te's, or where te cannot run it (not installed, a compiled model) msamp's, which
            comes with msamp's level O2 (FP16 weights, low-bit Adam states); the plan's backend line says so.
        amax_history_len: delayed scaling only: steps of amax history kept.
        amax_compute_algo: delayed scaling only: "max" over the history, or "most_recent".
        opt_level: MS-AMP memory level "O1", "O2", "O3", or None (FP32 states and gradients): a
            preset of weight, weight-gradient, communication and optimizer-state precision, accepted
            only by a backend that honours the whole row: msamp (O1, O2, O3), te and torchao (O1, O2, through
            the storage knobs on their layers).
        optimizer_states: storage of Adam's moments, for any backend: "fp32", "bf16", "fp16", "fp8"
            (MS-AMP's E4M3 exp_avg + FP16 exp_avg_sq, 3 bytes/param instead of 8), or a pair such as
            ("e4m3", "e4m3"). Adam/AdamW passed to prepare() becomes lowprec.optim.LowBitAdam(W); with te's
            fp8_weights, these are TE FusedAdam's moments instead (no "e5m2"; not both "bf16" with recipe "delayed").
            None: the level's states, else the optimizer's own (the parameters' dtype).
        include: fnmatch patterns of module names to convert; None converts every candidate.
        exclude: fnmatch patterns of module names to keep in high precision.
        skip_first_last: keep the first and last Linear layers (registration order), usually the output
            head, in high precision. Off by default: on the H100 the head in FP8 is 7-13% of the step and
            moved held-out loss by 0.06% of BF16's (docs/performance.md); True trades that speed for caution.
        skip_first_blocks: keep the first N transformer blocks whole in high precision, every candidate
            module inside them (Megatron-Bridge's num_layers_at_start_in_bf16). The blocks are the model's
            nn.ModuleList of two or more modules of one class holding the most parameters (`model.layers`
            of a transformers decoder); the plan names it. A model without such a list is an error at
            prepare() / `lowprec plan`. None: 0.
        skip_last_blocks: the same for the last N blocks (num_layers_at_end_in_bf16). skip_first_blocks +
            skip_last_blocks may not exceed the number of blocks. None: 0.
        skip_slow_shapes: keep in high precision the Linear layers whose shape FP8 would make slower
            (thresholds measured on H100); each skip is reported in the plan.
        module_filter_fn: `fn(module, fqn) -> bool`, False keeps a module in high precision
            (torchao's convention). Not settable from the environment.
        pad_inner_dim: torchao: zero-pad GEMM inner dimensions to multiples of 16 instead of
            skipping modules that do not fit (costs a copy per GEMM).
        enable_fsdp_float8_all_gather: all-gather weights in FP8 under FSDP2 (recipes that support
            it). None: on wherever it applies.
        use_autocast_during_eval: run FP8 in eval mode too. None: the backend's default.
        fp8_weights: te only: keep converted Linear weights in FP8 only (TE's quantized_model_init),
            with FP32 master weights in TE's FusedAdam, which replaces Adam/AdamW.
        weight_dtype: storage of converted Linear weights, "fp32", "fp16" or "bf16", updated in place
            with no FP32 master copy (Adam/AdamW becomes LowBitAdam(W), whose update math is FP32).
            None: the level's ("fp16" for O1/O2), else the model's own (msamp: "fp16").
        weight_grad_dtype: storage of converted Linear weight gradients, "fp32", "bf16" or "fp8"
            (E4M3, per-tensor scale), kept outside `.grad` from the moment autograd produces them
            (msamp: always "fp8"). None: the level's ("fp8" for O1/O2), else the weight's dtype.
        grad_comm_dtype: precision DDP averages the `.grad` gradients in: "fp32", "bf16" or "fp8"
            (E4M3, one scale per 1024-element block shared by all ranks; inf/NaN arrive as NaN; on one
            host measured slower than "bf16", docs/communication.md).
            None: the gradients' dtype. Gradients kept outside `.grad` (FP8 weight gradients of the
            levels) are always averaged in FP8. FSDP2 and DeepSpeed set theirs in their own config.
        emulate: True forces emulation (FP8 numerics, high-precision matmuls); False forbids it
            (error without FP8 hardware); None emulates only where there is no FP8 hardware.
        name: a named recipe (`lowprec recipes` lists them; Megatron-Bridge's names such as
            "bf16_with_fp8_current_scaling_mixed" among them): it sets the fields it names, and every field
            the caller or the environment sets wins over it. `FP8RecipeKwargs.from_name(name, **fields)`.
        compile_fp8_layers: compile each converted layer with torch.compile when the model itself is
            not compiled, so its casts, amaxes and transposes fuse instead of running as separate eager
            kernels. None: on where measured to pay, on an FP8 GPU (not emulated): torchao and msamp under
            one process, DDP, FSDP2 or DeepSpeed, but not msamp O3 under FSDP2 (eager measured faster); True:
            also elsewhere (te: ValueError, its layers are not
            compiled one by one); False: never. See docs/performance.md.
        activation_dtype: "fp8" stores the tensors autograd saves in the model's forward (norm, activation
            function and attention inputs, residuals) in E4M3 with a power-of-2 scale per 128 values along the
            last dimension, decoded for backward (COAT / DeepSeek-V3 style); parameters and tensors under 2**14
            elements are kept as they are. Eager or compiled (not under CUDA graphs). A Hugging Face causal
            LM's default loss is computed without FP32 copies of the logits (the same loss and gradient;
            lowprec.kernels.cross_entropy). None ("none", "off"): stored as autograd saves them.
        reduce_amax: delayed scaling only (te "delayed", msamp "delayed"): all-reduce (MAX) each step's
            amaxes across the data-parallel ranks before the scales are updated, so every rank scales with
            the same delayed scales (NeMo's and TE's `reduce_amax`). None: on. False: each rank keeps scales
            from its own amaxes (weights stay identical; the FP8 casts differ between ranks). Refused with
            current-scaling recipes, which have no amax history to reduce.
        optimizer_in_backward: True runs each parameter's optimizer step in backward, as soon as its gradient is
            accumulated, and frees that gradient there, so the gradients never all exist at once (the peak of
            torchao and te with FP32 moments; the arithmetic is the optimizer's own). One process only; no
            gradient clipping; not with gradients kept outside `.grad` (msamp, weight_grad_dtype, opt_level) or
            te's fp8_weights. None: off.
    """

    backend: str | None = None
    recipe: str | None = None
    fp8_format: str | None = None
    margin: int | None = None
    amax_history_len: int | None = None
    amax_compute_algo: str | None = None
    opt_level: str | None = None
    include: Sequence[str] | None = None
    exclude: Sequence[str] | None = None
    skip_first_last: bool | None = None
    skip_slow_shapes: bool | None = None
    module_filter_fn: ModuleFilter | None = None
    pad_inner_dim: bool | None = None
    enable_fsdp_float8_all_gather: bool | None = None
    use_autocast_during_eval: bool | None = None
    fp8_weights: bool | None = None
    weight_dtype: str | None = None
    emulate: bool | None = None
    optimizer_states: str | tuple[str, str] | None = None
    weight_grad_dtype: str | None = None
    grad_comm_dtype: str | None = None
    compile_fp8_layers: bool | None = None
    skip_first_blocks: int | None = None
    skip_last_blocks: int | None = None
    name: str | None = None
    activation_dtype: str | None = None
    reduce_amax: bool | None = None
    optimizer_in_backward: bool | None = None

    def __post_init__(self):
        env = read_fp8_env()
        for name, raw in env.values.items():
            if getattr(self, name) is None:
                try:
                    setattr(self, name, self._parse(name, raw))
                except ValueError as exc:
                    raise ValueError(f"{exc} (read from environment variable {env.sources[name]})") from None
        if self.name is not None:
            self._apply_named_recipe(env.sources.get("name"))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                setattr(self, f.name, self._parse(f.name, value))
        for name, default in _UNSET.items():
            if getattr(self, name) is None:
                setattr(self, name, default)
        _check_filter(self.module_filter_fn)
        # Set aside, not forgotten: unapplied_launcher_defaults() lists, in the plan's notes, those that matter.
        self._launcher_defaults = {n: v for n, v in env.launcher_defaults.items() if getattr(self, n) is None}
        try:
            self._check_backend()
        except ValueError as exc:
            # Name where a rejected value came from: the user may never have written it in code.
            sources = [f"{env.sources[n]}" for n in env.sources if f"FP8RecipeKwargs.{n}=" in str(exc)]
            named = [n for n in getattr(self, "_named_fields", ()) if f"FP8RecipeKwargs.{n}=" in str(exc)
                     or (n == "recipe" and f"recipe={self.recipe!r}" in str(exc))]
            where = ([f"read from environment variable {', '.join(sources)}"] if sources else []) + (
                [f"{', '.join(named)} set by named recipe {self.name!r}"] if named else [])
            if where:
                raise ValueError(f"{exc} ({'; '.join(where)})") from None
            raise
        self._validated = True  # from here on, __setattr__ checks each field as construction did

    def __setattr__(self, name: str, value: Any) -> None:
        # A field assigned after construction would otherwise reach the backend unchecked (a margin of 200 gave
        # scales of 0 and NaN outputs), so it is parsed and checked with the others, and refused where it is written.
        if name not in _FIELDS or not self.__dict__.get("_validated"):
            if self.__dict__.get("_validated") and not name.startswith("_"):
                # a misspelt field would otherwise become an attribute nothing reads, and the run keep the old value
                close = difflib.get_close_matches(name, sorted(_FIELDS), n=1)
                raise AttributeError(f"FP8RecipeKwargs has no field {name!r}"
                                     + (f"; did you mean {close[0]!r}?" if close else "")
                                     + f" (fields: {', '.join(sorted(_FIELDS))})")
            object.__setattr__(self, name, value)
            return
        if name == "name" and value != self.name:
            raise ValueError(
                f"FP8RecipeKwargs.name={value!r} cannot be assigned: a named recipe fills the fields when the recipe "
                f"is built; build it afresh: FP8RecipeKwargs.from_name({value!r}, **fields)")
        value = _UNSET.get(name) if value is None else self._parse(name, value)
        if name == "module_filter_fn":
            _check_filter(value)
        old = self.__dict__[name]
        object.__setattr__(self, name, value)
        try:
            self._check_backend()
        except ValueError as exc:
            object.__setattr__(self, name, old)
            raise ValueError(f"{exc} (assigning FP8RecipeKwargs.{name}; to change fields that only fit together, "
                             "use .replace(...) with all of them)") from None

    def _apply_named_recipe(self, source: str | None) -> None:
        """Fill the fields still unset (by the caller and the environment) from the named recipe."""
        where = f" (read from environment variable {source})" if source else ""
        if not isinstance(self.name, str):
            raise ValueError(f"FP8RecipeKwargs.name={self.name!r} must be a recipe name (a string){where}")
        try:
            named = named_recipes.lookup(self.name)
        except ValueError as exc:
            raise ValueError(f"{exc}{where}") from None
        self.name = named.name
        self._named_fields = []  # the fields the name filled, for errors about them
        fields = {f.name for f in dataclasses.fields(self)} - {"name"}
        for field, value in named.fields().items():
            if field not in fields:
                raise ValueError(f"named recipe {named.name!r} sets {field!r}, which is not a field of FP8RecipeKwargs")
            if getattr(self, field) is None:
                try:
                    setattr(self, field, self._parse(field, value))
                except ValueError as exc:
                    raise ValueError(f"{exc} (set by named recipe {named.name!r})") from None
                self._named_fields.append(field)

    @classmethod
    def from_name(cls, name: str, **fields: Any) -> FP8RecipeKwargs:
        """The named recipe `name` (`lowprec recipes` lists them), with `fields` set over it."""
        return cls(name=name, **fields)

    @property
    def __class__(self):
        # accelerate.Accelerator maps kwargs_handlers by exact class and fails deep in its __init__ with
        # KeyError(<class FP8RecipeKwargs>) on this one: the most common mistake. It offers no hook to refuse
        # a handler (its isinstance check passes, nothing on the handler is called), and reading the class is
        # the first thing it does with it; lowprec.Accelerator takes the handler out before that code runs.
        caller = sys._getframe(1)
        if caller.f_code.co_name == "__init__" and caller.f_globals.get("__name__") == "accelerate.accelerator":
            raise TypeError(
                "lowprec.FP8RecipeKwargs works with lowprec.Accelerator: `from lowprec import Accelerator`. "
                "accelerate.Accelerator maps kwargs_handlers by exact class and does not know it (its own FP8 "
                "handlers, AORecipeKwargs / TERecipeKwargs / MSAMPRecipeKwargs, are also accepted by lowprec's)"
            )
        return type(self)

    @staticmethod
    def _parse(name: str, value: Any) -> Any:
        return parse_field(name, value)

    def _check_backend(self) -> None:
        if self.backend == "auto":
            if self.recipe is not None:
                offering = [spec.name for spec in registered_specs() if spec.offers_recipe(self.recipe)]
                if not offering:
                    known = sorted({f"{spec.name}:{r}" for spec in registered_specs() for r in spec.recipes})
                    raise ValueError(
                        f"FP8RecipeKwargs.recipe={self.recipe!r} is not a recipe of any backend; "
                        f"known: {', '.join(known)}"
                    )
            self._check_auto()
            return
        backend_spec(self.backend).check_recipe(self)

    def _check_auto(self) -> None:
        """Refuse what no backend auto may choose can honour, from the specs alone (no package is imported);
        which one can run here is settled at prepare(). A backend that offers no recipe named is not asked."""
        names = dict.fromkeys(auto_order(False) + auto_order(True))
        specs = [backend_spec(n) for n in names if self.recipe is None or backend_spec(n).offers_recipe(self.recipe)]
        refusals: dict[str, list[str]] = {}  # reason -> the backends giving it
        for spec in specs:
            try:
                spec.check_recipe(self)
                return
            except ValueError as exc:
                refusals.setdefault(str(exc), []).append(spec.name)
        if refusals:
            raise ValueError("FP8RecipeKwargs(backend='auto'): no backend can honour these options together; "
                             + "; ".join(f"{', '.join(names)}: {why}" for why, names in refusals.items()))

    def replace(self, **changes: Any) -> FP8RecipeKwargs:
        """A copy with `changes` applied and validated again."""
        new_name = changes.get("name", self.name)
        if self.name is not None and new_name != self.name:
            # the fields the first name filled look like the caller's own: the new name would fill none of them
            raise ValueError(
                f"FP8RecipeKwargs.replace(name={new_name!r}) on a recipe built from named recipe {self.name!r} would "
                f"keep that recipe's fields under the new name; build it afresh: "
                f"FP8RecipeKwargs.from_name({new_name!r}, **fields)")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        # module_filter_fn may be a lambda: keep it by reference rather than deep-copying it
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return out

    def describe(self) -> str:
        """The fields set away from their defaults, e.g. "backend='torchao', recipe='rowwise'"."""
        return ", ".join(
            f"{f.name}={getattr(self, f.name)!r}"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != _UNSET.get(f.name)
        )


def unapplied_launcher_defaults(recipe: FP8RecipeKwargs, in_force: dict[str, Any]) -> list[str]:
    """The values `accelerate launch` exported that lowprec set aside and that would change the run, one
    "VAR=value (in force: ...)" each; `in_force` is the backend's `effective_options()`.

    The launcher exports its own defaults whether or not the config file names them, and a config file's
    value reaches the script as the same string (`opt_level: O2` and the launcher's own `O2` are both
    `ACCELERATE_FP8_OPT_LEVEL=O2`), so a value equal to the launcher's default may be the user's or not: it
    is neither applied nor warned about (every `accelerate launch --mixed_precision fp8` run exports them).
    The plan's notes list these for whoever wonders why a value in fp8_config had no effect. A value other
    than the launcher's default can only have been written by the user, and is applied (lowprec.frontend.env).
    """
    differing = []
    for name, (var, raw) in getattr(recipe, "_launcher_defaults", {}).items():
        if name not in in_force:
            continue  # the option does not apply to this backend and recipe
        try:
            value = FP8RecipeKwargs._parse(name, raw)
        except ValueError:
            value = raw
        if value != in_force[name]:
            differing.append(f"{var}={raw} (in force: {in_force[name]!r})")
    return differing


_FIELDS = frozenset(f.name for f in dataclasses.fields(FP8RecipeKwargs))
_REMOVED = TE_REMOVED_OPTIONS
_dataclass_init = FP8RecipeKwargs.__init__


def _init_rejecting_removed_options(self, *args, **kwargs):
    for option, why in _REMOVED.items():
        if option in kwargs:
            raise ValueError(f"FP8RecipeKwargs.{option}={kwargs[option]!r} cannot be honoured: {why}")
    _dataclass_init(self, *args, **kwargs)


_init_rejecting_removed_options.__signature__ = __import__("inspect").signature(_dataclass_init)
_init_rejecting_removed_options.__doc__ = _dataclass_init.__doc__
FP8RecipeKwargs.__init__ = _init_rejecting_removed_options
