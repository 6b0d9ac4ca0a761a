"""What each backend offers, as data: names, recipes, and the knob values it honours.

The front end (`FP8RecipeKwargs`, the environment and config readers) validates a recipe against
these declarations without importing any adapter, so the import order runs one way: specs and the
front end at the bottom, the precision plan above them, the adapters in `lowprec.backends` above
that, and the Accelerator on top. An adapter class names its spec (`Backend.spec`) and takes its
class attributes from it, so each fact is written once, here.

The built-in backends' declarations are in `builtin_specs`, which the package registers on import.
Adding a backend: declare its `BackendSpec` there (or call `register_backend` from a plug-in) and
write the adapter class its `adapter` names.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol


class RecipeOptions(Protocol):
    """The options of a recipe that a spec reads: `lowprec.FP8RecipeKwargs` has them all. A protocol, not the
    class itself, so that specs names nothing from recipe.py, which imports specs (issue 28: no import circle,
    not even one of type names)."""

    recipe: str | None
    fp8_format: str | None
    margin: int | None
    amax_history_len: int | None
    amax_compute_algo: str | None
    reduce_amax: bool | None
    opt_level: str | None
    use_autocast_during_eval: bool | None
    pad_inner_dim: bool | None
    enable_fsdp_float8_all_gather: bool | None
    compile_fp8_layers: bool | None
    fp8_weights: bool | None
    emulate: bool | None
    optimizer_in_backward: bool | None
    # the storage knobs, also read by name (storage, written)
    weight_dtype: str | None
    weight_grad_dtype: str | None
    optimizer_states: str | tuple[str, str] | None

# Options TransformerEngine has removed; Accelerate's TERecipeKwargs and its launcher still carry them.
# The recipe, the environment reader and the handler translation all refuse them with these reasons.
TE_REMOVED_OPTIONS: Mapping[str, str] = {
    "interval": "TransformerEngine removed `interval` in v2.3: amax is updated every step",
    "override_linear_precision": "TransformerEngine removed `override_linear_precision` in v2.0: keep sensitive "
                                 "layers in high precision with exclude=[...] instead",
}


@dataclass(frozen=True)
class RecipeInfo:
    """A scaling recipe a backend offers."""

    name: str
    summary: str
    formats: tuple[str, ...]  # accepted `fp8_format` values; the first is the default
    delayed: bool = False  # scales come from an amax history (margin / history / algo apply)
    min_capability: tuple[int, int] = (8, 9)
    max_capability: tuple[int, int] | None = None  # exclusive upper bound, if any
    fsdp_fp8_all_gather: bool = False  # weights can be all-gathered in FP8 under FSDP2
    # Other tools' names for this recipe (TE's and Megatron's `fp8_recipe` values), accepted as `recipe=`
    # and shown in the plan with the name they map to.
    aliases: tuple[str, ...] = ()
    # A delayed recipe whose adapter all-reduces the amaxes across data-parallel ranks, or not, as
    # `reduce_amax` says (both values honoured; on by default). A delayed recipe without it is refused any
    # explicit `reduce_amax`: what its ranks do with their amaxes is not lowprec's to promise.
    reduces_amax: bool = False

    def __post_init__(self):
        if self.reduces_amax and not self.delayed:
            raise ValueError(f"RecipeInfo {self.name!r}: reduces_amax=True needs delayed=True (only an amax "
                             "history has amaxes to reduce across ranks)")


@dataclass(frozen=True)
class BackendSpec:
    """One backend's declaration: what it is called, what it offers, which options it honours."""

    name: str
    display_name: str
    adapter: str  # "module:Class" of the adapter, imported only when the backend is used
    recipes: Mapping[str, RecipeInfo]
    default_recipe: str
    aliases: tuple[str, ...] = ()
    package: str | None = None  # key of utils.imports.OPTIONAL_PACKAGES
    supports_emulation: bool = False
    opt_levels: tuple[str | None, ...] = (None,)
    # Value of `use_autocast_during_eval` when the user leaves it unset, and whether the other
    # value can be honoured at all.
    eval_fp8_default: bool = True
    eval_fp8_configurable: bool = False
    pads_inner_dim: bool = False
    supports_fp8_weights: bool = False
    weight_dtypes: tuple[str, ...] = ()  # storage choices for converted weights
    weight_grad_dtypes: tuple[str, ...] = ()  # ... and for their gradients
    default_opt_level: str | None = None  # the level in force when the recipe names none
    # compile_fp8_layers: None (not compilable one by one), or whether it is on by default in an eager
    # model on an FP8 GPU (measured: results/gpu/2026-11-23-h100-eager-layers)
    compiles_layers: bool | None = None

    def __post_init__(self):
        if self.default_recipe not in self.recipes:
            raise ValueError(f"BackendSpec {self.name!r}: default_recipe {self.default_recipe!r} is not in its recipes")

    def _recipe_named(self, written: str) -> str | None:
        key = written.strip().lower()
        return next((name for name, info in self.recipes.items() if key == name or key in info.aliases), None)

    def recipe_name(self, written: str | None) -> str:
        """The recipe `written` names (its own name or an alias, any case); None: the default. Raises
        ValueError listing the recipes and their aliases."""
        if written is None:
            return self.default_recipe
        name = self._recipe_named(written)
        if name is None:
            offers = [f"{n!r}" + (f" (also {', '.join(repr(a) for a in i.aliases)})" if i.aliases else "")
                      for n, i in self.recipes.items()]
            raise ValueError(f"FP8RecipeKwargs.recipe={written!r} is not a recipe of backend {self.name!r}; "
                             f"it offers {', '.join(offers)}")
        return name

    def offers_recipe(self, written: str) -> bool:
        return self._recipe_named(written) is not None

    def recipe_info(self, recipe: RecipeOptions) -> RecipeInfo:
        return self.recipes[self.recipe_name(recipe.recipe)]

    def storage(self, recipe: RecipeOptions) -> dict[str, str | None]:
        """The storage knobs in force: each explicit field, else its level's value, else None (the
        model's and optimizer's own). Keys: opt_level, weight_dtype, weight_grad_dtype, optimizer_states."""
        from ..optim.levels import LEVEL_ROWS

        level = recipe.opt_level or self.default_opt_level
        row = LEVEL_ROWS.get(level, {}) if level else {}
        out: dict[str, str | None] = {"opt_level": level}
        for knob in ("weight_dtype", "weight_grad_dtype", "optimizer_states"):
            value = getattr(recipe, knob)
            out[knob] = value if value is not None else row.get(knob)
        return out

    def written(self, recipe: RecipeOptions, knob: str) -> str:
        """`knob=value` for a message: as the user wrote it, or with the level it comes from, e.g.
        "weight_dtype='fp16' (from opt_level='O2')"; a rejection must not show a value nobody wrote."""
        if getattr(recipe, knob) is not None:
            return f"{knob}={getattr(recipe, knob)!r}"
        storage = self.storage(recipe)
        level = f"opt_level={storage['opt_level']!r}"
        if recipe.opt_level is None:
            level = f"{level}, backend {self.name!r}'s default"
        return f"{knob}={storage[knob]!r} (from {level})"

    def check_recipe(self, recipe: RecipeOptions) -> None:
        """Raise ValueError for a combination of options this backend cannot honour."""
        field = "FP8RecipeKwargs"
        name = self.recipe_name(recipe.recipe)
        info = self.recipes[name]
        if recipe.fp8_format is not None and recipe.fp8_format not in info.formats:
            raise ValueError(
                f"{field}.fp8_format={recipe.fp8_format!r} cannot be used with {self.name} recipe {name!r}, "
                f"which supports {', '.join(repr(f) for f in info.formats)}"
            )
        if not info.delayed:
            # reduce_amax has no no-op value here: False (ranks keep their own amaxes) is as meaningless as
            # True when there is no amax history, and either written down is a misunderstanding to report.
            for option, value, noop in (
                ("margin", recipe.margin, 0),
                ("amax_history_len", recipe.amax_history_len, None),
                ("amax_compute_algo", recipe.amax_compute_algo, None),
                ("reduce_amax", recipe.reduce_amax, None),
            ):
                if value is not None and value != noop:
                    delayed = [f"{b}:{r}" for b, r in _delayed_recipes()]
                    raise ValueError(
                        f"{field}.{option}={value!r} applies to delayed (amax-history) scaling, but {self.name} "
                        f"recipe {name!r} scales from the current tensor. Delayed-scaling recipes: "
                        f"{', '.join(delayed) or 'none in this version'}"
                    )
        elif recipe.reduce_amax is not None and not info.reduces_amax:
            offering = [f"{s.name}:{r.name}" for s in _SPECS.values() for r in s.recipes.values() if r.reduces_amax]
            raise ValueError(
                f"{field}.reduce_amax={recipe.reduce_amax!r} cannot be honoured by {self.name} recipe {name!r}: it "
                f"does not offer the choice of all-reducing its amaxes across ranks; leave reduce_amax unset, or use "
                f"a recipe that does: {', '.join(offering) or 'none in this version'}"
            )
        if recipe.opt_level not in self.opt_levels:
            levels = [lvl for lvl in self.opt_levels if lvl is not None]
            raise ValueError(
                f"{field}.opt_level={recipe.opt_level!r} is not available with backend {self.name!r} in this "
                f"version of lowprec (it supports {', '.join(repr(lv) for lv in levels) or 'no MS-AMP level'}). "
                "A level fixes a whole row (weight, weight-gradient, gradient-communication and optimizer-state "
                "precision) and is accepted only where every part is honoured; its parts are also knobs of their "
                "own: weight_dtype, weight_grad_dtype, optimizer_states"
                + ("; O3 (FP8 weights, FP16 masters and O2 states sharded across ranks) is backend='msamp' under "
                   "FSDP2" if recipe.opt_level == "O3" else "")
            )
        if recipe.use_autocast_during_eval is not None and not self.eval_fp8_configurable:
            if recipe.use_autocast_during_eval != self.eval_fp8_default:
                raise ValueError(
                    f"{field}.use_autocast_during_eval={recipe.use_autocast_during_eval} cannot be honoured by "
                    f"backend {self.name!r}: its FP8 modules always run in "
                    f"{'FP8' if self.eval_fp8_default else 'high precision'} during eval"
                )
        if recipe.pad_inner_dim and not self.pads_inner_dim:
            raise ValueError(
                f"{field}.pad_inner_dim=True cannot be honoured by backend {self.name!r}; modules whose "
                "dimensions do not fit its FP8 GEMMs are kept in high precision instead (see the plan)"
            )
        if recipe.enable_fsdp_float8_all_gather and not info.fsdp_fp8_all_gather:
            raise ValueError(
                f"{field}.enable_fsdp_float8_all_gather=True cannot be honoured by {self.name} recipe {name!r}: "
                "its weights are all-gathered in high precision"
            )
        if recipe.compile_fp8_layers and self.compiles_layers is None:
            raise ValueError(
                f"{field}.compile_fp8_layers=True cannot be honoured by backend {self.name!r}: its layers run "
                "fused kernels of their own and are not compiled one by one (backends that are: "
                f"{', '.join(s.name for s in registered_specs() if s.compiles_layers is not None)})"
            )
        if recipe.fp8_weights and not self.supports_fp8_weights:
            raise ValueError(
                f"{field}.fp8_weights=True cannot be honoured by backend {self.name!r}: it keeps weights in high "
                "precision (backend='te' offers FP8-only weights)"
            )
        storage = self.storage(recipe)
        for knob, accepted in (("weight_dtype", self.weight_dtypes), ("weight_grad_dtype", self.weight_grad_dtypes)):
            value = storage[knob]
            if value is not None and value not in accepted:
                raise ValueError(
                    f"{field}.{self.written(recipe, knob)} cannot be honoured by backend {self.name!r}: "
                    f"it accepts {', '.join(map(repr, accepted))}"
                )
        weight, grad = storage["weight_dtype"], storage["weight_grad_dtype"]
        if recipe.optimizer_in_backward and (grad is not None or recipe.fp8_weights):
            # the steps read .grad as autograd fills it: stores outside it, or TE's FusedAdam masters, are not there
            kept = ("fp8_weights=True (TE's FusedAdam)" if recipe.fp8_weights
                    else self.written(recipe, "weight_grad_dtype"))
            raise ValueError(f"{field}.optimizer_in_backward=True cannot be honoured with {kept}: each step reads the "
                             "parameter's .grad as autograd accumulates it, and these weight gradients are kept "
                             "elsewhere; leave optimizer_in_backward unset, or train with gradients in .grad (torchao, "
                             "te without opt_level or fp8_weights)")
        if grad == "fp32" and weight not in (None, "fp32"):
            raise ValueError(
                f"{field}.{self.written(recipe, 'weight_grad_dtype')} cannot be kept with "
                f"{self.written(recipe, 'weight_dtype')}: {weight} weights have no FP32 master copy to hold it; "
                "use weight_dtype='fp32', or weight_grad_dtype 'bf16' / 'fp8'"
            )
        if recipe.fp8_weights and recipe.opt_level is not None:
            raise ValueError(
                f"{field}.fp8_weights=True and opt_level={recipe.opt_level!r} both choose the weights and the "
                "optimizer (TE FusedAdam with FP32 masters vs MS-AMP's FP16 weights and lowprec's low-bit Adam); set "
                "one of them (optimizer_states sets the moments FusedAdam keeps with fp8_weights)"
            )
        if recipe.fp8_weights and recipe.optimizer_states is not None:
            from ..optim.levels import FUSED_ADAM_STATE_DTYPES, SHORT_NAMES, fused_adam_moments_problem, state_pair

            unsupported = [SHORT_NAMES[d] for d in state_pair(recipe.optimizer_states)
                           if d not in FUSED_ADAM_STATE_DTYPES]
            if unsupported:
                raise ValueError(
                    f"{field}.optimizer_states={recipe.optimizer_states!r} with fp8_weights=True: TE's FusedAdam keeps "
                    f"Adam's moments in {', '.join(repr(SHORT_NAMES[d]) for d in FUSED_ADAM_STATE_DTYPES)} (e4m3: its "
                    f"uint8 FP8), not {' / '.join(map(repr, sorted(set(unsupported))))}; use 'fp32', 'bf16', 'fp16', "
                    "'fp8' (e4m3+fp16) or a pair of those"
                )
            if (problem := fused_adam_moments_problem(recipe.recipe, recipe.optimizer_states)) is not None:
                raise ValueError(problem)  # recipe='delayed' named; unset, the adapter checks the one it picks
        if recipe.fp8_weights and (weight is not None or grad is not None):
            chosen = " and ".join(self.written(recipe, k) for k, v in (("weight_dtype", weight),
                                                                         ("weight_grad_dtype", grad)) if v is not None)
            raise ValueError(
                f"{field}.fp8_weights=True keeps TE's FP8 weights with FP32 masters; it cannot be combined with "
                f"{chosen}; set one of them"
            )
        if recipe.emulate and not self.supports_emulation:
            raise ValueError(f"{field}.emulate=True cannot be honoured: backend {self.name!r} has no emulation mode")


