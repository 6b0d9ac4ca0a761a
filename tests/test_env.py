"""FP8 options from `ACCELERATE_FP8_*` variables, as `accelerate launch` exports them."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap

import pytest

from lowprec import FP8RecipeKwargs
from lowprec.frontend.env import FIELD_KEYS, read_fp8_env

# What `accelerate launch --mixed_precision fp8` (accelerate 1.15) exports when the config file's
# fp8_config names no option: its argparse defaults. Written out here, not imported from lowprec.frontend.env.
LAUNCHER_ENV = {
    "ACCELERATE_FP8_USE_AUTOCAST_DURING_EVAL": "False",
    "ACCELERATE_FP8_MARGIN": "0",
    "ACCELERATE_FP8_INTERVAL": "1",
    "ACCELERATE_FP8_FORMAT": "HYBRID",
    "ACCELERATE_FP8_AMAX_HISTORY_LEN": "1024",
    "ACCELERATE_FP8_AMAX_COMPUTE_ALGO": "most_recent",
    "ACCELERATE_FP8_OVERRIDE_FPROP": "False",
    "ACCELERATE_FP8_OVERRIDE_DGRAD": "False",
    "ACCELERATE_FP8_OVERRIDE_WGRAD": "False",
    "ACCELERATE_FP8_OPT_LEVEL": "O2",
    "ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER": "1",
    "ACCELERATE_FP8_PAD_INNER_DIM": "1",
}
MARKER = {"ACCELERATE_FP8_OVERRIDE_FPROP": "False"}


def setenv(monkeypatch, env: dict[str, str]) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)


# (variable, value, field, parsed value); every value differs from the field's default.
EVERY_KEY = [
    ("ACCELERATE_FP8_BACKEND", "ao", "backend", "torchao"),
    ("ACCELERATE_FP8_RECIPE", "RowWise", "recipe", "rowwise"),
    ("ACCELERATE_FP8_FORMAT", "e4m3", "fp8_format", "E4M3"),
    ("ACCELERATE_FP8_FP8_FORMAT", "E4M3", "fp8_format", "E4M3"),
    ("ACCELERATE_FP8_MARGIN", "2", "margin", 2),
    ("ACCELERATE_FP8_AMAX_HISTORY_LEN", "16", "amax_history_len", 16),
    ("ACCELERATE_FP8_AMAX_HISTORY_LENGTH", "32", "amax_history_len", 32),
    ("ACCELERATE_FP8_AMAX_COMPUTE_ALGO", "max", "amax_compute_algo", "max"),
    ("ACCELERATE_FP8_AMAX_COMPUTE_ALGORITHM", "most_recent", "amax_compute_algo", "most_recent"),
    ("ACCELERATE_FP8_OPT_LEVEL", "O1", "opt_level", "O1"),
    ("ACCELERATE_FP8_OPTIMIZATION_LEVEL", "o3", "opt_level", "O3"),
    ("ACCELERATE_FP8_INCLUDE", "layers.*,lm_head", "include", ("layers.*", "lm_head")),
    ("ACCELERATE_FP8_EXCLUDE", "lm_head", "exclude", ("lm_head",)),
    ("ACCELERATE_FP8_SKIP_FIRST_LAST", "false", "skip_first_last", False),
    ("ACCELERATE_FP8_SKIP_FIRST_BLOCKS", "2", "skip_first_blocks", 2),
    ("ACCELERATE_FP8_SKIP_LAST_BLOCKS", " 1 ", "skip_last_blocks", 1),
    ("ACCELERATE_FP8_SKIP_SLOW_SHAPES", "0", "skip_slow_shapes", False),
    ("ACCELERATE_FP8_PAD_INNER_DIM", "true", "pad_inner_dim", True),
    ("ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER", "False", "enable_fsdp_float8_all_gather", False),
    ("ACCELERATE_FP8_USE_AUTOCAST_DURING_EVAL", "True", "use_autocast_during_eval", True),
    ("ACCELERATE_FP8_EMULATE", "1", "emulate", True),
    ("ACCELERATE_FP8_COMPILE_FP8_LAYERS", "false", "compile_fp8_layers", False),
    ("ACCELERATE_FP8_FP8_WEIGHTS", "true", "fp8_weights", True),
    ("ACCELERATE_FP8_WEIGHT_DTYPE", "bfloat16", "weight_dtype", "bf16"),
    ("ACCELERATE_FP8_WEIGHT_GRAD_DTYPE", "e4m3", "weight_grad_dtype", "fp8"),
    ("ACCELERATE_FP8_GRAD_COMM_DTYPE", "BF16", "grad_comm_dtype", "bf16"),
    ("ACCELERATE_FP8_OPTIMIZER_STATES", "FP8", "optimizer_states", "fp8"),
    ("ACCELERATE_FP8_OPTIMIZER_STATES", "['e4m3', 'e4m3']", "optimizer_states", "e4m3+e4m3"),
    ("ACCELERATE_FP8_RECIPE_NAME", "msamp-o2", "name", "msamp_o2"),
    ("ACCELERATE_FP8_NAME", "TE_current", "name", "te_current"),  # fp8_config: {name: ...}
    ("ACCELERATE_FP8_ACTIVATION_DTYPE", "E4M3", "activation_dtype", "fp8"),
    ("ACCELERATE_FP8_REDUCE_AMAX", "false", "reduce_amax", False),
    ("ACCELERATE_FP8_REDUCE_AMAX", "1", "reduce_amax", True),
    ("ACCELERATE_FP8_OPTIMIZER_IN_BACKWARD", "true", "optimizer_in_backward", True),
]


@pytest.mark.parametrize("var,value,field,expected", EVERY_KEY, ids=[v[0][15:] for v in EVERY_KEY])
def test_every_key_is_read(monkeypatch, var, value, field, expected):
    monkeypatch.setenv(var, value)
    assert getattr(FP8RecipeKwargs(), field) == expected
    env = read_fp8_env()
    assert env.values == {field: value} and env.sources == {field: var}


@pytest.mark.parametrize("var,value,field,expected", EVERY_KEY, ids=[v[0][15:] for v in EVERY_KEY])
def test_every_key_with_lowprec_prefix(monkeypatch, var, value, field, expected):
    lowprec_var = var.replace("ACCELERATE_FP8_", "ACCELERATE_FP8_LOWPREC_")
    setenv(monkeypatch, {lowprec_var: value, **MARKER})
    assert getattr(FP8RecipeKwargs(), field) == expected
    assert read_fp8_env().sources == {field: lowprec_var}


def test_every_settable_field_has_an_env_key():
    fields = {f.name for f in dataclasses.fields(FP8RecipeKwargs)} - {"module_filter_fn"}
    assert set(FIELD_KEYS) == fields
    assert {field for _, _, field, _ in EVERY_KEY} == fields


def test_module_filter_fn_is_not_settable_from_env(monkeypatch):
    monkeypatch.setenv("ACCELERATE_FP8_MODULE_FILTER_FN", "lm_head")
    with pytest.raises(ValueError, match="ACCELERATE_FP8_MODULE_FILTER_FN"):
        FP8RecipeKwargs()


def test_explicit_argument_beats_env(monkeypatch):
    setenv(monkeypatch, {"ACCELERATE_FP8_MARGIN": "3", "ACCELERATE_FP8_BACKEND": "te",
                         "ACCELERATE_FP8_SKIP_FIRST_LAST": "0"})
    r = FP8RecipeKwargs(backend="torchao", margin=0, skip_first_last=True)
    assert (r.backend, r.margin, r.skip_first_last) == ("torchao", 0, True)


def test_env_fills_only_unset_fields(monkeypatch):
    setenv(monkeypatch, {"ACCELERATE_FP8_RECIPE": "rowwise", "ACCELERATE_FP8_EXCLUDE": "lm_head"})
    r = FP8RecipeKwargs(backend="torchao")
    assert (r.backend, r.recipe, r.exclude) == ("torchao", "rowwise", ("lm_head",))


def test_environ_argument_is_used_instead_of_os_environ(monkeypatch):
    monkeypatch.setenv("ACCELERATE_FP8_MARGIN", "5")
    env = read_fp8_env({"ACCELERATE_FP8_MARGIN": "2", "UNRELATED": "x"})
    assert env.values == {"margin": "2"}
    assert read_fp8_env({}).values == {}


def test_unrelated_variables_are_ignored(monkeypatch):
    setenv(monkeypatch, {"ACCELERATE_MIXED_PRECISION": "fp8", "ACCELERATE_USE_CPU": "true", "FP8_FOO": "1"})
    assert read_fp8_env().values == {}
    assert FP8RecipeKwargs().describe() == ""


# ---- launcher defaults ------------------------------------------------------------------------
def test_launcher_defaults_alone_set_nothing(monkeypatch):
    setenv(monkeypatch, LAUNCHER_ENV)
    env = read_fp8_env()
    assert env.values == {}
    assert "ACCELERATE_FP8_OPT_LEVEL=O2" in env.launcher_defaults_ignored
    assert "ACCELERATE_FP8_PAD_INNER_DIM=1" in env.launcher_defaults_ignored
    r = FP8RecipeKwargs(backend="torchao")
    assert r.describe() == "backend='torchao'"
    assert r.opt_level is None and r.pad_inner_dim is None and r.use_autocast_during_eval is None


@pytest.mark.parametrize(
    "var,value,field",
    [
        ("ACCELERATE_FP8_OPT_LEVEL", "O2", "opt_level"),
        ("ACCELERATE_FP8_PAD_INNER_DIM", "1", "pad_inner_dim"),
        ("ACCELERATE_FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER", "1", "enable_fsdp_float8_all_gather"),
        ("ACCELERATE_FP8_USE_AUTOCAST_DURING_EVAL", "False", "use_autocast_during_eval"),
        ("ACCELERATE_FP8_MARGIN", "0", "margin"),
        ("ACCELERATE_FP8_AMAX_HISTORY_LEN", "1024", "amax_history_len"),
        ("ACCELERATE_FP8_AMAX_COMPUTE_ALGO", "most_recent", "amax_compute_algo"),
        ("ACCELERATE_FP8_FORMAT", "HYBRID", "fp8_format"),
    ],
)
def test_launcher_default_value_honoured_without_marker(monkeypatch, var, value, field):
    monkeypatch.setenv(var, value)
    assert getattr(FP8RecipeKwargs(), field) is not None
    monkeypatch.setenv(*next(iter(MARKER.items())))
    assert getattr(FP8RecipeKwargs(), field) is None


def test_opt_level_o2_without_marker_is_honoured(monkeypatch):
    setenv(monkeypatch, {"ACCELERATE_FP8_BACKEND": "msamp", "ACCELERATE_FP8_OPT_LEVEL": "O2"})
    assert FP8RecipeKwargs().opt_level == "O2"
    # a level is a preset of storage knobs every backend honours on one process
    monkeypatch.setenv("ACCELERATE_FP8_BACKEND", "torchao")
    assert FP8RecipeKwargs().opt_level == "O2"


def test_opt_level_o3_without_marker_is_an_error_for_torchao(monkeypatch):
    setenv(monkeypatch, {"ACCELERATE_FP8_BACKEND": "torchao", "ACCELERATE_FP8_OPT_LEVEL": "O3"})
    with pytest.raises(ValueError, match="FP8RecipeKwargs.opt_level='O3' is not available with backend 'torchao'"):
        FP8RecipeKwargs()


def test_opt_level_o2_with_marker_is_ignored_for_torchao(monkeypatch):
    setenv(monkeypatch, {"ACCELERATE_FP8_BACKEND": "torchao", "ACCELERATE_FP8_OPT_LEVEL": "O2", **MARKER})
    assert FP8RecipeKwargs().opt_level is None


def test_opt_level_o2_with_lowprec_prefix_always_counts(monkeypatch):
    # O2 equals the launcher's default, yet the lowprec-prefixed key is always an explicit choice.
    setenv(monkeypatch, {**LAUNCHER_ENV, "ACCELERATE_FP8_BACKEND": "msamp", "ACCELERATE_FP8_LOWPREC_OPT_LEVEL": "O2"})
    assert FP8RecipeKwargs().opt_level == "O2"
    monkeypatch.setenv("ACCELERATE_FP8_LOWPREC_OPT_LEVEL", "O3")
    assert FP8RecipeKwargs().opt_level == "O3"
    monkeypatch.setenv("ACCELERATE_FP8_BACKEND", "torchao")  # a level torchao lacks: the key is named
    with pytest.raises(ValueError, match="FP8RecipeKwargs.opt_level='O3'.*ACCELERATE_FP8_LOWPREC_OPT_LEVEL"):
        FP8RecipeKwargs()


def test_value_other_than_launcher_default_is_honoured_with_marker(monkeypatch):
    setenv(monkeypatch, {**LAUNCHER_ENV, "ACCELERATE_FP8_OPT_LEVEL": "O1", "ACCELERATE_FP8_PAD_INNER_DIM": "0",
                         "ACCELERATE_FP8_FORMAT": "E4M3"})
    r = FP8RecipeKwargs()
    assert (r.opt_level, r.pad_inner_dim, r.fp8_format) == ("O1", False, "E4M3")
    assert r.margin is None and r.amax_history_len is None


def test_keys_without_launcher_default_are_honoured_with_marker(monkeypatch):
    setenv(monkeypatch, {**LAUNCHER_ENV, "ACCELERATE_FP8_BACKEND": "torchao", "ACCELERATE_FP8_RECIPE": "rowwise",
                         "ACCELERATE_FP8_EMULATE": "True"})
    r = FP8RecipeKwargs()
    assert (r.backend, r.recipe, r.emulate) == ("torchao", "rowwise", True)


# ---- the `accelerate config` wizard's misnamed keys ---------------------------------------------------
@pytest.mark.parametrize(
    "alias,value,field,expected",
    [
        ("ACCELERATE_FP8_AMAX_HISTORY_LENGTH", "16", "amax_history_len", 16),
        ("ACCELERATE_FP8_AMAX_COMPUTE_ALGORITHM", "max", "amax_compute_algo", "max"),
        ("ACCELERATE_FP8_OPTIMIZATION_LEVEL", "O1", "opt_level", "O1"),
    ],
)
def test_wizard_alias_beside_launcher_default(monkeypatch, alias, value, field, expected):
    setenv(monkeypatch, {**LAUNCHER_ENV, alias: value})
    assert getattr(FP8RecipeKwargs(), field) == expected
    assert read_fp8_env().sources[field] == alias


def test_two_spellings_agreeing_is_fine(monkeypatch):
    setenv(monkeypatch, {"ACCELERATE_FP8_AMAX_HISTORY_LEN": "16", "ACCELERATE_FP8_AMAX_HISTORY_LENGTH": "16"})
    assert FP8RecipeKwargs().amax_history_len == 16


@pytest.mark.parametrize(
    "env",
    [
        {"ACCELERATE_FP8_AMAX_HISTORY_LEN": "16", "ACCELERATE_FP8_AMAX_HISTORY_LENGTH": "32"},
        {"ACCELERATE_FP8_AMAX_HISTORY_LEN": "1024", "ACCELERATE_FP8_AMAX_HISTORY_LENGTH": "16"},  # no marker
        {"ACCELERATE_FP8_FORMAT": "E4M3", "ACCELERATE_FP8_FP8_FORMAT": "HYBRID"},
        {**LAUNCHER_ENV, "ACCELERATE_FP8_OPT_LEVEL": "O1", "ACCELERATE_FP8_OPTIMIZATION_LEVEL": "O3"},
    ],
)
def test_two_spellings_disagreeing_is_an_error(monkeypatch, env):
    setenv(monkeypatch, env)
    with pytest.raises(ValueError, match="set twice in the environment with different values") as err:
        read_fp8_env()
    differing = [k for k in env if k not in LAUNCHER_ENV or env[k] != LAUNCHER_ENV[k]]
    for var in differing:
        assert var in str(err.value)


@pytest.mark.parametrize("env", [
    {"ACCELERATE_FP8_FORMAT": "hybrid", "ACCELERATE_FP8_FP8_FORMAT": "HYBRID"},
    {"ACCELERATE_FP8_NAME": "bf16_with_fp8_mixed", "ACCELERATE_FP8_RECIPE_NAME": "BF16-with-FP8-mixed"},
    {"ACCELERATE_FP8_AMAX_HISTORY_LEN": "16", "ACCELERATE_FP8_AMAX_HISTORY_LENGTH": " 16"},
])
def test_two_spellings_of_one_value_agree(monkeypatch, env):
    # they were refused as different values: the text was compared, not what it means
    setenv(monkeypatch, env)
    assert len(read_fp8_env().values) == 1


def test_lowprec_and_plain_spelling_disagreeing_is_an_error(monkeypatch):
    # margin=3 is not the launcher default, so the user wrote both `margin: 3` and `lowprec_margin: 2`.
    setenv(monkeypatch, {**LAUNCHER_ENV, "ACCELERATE_FP8_MARGIN": "3", "ACCELERATE_FP8_LOWPREC_MARGIN": "2"})
    with pytest.raises(ValueError, match="set twice"):
        read_fp8_env()


def test_lowprec_spelling_beside_a_launcher_default(monkeypatch):
    setenv(monkeypatch, {**LAUNCHER_ENV, "ACCELERATE_FP8_LOWPREC_MARGIN": "0"})
    env = read_fp8_env()
    assert env.values == {"margin": "0"} and env.sources == {"margin": "ACCELERATE_FP8_LOWPREC_MARGIN"}


# ---- unknown and removed keys -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "var", ["ACCELERATE_FP8_FOO", "ACCELERATE_FP8_LOWPREC_FOO", "ACCELERATE_FP8_BACKEND_NAME", "ACCELERATE_FP8_RECIPES"]
)
def test_unknown_key_is_an_error(monkeypatch, var):
    monkeypatch.setenv(var, "1")
    with pytest.raises(ValueError, match=var) as err:
        FP8RecipeKwargs()
    assert "amax_history_len" in str(err.value) and "opt_level" in str(err.value)  # lists known keys


@pytest.mark.parametrize(
    "var,value",
    [
        ("ACCELERATE_FP8_INTERVAL", "2"),
        ("ACCELERATE_FP8_OVERRIDE_FPROP", "True"),
        ("ACCELERATE_FP8_OVERRIDE_DGRAD", "True"),
        ("ACCELERATE_FP8_OVERRIDE_WGRAD", "True"),
    ],
)
def test_removed_te_options_at_other_values_are_errors(monkeypatch, var, value):
    setenv(monkeypatch, {**LAUNCHER_ENV, var: value})
    with pytest.raises(ValueError, match="TransformerEngine removed") as err:
        FP8RecipeKwargs()
    assert var in str(err.value) and repr(value) in str(err.value)


def test_removed_te_options_at_noop_values_are_accepted(monkeypatch):
    setenv(monkeypatch, {"ACCELERATE_FP8_INTERVAL": "1", "ACCELERATE_FP8_OVERRIDE_WGRAD": "false"})
    assert read_fp8_env().values == {}


@pytest.mark.parametrize(
    "var,value", [("ACCELERATE_FP8_LOWPREC_INTERVAL", "2"), ("ACCELERATE_FP8_LOWPREC_OVERRIDE_WGRAD", "True")]
)
def test_removed_te_options_with_lowprec_prefix_are_errors(monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match="TransformerEngine removed"):
        read_fp8_env()


def test_removed_te_override_accepts_zero_as_noop(monkeypatch):
    monkeypatch.setenv("ACCELERATE_FP8_OVERRIDE_DGRAD", "0")
    assert read_fp8_env().values == {}


# ---- MXFP8 -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("var", ["ACCELERATE_FP8_USE_MXFP8_BLOCK_SCALING",
                                 "ACCELERATE_FP8_LOWPREC_USE_MXFP8_BLOCK_SCALING"])
@pytest.mark.parametrize("value", ["true", "True", "1"])
def test_mxfp8_flag_selects_mxfp8(monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    env = read_fp8_env()
    assert env.values == {"recipe": "mxfp8"}
    assert env.sources["recipe"].endswith("USE_MXFP8_BLOCK_SCALING")


@pytest.mark.parametrize("value", ["false", "False", "0", ""])
def test_mxfp8_flag_off_selects_nothing(monkeypatch, value):
    monkeypatch.setenv("ACCELERATE_FP8_USE_MXFP8_BLOCK_SCALING", value)
    assert read_fp8_env().values == {}


@pytest.mark.parametrize("value", ["maybe", "2", "mxfp8"])
def test_mxfp8_flag_that_is_no_boolean_is_refused(monkeypatch, value):
    monkeypatch.setenv("ACCELERATE_FP8_USE_MXFP8_BLOCK_SCALING", value)
    with pytest.raises(ValueError, match=f"ACCELERATE_FP8_USE_MXFP8_BLOCK_SCALING='{value}' is not a boolean"):
        read_fp8_env()


def test_mxfp8_flag_agreeing_with_recipe(monkeypatch):
    setenv(monkeypatch, {"ACCELERATE_FP8_USE_MXFP8_BLOCK_SCALING": "1", "ACCELERATE_FP8_RECIPE": "MXFP8"})
    assert read_fp8_env().values["recipe"] == "mxfp8"


def test_mxfp8_flag_contradicting_recipe(monkeypatch):
    setenv(monkeypatch, {"ACCELERATE_FP8_USE_MXFP8_BLOCK_SCALING": "1", "ACCELERATE_FP8_RECIPE": "tensorwise"})
    with pytest.raises(ValueError, match="ACCELERATE_FP8_RECIPE='tensorwise'"):
        read_fp8_env()


def test_mxfp8_flag_selects_the_te_mxfp8_recipe(monkeypatch):
    setenv(monkeypatch, {"ACCELERATE_FP8_USE_MXFP8_BLOCK_SCALING": "1", "ACCELERATE_FP8_BACKEND": "te"})
    r = FP8RecipeKwargs()
    assert (r.backend, r.recipe) == ("te", "mxfp8")


def test_mxfp8_with_torchao_backend_is_rejected(monkeypatch):
    setenv(monkeypatch, {"ACCELERATE_FP8_USE_MXFP8_BLOCK_SCALING": "1", "ACCELERATE_FP8_BACKEND": "torchao"})
    with pytest.raises(ValueError, match="FP8RecipeKwargs.recipe='mxfp8' is not a recipe of backend 'torchao'"):
        FP8RecipeKwargs()


# ---- errors say where a value came from -------------------------------------------------------------------
@pytest.mark.parametrize(
    "var,value,field",
    [
        ("ACCELERATE_FP8_MARGIN", "x", "margin"),
        ("ACCELERATE_FP8_LOWPREC_AMAX_HISTORY_LEN", "0", "amax_history_len"),
        ("ACCELERATE_FP8_AMAX_HISTORY_LENGTH", "-4", "amax_history_len"),
        ("ACCELERATE_FP8_MARGIN", "16", "margin"),
        ("ACCELERATE_FP8_LOWPREC_AMAX_HISTORY_LEN", "1000000000", "amax_history_len"),
        ("ACCELERATE_FP8_FORMAT", "E5M2", "fp8_format"),
        ("ACCELERATE_FP8_BACKEND", "cuda", "backend"),
        ("ACCELERATE_FP8_SKIP_FIRST_LAST", "perhaps", "skip_first_last"),
        ("ACCELERATE_FP8_SKIP_FIRST_BLOCKS", "-1", "skip_first_blocks"),
        ("ACCELERATE_FP8_LOWPREC_SKIP_LAST_BLOCKS", "two", "skip_last_blocks"),
        ("ACCELERATE_FP8_OPTIMIZATION_LEVEL", "O9", "opt_level"),
        ("ACCELERATE_FP8_EXCLUDE", "lm_head,", "exclude"),
    ],
)
def test_bad_env_value_names_the_variable(monkeypatch, var, value, field):
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError) as err:
        FP8RecipeKwargs()
    assert f"FP8RecipeKwargs.{field}" in str(err.value)
    assert f"environment variable {var}" in str(err.value)


@pytest.mark.parametrize("var,value,accepted", [
    ("ACCELERATE_FP8_MARGIN", "--1", ">= 0 and <= 8"),
    ("ACCELERATE_FP8_MARGIN", "\u00b2", ">= 0 and <= 8"),
    ("ACCELERATE_FP8_AMAX_HISTORY_LEN", "\u00b2", ">= 1 and <= 65536"),
    ("ACCELERATE_FP8_AMAX_HISTORY_LENGTH", "--16", ">= 1 and <= 65536"),
    ("ACCELERATE_FP8_SKIP_FIRST_BLOCKS", "--2", ">= 0"),
    ("ACCELERATE_FP8_LOWPREC_SKIP_LAST_BLOCKS", "\u0663", ">= 0"),
])
def test_bad_integer_in_env_names_the_variable_and_the_accepted_values(monkeypatch, var, value, accepted):
    # str.isdigit() let these through to int(), whose own message named neither
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError) as err:
        FP8RecipeKwargs()
    assert f"must be an integer {accepted}" in str(err.value)
    assert f"environment variable {var}" in str(err.value)


def test_env_option_no_auto_backend_honours_with_the_code_names_the_variable(monkeypatch):
    monkeypatch.setenv("ACCELERATE_FP8_LOWPREC_MARGIN", "4")
    with pytest.raises(ValueError, match=r"backend='auto'\): no backend can honour.*environment variable "
                                         "ACCELERATE_FP8_LOWPREC_MARGIN"):
        FP8RecipeKwargs(recipe="tensorwise")


@pytest.mark.parametrize(
    "env,var",
    [
        ({"ACCELERATE_FP8_BACKEND": "torchao", "ACCELERATE_FP8_OPT_LEVEL": "O3"}, "ACCELERATE_FP8_OPT_LEVEL"),
        ({"ACCELERATE_FP8_BACKEND": "torchao", "ACCELERATE_FP8_AMAX_HISTORY_LEN": "1024"},
         "ACCELERATE_FP8_AMAX_HISTORY_LEN"),
    ],
)
def test_env_value_the_backend_rejects_names_the_variable(monkeypatch, env, var):
    setenv(monkeypatch, env)
    with pytest.raises(ValueError) as err:
        FP8RecipeKwargs()
    assert var in str(err.value)


def test_yaml_list_exported_by_the_launcher_is_honoured(monkeypatch):
    # `exclude: [lm_head, "layers.0.*"]` in fp8_config reaches the script as this string (the list's Python repr).
    setenv(monkeypatch, {**LAUNCHER_ENV, "ACCELERATE_FP8_EXCLUDE": "['lm_head', 'layers.0.*']"})
    assert FP8RecipeKwargs().exclude == ("lm_head", "layers.0.*")


def test_broken_list_in_the_environment_is_rejected(monkeypatch):
    monkeypatch.setenv("ACCELERATE_FP8_EXCLUDE", "['lm_head', 'layers.0.*'")
    with pytest.raises(ValueError) as err:
        FP8RecipeKwargs()
    assert str(err.value) == ("FP8RecipeKwargs.exclude=\"['lm_head', 'layers.0.*'\" looks like a list but does not "
                              "parse as one (read from environment variable ACCELERATE_FP8_EXCLUDE)")


# ---- a real `accelerate launch` -------------------------------------------------------------------------
SCRIPT = """
import json
from lowprec import FP8RecipeKwargs

