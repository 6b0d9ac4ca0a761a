"""Named recipes: one name for a whole `FP8RecipeKwargs`, as Megatron-Bridge names its mixed-precision
configs (`mixed_precision="bf16_with_fp8_current_scaling_mixed"`) and registers them with `@register`.

A named recipe is a function returning the fields it sets. It is looked up by `FP8RecipeKwargs(name=...)`
(also `FP8RecipeKwargs.from_name`, `ACCELERATE_FP8_RECIPE_NAME`, `fp8_config: {name: ...}`), and every field
the caller or the environment sets explicitly wins over the name's. Names are matched without regard to
case, and `-` reads as `_` (Megatron-Bridge registers both spellings).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

RecipeFactory = Callable[[], Mapping[str, Any]]


@dataclass(frozen=True)
class NamedRecipe:
    name: str
    summary: str
    factory: RecipeFactory
    source: str = "lowprec"  # whose vocabulary the name comes from

    def fields(self) -> dict[str, Any]:
        """The `FP8RecipeKwargs` fields this name sets (a fresh dict on every call)."""
        return dict(self.factory())


_NAMED: dict[str, NamedRecipe] = {}
# Names users bring from other tools that lowprec knows but does not offer, with the reason and what to use.
_NOT_OFFERED: dict[str, str] = {}


def name_key(name: str) -> str:
    """How a recipe name is matched: without case, hyphens as underscores."""
    return str(name).strip().lower().replace("-", "_")


def register(func: RecipeFactory | None = None, *, name: str | None = None, summary: str | None = None,
             source: str = "lowprec", replace: bool = False, fields: Collection[str] | None = None):
    """Register a named recipe: `@register` on a function returning the `FP8RecipeKwargs` fields it sets
    (named by the function), or `@register(name=..., summary=...)`. A taken name is refused unless
    `replace=True`. `fields`: the field names a recipe may set (`lowprec.recipes.register` passes
    FP8RecipeKwargs'), checked now; the values are checked when a recipe is built, where the environment and
    the caller's own fields are known."""

    for option, value in (("name", name), ("summary", summary), ("source", source)):
        if value is not None and not isinstance(value, str):
            raise TypeError(f"lowprec.recipes.register: {option}={value!r} must be a str")

    def add(factory: RecipeFactory) -> RecipeFactory:
        if not callable(factory):
            raise TypeError(f"lowprec.recipes.register: {factory!r} is not a function; register a function that "
                            "returns the FP8RecipeKwargs fields its recipe sets, e.g. {'backend': 'te', 'recipe': "
                            "'current'} (a name goes in name=: @register(name='mine'))")
        shown = factory.__name__ if name is None else name  # name='' is refused, not replaced by the function's
        key = name_key(shown)
        if not key or not key.replace("_", "").isalnum():
            raise ValueError(f"lowprec.recipes.register: name {shown!r} must be letters, digits, '_' or '-'")
        if (key in _NAMED or key in _NOT_OFFERED) and not replace:
            raise ValueError(f"lowprec.recipes.register: {key!r} is already a named recipe; pass replace=True to "
                             "replace it, or choose another name")
        sets = factory()
        if not isinstance(sets, Mapping):
            raise TypeError(f"lowprec.recipes.register: recipe {key!r} must return a mapping of FP8RecipeKwargs "
                            f"fields, e.g. {{'backend': 'te', 'recipe': 'current'}}; it returned {type(sets).__name__}")
        unknown = sorted(set(sets) - set(fields)) if fields is not None else []
        if unknown:
            raise ValueError(f"lowprec.recipes.register: recipe {key!r} sets {', '.join(map(repr, unknown))}, which "
                             f"{'is not a field' if len(unknown) == 1 else 'are not fields'} of FP8RecipeKwargs "
                             f"(fields: {', '.join(sorted(fields))})")
        doc = (factory.__doc__ or "").strip().split("\n\n")[0]
        _NOT_OFFERED.pop(key, None)
        _NAMED[key] = NamedRecipe(key, summary or " ".join(doc.split()) or key, factory, source)
        return factory

    return add if func is None else add(func)


def unregister(name: str) -> NamedRecipe:
    """Forget named recipe `name`; returns it."""
    return _NAMED.pop(lookup(name).name)


def not_offered(name: str, why: str) -> None:
    """Know `name` from another tool's vocabulary, and say `why` lowprec does not offer it, when it is asked for."""
    _NOT_OFFERED[name_key(name)] = why


def not_offered_names() -> dict[str, str]:
    """The names from other tools' vocabularies lowprec knows but does not offer, with the reason and what to use."""
    return dict(_NOT_OFFERED)


def names() -> list[str]:
    """The named recipes, in registration order."""
    return list(_NAMED)


def lookup(name: str) -> NamedRecipe:
    """The named recipe `name`; ValueError naming the option and listing the names otherwise."""
    key = name_key(name)
    if key in _NAMED:
        return _NAMED[key]
    if key in _NOT_OFFERED:
        raise ValueError(f"FP8RecipeKwargs.name={name!r} is not offered by lowprec: {_NOT_OFFERED[key]}")
    raise ValueError(f"FP8RecipeKwargs.name={name!r} is not a named recipe; known: {', '.join(_NAMED)} "
                     "(`lowprec recipes` lists what each sets)")


def describe(recipe: NamedRecipe) -> str:
    """What a named recipe sets, e.g. "backend='te', recipe='current', skip_first_blocks=1"."""
    return ", ".join(f"{k}={v!r}" for k, v in recipe.fields().items())


# ---- the names lowprec ships ------------------------------------------------------------------------------
# Megatron-Bridge's FP8 names (training/mixed_precision.py) where lowprec can honour them, with TE as
# Megatron runs them. What lowprec does not copy: fp8_param_gather (Megatron's distributed optimizer gathers FP8
# weights; lowprec's nearest, te fp8_weights, also swaps the optimizer for TE's FusedAdam, so it stays a choice
# of its own) and fp8='hybrid' for the block recipes (TE's block scaling here runs E4M3, its only format).
_MEGATRON = "Megatron-Bridge"


@register(source=_MEGATRON, summary="TE delayed scaling (amax history 1024, max, margin 0), HYBRID")
def bf16_with_fp8_delayed_scaling_mixed():
    return {"backend": "te", "recipe": "delayed", "fp8_format": "HYBRID", "margin": 0, "amax_history_len": 1024,
            "amax_compute_algo": "max"}


@register(source="NeMo 2", summary="NeMo 2's name for bf16_with_fp8_delayed_scaling_mixed")
def bf16_with_fp8_mixed():
    return bf16_with_fp8_delayed_scaling_mixed()


@register(source=_MEGATRON, summary="TE current (tensorwise) scaling, HYBRID; first and last block in BF16")
def bf16_with_fp8_current_scaling_mixed():
    return {"backend": "te", "recipe": "current", "fp8_format": "HYBRID", "skip_first_blocks": 1,
            "skip_last_blocks": 1}


@register(source=_MEGATRON, summary="TE current scaling, HYBRID; first two and last two blocks in BF16")
def nemotron_h_bf16_with_fp8_current_scaling_mixed():
    return {**bf16_with_fp8_current_scaling_mixed(), "skip_first_blocks": 2, "skip_last_blocks": 2}


@register(source=_MEGATRON, summary="TE block (subchannel) scaling, 1x128 / 128x128 blocks, E4M3; first two and "
                                    "last two blocks in BF16")
def nanov2_bf16_with_fp8_current_scaling_mixed():
    return {"backend": "te", "recipe": "block", "skip_first_blocks": 2, "skip_last_blocks": 2}


@register(source=_MEGATRON, summary="TE block (subchannel) scaling: 1x128 activation and 128x128 weight blocks, E4M3")
def bf16_with_fp8_subchannel_scaling_mixed():
    return {"backend": "te", "recipe": "block"}


@register(source=_MEGATRON, summary="TE MXFP8: 1x32 blocks with E8M0 scales, E4M3 (Blackwell GPUs)")
def bf16_with_mxfp8_mixed():
    return {"backend": "te", "recipe": "mxfp8", "fp8_format": "E4M3"}


for _fp8 in ("fp8_delayed_scaling", "mxfp8", "fp8_current_scaling", "fp8_subchannel_scaling", "fp8"):
    not_offered(f"fp16_with_{_fp8}_mixed",
                f"lowprec runs what is not FP8 in BF16 (mixed_precision='fp8'), not FP16 with loss scaling; use "
                f"'bf16_with_{_fp8}_mixed'")
for _name in ("bf16_mixed", "fp16_mixed"):
    not_offered(_name, "it is not an FP8 recipe: use Accelerator(mixed_precision='bf16' or 'fp16') without "
                       "FP8RecipeKwargs")


# lowprec's own: one name per backend recipe and per MS-AMP level
@register(summary="torchao: dynamic per-tensor scales, cuBLAS FP8 GEMMs")
def torchao_tensorwise():
    return {"backend": "torchao", "recipe": "tensorwise"}


@register(summary="torchao: per-row power-of-2 scales, E4M3 everywhere (sm_90+)")
def torchao_rowwise():
    return {"backend": "torchao", "recipe": "rowwise"}


@register(summary="torchao: rowwise, with the weight-gradient GEMM in high precision (sm_90+)")
def torchao_rowwise_with_gw_hp():
    return {"backend": "torchao", "recipe": "rowwise_with_gw_hp"}


@register(summary="TE delayed scaling, TE's defaults")
def te_delayed():
    return {"backend": "te", "recipe": "delayed"}


@register(summary="TE current (per-tensor) scaling")
def te_current():
    return {"backend": "te", "recipe": "current"}


@register(summary="MS-AMP O1: FP8 GEMMs and FP8 weight gradients, FP16 weights, FP32 optimizer states")
def msamp_o1():
    return {"backend": "msamp", "opt_level": "O1"}


@register(summary="MS-AMP O2: O1 with FP8+FP16 Adam states (the smallest model state on one GPU or DDP)")
def msamp_o2():
    return {"backend": "msamp", "opt_level": "O2"}


@register(summary="MS-AMP O3: O2 with FP8 weights and sharded FP16 masters (FSDP2 or DeepSpeed ZeRO-1/2)")
def msamp_o3():
    return {"backend": "msamp", "opt_level": "O3"}
