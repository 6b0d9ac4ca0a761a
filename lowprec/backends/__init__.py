"""The adapters, found through the declarations in `lowprec.frontend.specs` and imported only when asked for;
`resolve_backend` / `create_backend` choose and build one for a recipe and a run context."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ..frontend.specs import (
    AUTO_ORDER,
    BackendSpec,
    RecipeInfo,
    auto_order,
    backend_spec,
    canonical_name,
    register_backend,
    registered_specs,
    unregister_backend,
)
from ..planning.hardware import DeviceInfo
from .base import Backend, BackendUnavailableError, RunContext

if TYPE_CHECKING:
    from ..frontend.recipe import FP8RecipeKwargs

__all__ = [
    "AUTO_ORDER",
    "Backend",
    "BackendSpec",
    "BackendUnavailableError",
    "RecipeInfo",
    "RunContext",
    "auto_choice",
    "backend_class",
    "canonical_name",
    "create_backend",
    "describe_choice",
    "register_backend",
    "registered_backends",
    "unregister_backend",
    "resolve_backend",
]


def backend_class(name: str) -> type[Backend]:
    """The adapter class of backend `name` (imports its module, not its package). A class that is no
    `Backend`, or that does not carry this backend's spec, is refused here, where the registration is
    named, rather than as an AttributeError deep in planning."""
    spec = backend_spec(name)
    module_name, class_name = spec.adapter.split(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise TypeError(f"backend {spec.name!r}: adapter {spec.adapter!r} is not a lowprec.backends.Backend subclass")
    own = getattr(cls, "spec", None)
    if own is None or own.name != spec.name:
        raise TypeError(
            f"backend {spec.name!r}: adapter {spec.adapter!r} "
            + ("has no `spec`" if own is None else f"carries the spec of backend {own.name!r}")
            + "; give the class `spec = <its BackendSpec>` (or `backend_spec(name)`): its name, recipes and "
            "options come from it"
        )
    return cls


def strip_backend_entries(state_dict: dict) -> dict:
    """`state_dict` with every backend's own entries removed (`Backend.strip_state_dict`), for a model
    whose converting backend is not known. Adapter modules import no backend package (that waits for
    `convert`), so an adapter that cannot be imported is a broken registration, not a missing package: it is
    named, not skipped, since its entries would then load as if they were the model's."""
    for spec in registered_specs():
        try:
            cls = backend_class(spec.name)
        except (ImportError, AttributeError) as exc:
            raise ImportError(
                f"backend {spec.name!r} is registered with adapter {spec.adapter!r}, which cannot be imported "
                f"({type(exc).__name__}: {exc}), so lowprec cannot tell which state-dict entries its modules add; "
                f"fix the adapter or call lowprec.backends.unregister_backend({spec.name!r})"
            ) from exc
        state_dict = cls.strip_state_dict(state_dict)
    return state_dict


def registered_backends() -> list[type[Backend]]:
    return [backend_class(spec.name) for spec in registered_specs()]


def _why_not(cls: type[Backend], recipe: FP8RecipeKwargs, context: RunContext) -> str | None:
    ok, reason = cls.availability()
    if not ok:
        return reason
    try:
        cls.check_recipe(recipe.replace(backend=cls.name))
    except ValueError as exc:
        return str(exc)
    problem = cls.default_recipe_problem(recipe.replace(backend=cls.name), context)
    if problem is not None:
        return problem
    name = cls.spec.recipe_name(recipe.recipe) if recipe.recipe else cls.default_recipe_for(context)
    problem = cls.context_problem(name, context)
    if problem is not None:
        return f"recipe {name!r} {problem}"
    info = cls.recipes[name]
    device = context.device
    hardware = device.capability is not None and device.capability >= info.min_capability
    if not hardware and not (cls.supports_emulation and recipe.emulate is not False):
        return f"cannot run on {device.describe()}"
    return None


def auto_choice(recipe: FP8RecipeKwargs, context: RunContext) -> tuple[type[Backend] | None, list[str]]:
    """What `backend='auto'` picks in `context`, and why it passed over each backend tried before it:
    (class or None, ["te: <reason>", ...])."""
    passed_over = []
    for name in auto_order(context.compiled):
        cls = backend_class(name)
        why = _why_not(cls, recipe, context)
        if why is None:
            return cls, passed_over
        passed_over.append(f"{name}: {why}")
    return None, passed_over


def describe_choice(recipe: FP8RecipeKwargs, context: RunContext) -> str:
    """How the plan names the way its backend was chosen: by the recipe, or by 'auto' (in which order, for
    which kind of model, and what it passed over)."""
    if recipe.backend != "auto":
        return f"backend={recipe.backend!r} named by the recipe"
    cls, passed_over = auto_choice(recipe, context)
    kind = "compiled" if context.compiled else "eager"
    order = ", ".join(auto_order(context.compiled))
    text = f"backend='auto' chose {cls.name if cls else None!r}: the first of {order} (the order for {kind} models) " \
           "that can run this recipe here"
    if passed_over:
        text += "; passed over " + "; ".join(passed_over)
    return text


def resolve_backend(recipe: FP8RecipeKwargs, context: RunContext | DeviceInfo) -> type[Backend]:
    """The backend class `recipe` asks for; for 'auto', the best one that can honour it in `context`
    (a device alone means one uncompiled process on it)."""
    if isinstance(context, DeviceInfo):
        context = RunContext(device=context)
    if recipe.backend != "auto":
        return backend_class(recipe.backend)
    cls, passed_over = auto_choice(recipe, context)
    if cls is not None:
        return cls
    raise BackendUnavailableError(
        "FP8RecipeKwargs(backend='auto') found no backend that can honour this recipe here:\n"
        + "\n".join(f"  {line}" for line in passed_over)
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