_SPECS: dict[str, BackendSpec] = {}
_ALIASES: dict[str, str] = {}
# "auto" tries these in order; the first that is available, supports the recipe and can run on the
# device wins. Eager models: TE first, its fused kernels need no compiler (H100, lowprec's defaults: TE
# 1.25/1.39/1.51x eager BF16 at d2048/d4096/d8192, torchao with its layers compiled BF16/1.20/1.37x).
# Compiled models: torchao first (1.12/1.30/1.41x compiled BF16; TE 0.51-0.64/1.14/1.39x, a graph break
# around each TE module): results/gpu/2026-11-23-h100-speed-head and 2026-11-24-h100-te-widths. msamp last:
# its level O2 changes weight and optimizer-state precision, so auto takes it only for what the others cannot
# run here: delayed scaling and its options (margin, ...) without TE or under compile, level O3 (docs/performance.md).
AUTO_ORDER = ("te", "torchao", "msamp")
AUTO_ORDER_COMPILED = ("torchao", "te", "msamp")

# The orders in force: the built-in ones, less backends unregistered since, plus plug-ins registered with
# `auto=position`.
_AUTO: dict[bool, list[str]] = {False: list(AUTO_ORDER), True: list(AUTO_ORDER_COMPILED)}


def auto_order(compiled: bool) -> tuple[str, ...]:
    """The order `backend="auto"` tries backends in, for an eager or a compiled model."""
    return tuple(_AUTO[compiled])


