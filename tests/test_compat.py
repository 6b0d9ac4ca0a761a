"""Accelerate's own FP8 handlers, translated to `FP8RecipeKwargs`."""

from __future__ import annotations

import types

import pytest
import torch
from accelerate.utils import (
    AORecipeKwargs,
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    MSAMPRecipeKwargs,
    TERecipeKwargs,
)
from accelerate.utils import FP8RecipeKwargs as AccelerateFP8RecipeKwargs

from lowprec import FP8RecipeKwargs
from lowprec.frontend.compat import _from_te, is_fp8_handler, to_recipe

float8 = pytest.importorskip("torchao.float8")


# ---- is_fp8_handler ----------------------------------------------------------------------------
def test_fp8_handlers_are_recognised():
    assert is_fp8_handler(FP8RecipeKwargs())
    assert is_fp8_handler(AORecipeKwargs())
    assert is_fp8_handler(MSAMPRecipeKwargs())
    # TERecipeKwargs / accelerate's FP8RecipeKwargs need TransformerEngine to be constructed.
    assert is_fp8_handler(object.__new__(TERecipeKwargs))
    assert is_fp8_handler(object.__new__(AccelerateFP8RecipeKwargs))


def test_subclass_of_an_accelerate_handler_is_recognised():
    class MyAO(AORecipeKwargs):
        pass

    assert is_fp8_handler(MyAO())


@pytest.mark.parametrize("handler", [DistributedDataParallelKwargs(), GradScalerKwargs(), object(), None, "fp8"])
def test_other_handlers_are_not_fp8(handler):
    assert not is_fp8_handler(handler)


def test_lookalike_outside_accelerate_is_not_fp8():
    from accelerate.utils import KwargsHandler

    AORecipeKwargs_ = type("AORecipeKwargs", (KwargsHandler,), {})  # same name, wrong module
    assert not is_fp8_handler(AORecipeKwargs_())


def test_to_recipe_rejects_other_handlers():
    with pytest.raises(TypeError, match="DistributedDataParallelKwargs is not an FP8 recipe handler"):
        to_recipe(DistributedDataParallelKwargs())


def test_to_recipe_returns_lowprec_handler_unchanged():
    r = FP8RecipeKwargs(backend="torchao", recipe="rowwise")
    assert to_recipe(r) is r


# ---- AORecipeKwargs ------------------------------------------------------------------------------
def test_ao_default():
    r = to_recipe(AORecipeKwargs())
    assert (r.backend, r.recipe, r.fp8_format) == ("torchao", "tensorwise", None)
    assert r.pad_inner_dim is True  # Accelerate's default config pads
    assert r.enable_fsdp_float8_all_gather is None  # "where it applies", not forced on every recipe
    assert r.emulate is None and r.module_filter_fn is None