r = FP8RecipeKwargs()
print("FIELDS=" + json.dumps({k: v for k, v in r.to_dict().items() if k != "module_filter_fn"}))
"""

CONFIG = """
compute_environment: LOCAL_MACHINE
distributed_type: 'NO'
mixed_precision: fp8
num_processes: 1
use_cpu: true
fp8_config:
  backend: torchao
  recipe: rowwise
  exclude: lm_head,layers.0.*
  skip_first_last: false
  emulate: true
  amax_history_length: 1
  lowprec_skip_slow_shapes: false
"""


def test_accelerate_launch_config_file(tmp_path):
    script = tmp_path / "show_recipe.py"
    script.write_text(SCRIPT)
    config = tmp_path / "fp8.yaml"
    # amax_history_length (the wizard's name) is given no delayed recipe to apply to: expect an error
    # for it first, then run without it.
    config.write_text(textwrap.dedent(CONFIG))
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "1",
           "--config_file", str(config), str(script)]
    failed = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert failed.returncode != 0
    assert "FP8RecipeKwargs.amax_history_len=1 applies to delayed" in failed.stderr + failed.stdout

    config.write_text(textwrap.dedent(CONFIG).replace("  amax_history_length: 1\n", ""))
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("FIELDS="))
    fields = json.loads(line[len("FIELDS="):])
    assert fields == {
        "backend": "torchao",
        "recipe": "rowwise",
        "fp8_format": None,  # launcher's FORMAT=HYBRID ignored (rowwise would reject it)
        "margin": None,
        "amax_history_len": None,
        "amax_compute_algo": None,
        "opt_level": None,  # launcher's OPT_LEVEL=O2 ignored
        "include": None,
        "exclude": ["lm_head", "layers.0.*"],
        "skip_first_last": False,
        "skip_slow_shapes": False,
        "pad_inner_dim": None,  # launcher's PAD_INNER_DIM=1 ignored
        "enable_fsdp_float8_all_gather": None,  # launcher's =1 ignored (rowwise would reject it)
        "use_autocast_during_eval": None,  # launcher's =False ignored (torchao would reject it)
        "fp8_weights": None,
        "weight_dtype": None,
        "weight_grad_dtype": None,
        "grad_comm_dtype": None,
        "emulate": True,
        "optimizer_states": None,
        "compile_fp8_layers": None,
        "skip_first_blocks": 0,
        "skip_last_blocks": 0,
        "name": None,
        "activation_dtype": None,
        "reduce_amax": None,  # unset: a current-scaling recipe such as rowwise would refuse it
        "optimizer_in_backward": None,
    }