def _auto_positions(spec: BackendSpec, auto: int | tuple[int, int] | None) -> dict[bool, int] | None:
    """{compiled: position} from `register_backend`'s `auto`; raises ValueError naming what it accepts."""
    if auto is None:
        return None
    pair = auto if isinstance(auto, tuple) and len(auto) == 2 else (auto, auto)
    positions = dict(zip((False, True), pair))
    if not all(isinstance(p, int) and not isinstance(p, bool) and 0 <= p <= len(_AUTO[c])
               for c, p in positions.items()):
        raise ValueError(
            f"register_backend(BackendSpec(name={spec.name!r}), auto={auto!r}): auto must be None (backend='auto' "
            f"never chooses it), the position at which backend='auto' tries it, or (eager, compiled) positions; "
            f"0 to {len(_AUTO[False])} in the eager order ({', '.join(_AUTO[False])}), 0 to {len(_AUTO[True])} in "
            f"the compiled one ({', '.join(_AUTO[True])})"
        )
    return positions


def register_backend(spec: BackendSpec, *, replace: bool = False, auto: int | tuple[int, int] | None = None) -> None:
    """Make `spec` known under its name and (case-insensitive) aliases.

    A name or alias another backend already answers to is refused unless `replace=True` (which takes the
    old backend's name and aliases out first): registering a plug-in must not silently swap a backend
    every recipe naming it would then get. `spec.adapter` must read "module:Class".

    `auto`: where `backend="auto"` tries this backend: a position (0 = first) in both its orders, or a pair
    (eager models, compiled models); None: auto never chooses it, and a backend replaced in place keeps its
    positions.
    auto weighs speed and memory choices users did not ask for, so put a backend there where measurements
    put it."""
    names = [spec.name.lower(), *(a.lower() for a in spec.aliases)]
    if "auto" in names:
        raise ValueError(f"register_backend: 'auto' is FP8RecipeKwargs' own choice; backend {spec.name!r} cannot "
                         "be named or aliased 'auto'")
    module, _, cls = spec.adapter.partition(":")
    if not module or not cls:
        raise ValueError(f"register_backend: BackendSpec(name={spec.name!r}).adapter={spec.adapter!r} must read "
                         "'package.module:ClassName'")
    positions = _auto_positions(spec, auto)
    taken = {n: _ALIASES[n] for n in names if n in _ALIASES}
    if taken and not replace:
        raise ValueError(
            f"register_backend: {', '.join(f'{n!r} is backend {b!r}' for n, b in taken.items())}; pass "
            "replace=True to replace it, or choose another name"
        )
    for old in set(taken.values()):
        if old == spec.name:  # replaced in place: the registry's order (and auto's positions) stay
            for alias in [a for a, n in _ALIASES.items() if n == old]:
                del _ALIASES[alias]
        else:
            unregister_backend(old)
    _SPECS[spec.name] = spec
    for alias in names:
        _ALIASES[alias] = spec.name
    for compiled, position in (positions or {}).items():
        order = _AUTO[compiled]
        if spec.name in order:
            order.remove(spec.name)
        order.insert(position, spec.name)


