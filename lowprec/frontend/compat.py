"""Accelerate's own FP8 handlers, translated to `FP8RecipeKwargs`.

Existing scripts switch by changing one import: `AORecipeKwargs`, `TERecipeKwargs`,
`MSAMPRecipeKwargs` and the deprecated `accelerate.utils.FP8RecipeKwargs` are accepted by
`lowprec.Accelerator`. Every field is honoured or rejected with a reason; nothing is dropped.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from accelerate.utils import KwargsHandler

from .recipe import FP8RecipeKwargs
from .specs import TE_REMOVED_OPTIONS


def is_fp8_handler(handler: Any) -> bool:
    """True for lowprec's handler and for Accelerate's FP8 handlers."""
    if isinstance(handler, FP8RecipeKwargs):
        return True
    names = {"AORecipeKwargs", "TERecipeKwargs", "MSAMPRecipeKwargs", "FP8RecipeKwargs"}
    return isinstance(handler, KwargsHandler) and any(
        c.__name__ in names and c.__module__.startswith("accelerate.") for c in type(handler).__mro__
    )


def to_recipe(handler: Any) -> FP8RecipeKwargs:
    """Translate any FP8 handler to `FP8RecipeKwargs`."""
    if isinstance(handler, FP8RecipeKwargs):
        return handler
    from accelerate.utils import AORecipeKwargs, MSAMPRecipeKwargs, TERecipeKwargs
    from accelerate.utils import FP8RecipeKwargs as AccelerateFP8RecipeKwargs

    if isinstance(handler, AccelerateFP8RecipeKwargs):  # deprecated: TE and MS-AMP fields in one class
        backend = str(handler.backend).lower()
        if backend == "msamp":
            # Accelerate's MRO never runs MSAMPRecipeKwargs.__post_init__, so opt_level may be None
            # there (it then crashes in msamp.initialize); None here means lowprec's MS-AMP default.
            return FP8RecipeKwargs(backend="msamp", opt_level=handler.opt_level)
        return _from_te(handler)
    if isinstance(handler, AORecipeKwargs):
        return _from_ao(handler)
    if isinstance(handler, TERecipeKwargs):
        return _from_te(handler)
    if isinstance(handler, MSAMPRecipeKwargs):
        return FP8RecipeKwargs(backend="msamp", opt_level=handler.opt_level)
    raise TypeError(f"{type(handler).__name__} is not an FP8 recipe handler")


def _from_te(handler: Any) -> FP8RecipeKwargs:
    if getattr(handler, "interval", 1) not in (None, 1):
        raise ValueError(f"TERecipeKwargs.interval={handler.interval!r} cannot be honoured: "
                         f"{TE_REMOVED_OPTIONS['interval']}. Remove it.")
    override = tuple(getattr(handler, "override_linear_precision", None) or (False, False, False))
    if any(override):
        raise ValueError(f"TERecipeKwargs.override_linear_precision={override!r} cannot be honoured: "
                         f"{TE_REMOVED_OPTIONS['override_linear_precision']}")
    mxfp8 = bool(getattr(handler, "use_mxfp8_block_scaling", False))
    delayed = {"margin": handler.margin, "amax_history_len": handler.amax_history_len,
               "amax_compute_algo": handler.amax_compute_algo}
    if mxfp8:
        # MXFP8 has no amax history: only values changed from the handler's defaults are passed on
        # (and rejected), as Accelerate rejects them too.
        defaults = {"margin": 0, "amax_history_len": 1024, "amax_compute_algo": "most_recent"}
        delayed = {k: v for k, v in delayed.items() if v != defaults[k]}
    return FP8RecipeKwargs(
        backend="te",
        recipe="mxfp8" if mxfp8 else "delayed",
        fp8_format=handler.fp8_format,
        use_autocast_during_eval=handler.use_autocast_during_eval,
        **delayed,
    )


_AO_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")  # torchao's named recipes lowprec runs


def _from_ao(handler: Any) -> FP8RecipeKwargs:
    """`AORecipeKwargs` as `FP8RecipeKwargs(backend="torchao", ...)`.

    `config` must be a torchao `Float8LinearConfig` (None: Accelerate fills in its default): a recipe name such
    as "tensorwise" is refused with the spelling to use, not read as that recipe, since Accelerate's own
    Accelerator, which the handler also belongs to, cannot run it and the script would work only here.
    """
    import torch
    from torchao.float8 import CastConfig, Float8LinearConfig

    config = handler.config
    if not isinstance(config, Float8LinearConfig):
        raise ValueError(
            f"AORecipeKwargs.config={config!r} must be a torchao.float8.Float8LinearConfig (None: Accelerate's "
            "default); for a named recipe use config=Float8LinearConfig.from_recipe_name(name), or "
            f"FP8RecipeKwargs(backend='torchao', recipe=name), name one of {', '.join(map(repr, _AO_RECIPES))}")
    plain = dataclasses.replace(config, emulate=False, pad_inner_dim=False, enable_fsdp_float8_all_gather=False)
    recipe = fp8_format = None
    for name in _AO_RECIPES:
        if plain == Float8LinearConfig.from_recipe_name(name):
            recipe = name
    e4m3_grads = Float8LinearConfig(cast_config_grad_output=CastConfig(target_dtype=torch.float8_e4m3fn))
    if recipe is None and plain == e4m3_grads:
        recipe, fp8_format = "tensorwise", "E4M3"
    if recipe is None:
        raise ValueError(
            "AORecipeKwargs(config=...) holds a custom Float8LinearConfig that is not one of torchao's named "
            "recipes ('tensorwise', 'rowwise', 'rowwise_with_gw_hp'); lowprec only runs named recipes so that "
            "the plan can describe them. Use FP8RecipeKwargs(backend='torchao', recipe=...)."
        )
    return FP8RecipeKwargs(
        backend="torchao",
        recipe=recipe,
        fp8_format=fp8_format,
        module_filter_fn=handler.module_filter_func,
        # Accelerate's torchao path keeps the first and last Linear in BF16 unless a module_filter_func
        # replaces that rule: the user's filter alone decides, and lowprec's slow-shape rule steps aside too.
        **({"skip_first_last": False, "skip_slow_shapes": False} if handler.module_filter_func is not None
           else {"skip_first_last": True}),
        pad_inner_dim=config.pad_inner_dim,
        # Accelerate turns this on by default for every recipe; here True means "where it applies".
        enable_fsdp_float8_all_gather=None if config.enable_fsdp_float8_all_gather else False,
        emulate=True if config.emulate else None,
    )