@pytest.mark.parametrize("name", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_ao_named_recipe(name):
    r = to_recipe(AORecipeKwargs(config=float8.Float8LinearConfig.from_recipe_name(name)))
    assert (r.backend, r.recipe) == ("torchao", name)
    assert r.pad_inner_dim is False
    assert r.enable_fsdp_float8_all_gather is False


def test_ao_flags_carried_over():
    config = float8.Float8LinearConfig(emulate=True, pad_inner_dim=False, enable_fsdp_float8_all_gather=True)
    r = to_recipe(AORecipeKwargs(config=config))
    assert (r.recipe, r.emulate, r.pad_inner_dim, r.enable_fsdp_float8_all_gather) == ("tensorwise", True, False, None)


def test_ao_e4m3_grads_is_tensorwise_e4m3():
    e4m3 = float8.CastConfig(target_dtype=torch.float8_e4m3fn)
    r = to_recipe(AORecipeKwargs(config=float8.Float8LinearConfig(cast_config_grad_output=e4m3)))
    assert (r.recipe, r.fp8_format) == ("tensorwise", "E4M3")


@pytest.mark.parametrize(
    "config",
    [
        lambda: float8.Float8LinearConfig(round_scales_to_power_of_2=True),
        lambda: float8.Float8LinearConfig(force_recompute_fp8_weight_in_bwd=True),
        lambda: float8.Float8LinearConfig(gemm_config_output=float8.config.Float8GemmConfig(use_fast_accum=False)),
    ],
    ids=["pow2_scales", "recompute_weight", "no_fast_accum"],
)
def test_ao_custom_config_is_rejected(config):
    with pytest.raises(ValueError, match="custom Float8LinearConfig") as err:
        to_recipe(AORecipeKwargs(config=config()))
    assert "'tensorwise', 'rowwise', 'rowwise_with_gw_hp'" in str(err.value)


@pytest.mark.parametrize("config", ["tensorwise", 5])
def test_ao_config_that_is_not_a_float8_linear_config_is_named(config):
    # was TypeError: replace() should be called on dataclass instances
    with pytest.raises(ValueError) as err:
        to_recipe(AORecipeKwargs(config=config))
    message = str(err.value)
    assert f"AORecipeKwargs.config={config!r} must be a torchao.float8.Float8LinearConfig" in message
    assert "Float8LinearConfig.from_recipe_name(name)" in message and "recipe=name" in message
    assert "'tensorwise', 'rowwise', 'rowwise_with_gw_hp'" in message


def test_ao_module_filter_func_carried_over():
    def keep(module, fqn):
        return "lm_head" not in fqn

    r = to_recipe(AORecipeKwargs(module_filter_func=keep))
    assert r.module_filter_fn is keep
    # as in Accelerate, the user's filter replaces the first/last skipping (and lowprec's slow-shape rule)
    assert r.skip_first_last is False and r.skip_slow_shapes is False


def test_ao_module_filter_func_alone_decides_what_is_converted():
    from lowprec.backends import RunContext
    from lowprec.planning.hardware import assumed_device
    from lowprec.runtime.planner import build_plan

    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    r = to_recipe(AORecipeKwargs(module_filter_func=lambda module, fqn: fqn != "2"))
    plan = build_plan(model, r, context=RunContext(device=assumed_device("9.0")))
    assert sorted(d.fqn for d in plan.converted) == ["0", "1", "3"]
    assert {d.fqn: d.reason for d in plan.skipped} == {"2": "module_filter_fn returned False"}


def test_ao_default_keeps_accelerates_first_last_skipping():
    r = to_recipe(AORecipeKwargs())
    assert r.module_filter_fn is None and r.skip_first_last is True


# ---- MS-AMP ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_msamp_handler_keeps_its_level(opt_level):
    recipe = to_recipe(MSAMPRecipeKwargs(opt_level=opt_level))
    assert (recipe.backend, recipe.opt_level) == ("msamp", opt_level)


@pytest.mark.parametrize("backend", ["MSAMP", "msamp"])
def test_deprecated_handler_with_msamp(backend):
    handler = object.__new__(AccelerateFP8RecipeKwargs)  # its __post_init__ needs TransformerEngine
    handler.backend, handler.opt_level = backend, None  # what Accelerate leaves when opt_level is not given
    recipe = to_recipe(handler)
    assert (recipe.backend, recipe.opt_level) == ("msamp", None)


# ---- TransformerEngine (not constructible here: a stand-in with TERecipeKwargs' fields) ---------------
def te_handler(**changes):
    fields = dict(
        use_autocast_during_eval=False, margin=0, interval=1, fp8_format="HYBRID", amax_history_len=1024,
        amax_compute_algo="most_recent", override_linear_precision=(False, False, False), use_mxfp8_block_scaling=False,
    )
    fields.update(changes)
    return types.SimpleNamespace(**fields)


def test_te_handler_needs_transformer_engine():
    with pytest.raises(ImportError):
        TERecipeKwargs()


@pytest.mark.parametrize("interval", [2, 16])
def test_te_interval_is_rejected(interval):
    with pytest.raises(ValueError, match=rf"TERecipeKwargs.interval={interval} .*removed `interval`"):
        _from_te(te_handler(interval=interval))


@pytest.mark.parametrize("override", [(True, False, False), (False, True, False), (False, False, True), [0, 0, 1]])
def test_te_override_linear_precision_is_rejected(override):
    with pytest.raises(ValueError, match="TERecipeKwargs.override_linear_precision") as err:
        _from_te(te_handler(override_linear_precision=override))
    assert "exclude=" in str(err.value)  # says what to do instead


@pytest.mark.parametrize(
    "changes", [{}, {"interval": None}, {"override_linear_precision": None}, {"use_mxfp8_block_scaling": True}]
)
def test_te_noop_values_reach_the_te_backend(changes):
    # interval=1 / no overrides are no-ops: the handler translates to the te backend.
    r = _from_te(te_handler(**changes))
    assert r.backend == "te"
    assert r.recipe == ("mxfp8" if changes.get("use_mxfp8_block_scaling") else "delayed")


def test_deprecated_handler_with_te_goes_through_te_checks():
    handler = object.__new__(AccelerateFP8RecipeKwargs)
    for name, value in vars(te_handler(interval=4)).items():
        setattr(handler, name, value)
    handler.backend, handler.opt_level = "TE", None
    with pytest.raises(ValueError, match="interval=4"):
        to_recipe(handler)