def unregister_backend(name: str) -> BackendSpec:
    """Forget backend `name` (or an alias of it), all its aliases and its places in auto's orders; returns
    its spec."""
    spec = _SPECS.pop(canonical_name(name))
    for alias in [a for a, n in _ALIASES.items() if n == spec.name]:
        del _ALIASES[alias]
    for order in _AUTO.values():
        if spec.name in order:
            order.remove(spec.name)
    return spec


def canonical_name(name: str) -> str:
    """'AO' -> 'torchao', 'TE' -> 'te', ...; 'auto' stays 'auto'. Raises ValueError otherwise."""
    key = str(name).strip().lower()
    if key == "auto":
        return "auto"
    if key not in _ALIASES:
        raise ValueError(
            f"FP8RecipeKwargs.backend={name!r} is not one of 'auto', {', '.join(repr(n) for n in _SPECS)} "
            f"(aliases: {', '.join(sorted(a for a in _ALIASES if a not in _SPECS))})"
        )
    return _ALIASES[key]


def backend_spec(name: str) -> BackendSpec:
    return _SPECS[canonical_name(name)]


def registered_specs() -> list[BackendSpec]:
    return list(_SPECS.values())


def _delayed_recipes() -> list[tuple[str, str]]:
    return [(s.name, r.name) for s in _SPECS.values() for r in s.recipes.values() if r.delayed]
