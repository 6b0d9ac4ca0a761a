"""Backend registry: name -> adapter class, imported only when asked for.

Adding a backend is one module under `lowprec/backends/` and one `register_backend` line here.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ..hardware import DeviceInfo
from .base import Backend, BackendUnavailableError, RecipeInfo, RunContext

if TYPE_CHECKING:
    from ..recipe import FP8RecipeKwargs

__all__ = [
    "Backend",
    "BackendUnavailableError",
    "RecipeInfo",
    "RunContext",
    "backend_class",
    "canonical_name",
    "create_backend",
    "register_backend",
    "registered_backends",
    "resolve_backend",
]

_REGISTRY: dict[str, str] = {}
_ALIASES: dict[str, str] = {}
# "auto" tries these in order; the first that is available, supports the recipe and can run on the
# device wins. TE first on FP8 GPUs: fused kernels without needing torch.compile.
AUTO_ORDER = ("te", "torchao", "msamp")


def register_backend(name: str, target: str, *, aliases: tuple[str, ...] = ()) -> None:
    """Register `target` ("module:Class") under `name` (and case-insensitive `aliases`)."""
    _REGISTRY[name] = target
    for alias in (name, *aliases):
        _ALIASES[alias.lower()] = name


register_backend("torchao", "lowprec.backends.torchao:TorchAOBackend", aliases=("ao",))
register_backend(
    "te", "lowprec.backends.te:TEBackend", aliases=("transformer_engine", "transformer-engine", "transformerengine")
)
register_backend("msamp", "lowprec.backends.msamp:MSAMPBackend", aliases=("ms-amp", "ms_amp"))


def canonical_name(name: str) -> str:
    """'AO' -> 'torchao', 'TE' -> 'te', ...; 'auto' stays 'auto'. Raises ValueError otherwise."""
    key = str(name).strip().lower()
    if key == "auto":
        return "auto"
    if key not in _ALIASES:
        raise ValueError(
            f"FP8RecipeKwargs.backend={name!r} is not one of 'auto', {', '.join(repr(n) for n in _REGISTRY)} "
            f"(aliases: {', '.join(sorted(a for a in _ALIASES if a not in _REGISTRY))})"
        )
    return _ALIASES[key]


def backend_class(name: str) -> type[Backend]:
    module_name, class_name = _REGISTRY[canonical_name(name)].split(":")
    return getattr(importlib.import_module(module_name), class_name)


def registered_backends() -> list[type[Backend]]:
    return [backend_class(name) for name in _REGISTRY]


def _why_not(cls: type[Backend], recipe: FP8RecipeKwargs, context: RunContext) -> str | None:
    if not getattr(cls, "implemented", True):
        return "not available in this version of lowprec"
    ok, reason = cls.availability()
    if not ok:
        return reason
    try:
        cls.check_recipe(recipe.replace(backend=cls.name))
    except ValueError as exc:
        return str(exc)
    name = recipe.recipe or cls.default_recipe_for(context)
    problem = cls.context_problem(name, context)
    if problem is not None:
        return f"recipe {name!r} {problem}"
    info = cls.recipes[name]
    device = context.device
    hardware = device.capability is not None and device.capability >= info.min_capability
    if not hardware and not (cls.supports_emulation and recipe.emulate is not False):
        return f"cannot run on {device.describe()}"
    return None


def resolve_backend(recipe: FP8RecipeKwargs, context: RunContext | DeviceInfo) -> type[Backend]:
    """The backend class `recipe` asks for; for 'auto', the best one that can honour it in `context`
    (a device alone means one uncompiled process on it)."""
    if isinstance(context, DeviceInfo):
        context = RunContext(device=context)
    if recipe.backend != "auto":
        cls = backend_class(recipe.backend)
        if not getattr(cls, "implemented", True):
            raise BackendUnavailableError(cls.not_implemented_message())
        return cls
    reasons = []
    for name in AUTO_ORDER:
        cls = backend_class(name)
        why = _why_not(cls, recipe, context)
        if why is None:
            return cls
        reasons.append(f"  {name}: {why}")
    raise BackendUnavailableError(
        "FP8RecipeKwargs(backend='auto') found no backend that can honour this recipe here:\n" + "\n".join(reasons)
    )


def create_backend(recipe: FP8RecipeKwargs, context: RunContext, *, require_package: bool = True) -> Backend:
    """Instantiate the adapter for `recipe` on `context`.

    With `require_package=False` the adapter may be created without its package installed: enough
    to plan (the plan reads only shapes), not to convert a model.
    """
    cls = resolve_backend(recipe, context)
    ok, reason = cls.availability()
    if require_package and not ok:
        raise BackendUnavailableError(f"FP8RecipeKwargs(backend={cls.name!r}) cannot be used: {reason}")
    if recipe.backend == cls.name:
        return cls(recipe, context)
    try:
        return cls(recipe.replace(backend=cls.name), context)
    except (ValueError, BackendUnavailableError) as exc:
        # The user never named this backend: say that `auto` chose it, and how to choose otherwise.
        raise type(exc)(
            f"backend='auto' chose {cls.name!r} on {context.device.describe()} and it cannot run this recipe: {exc}. "
            f"Name a backend (FP8RecipeKwargs(backend=...)) to choose another."
        ) from exc
