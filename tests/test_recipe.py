"""`FP8RecipeKwargs`: parsing, validation against the backend, and the KwargsHandler surface."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from lowprec import FP8RecipeKwargs

# Every error names the option as `FP8RecipeKwargs.<field>` and says what is accepted.
BAD_VALUES = [
    ("backend", "cuda", ["'auto'", "'torchao'", "'te'", "'msamp'"]),
    ("backend", 3, ["'auto'", "'torchao'"]),
    ("recipe", "", ["recipe name"]),
    ("recipe", 7, ["recipe name"]),
    ("recipe", "delayed_tensorwise", ["torchao:tensorwise", "torchao:rowwise"]),
    ("fp8_format", "E4M3FN", ["'HYBRID'", "'E4M3'"]),
    ("fp8_format", "fp16", ["'HYBRID'", "'E4M3'"]),
    ("margin", -1, [">= 0"]),
    ("margin", "-3", [">= 0"]),
    ("margin", 1.5, [">= 0"]),
    ("margin", True, [">= 0"]),
    ("margin", "two", [">= 0"]),
    ("amax_history_len", 0, [">= 1"]),
    ("amax_history_len", "16.0", [">= 1"]),
    ("amax_history_len", 10**9, [">= 1", "<= 65536", "TE's default is 1024"]),
    ("margin", 9, [">= 0", "<= 8", "power-of-2 backoff", "E4M3"]),
    ("margin", 200, ["<= 8", "underflow"]),
    ("amax_compute_algo", "mean", ["'max'", "'most_recent'"]),
    ("opt_level", "O4", ["'O1'", "'O2'", "'O3'"]),
    ("opt_level", 2, ["'O1'", "'O2'", "'O3'"]),
    ("include", 5, ["comma-separated string"]),
    ("include", ["lm_head", ""], ["non-empty string"]),
    ("exclude", ["lm_head", 3], ["non-empty string"]),
    ("exclude", "lm_head,,head", ["non-empty string"]),
    ("skip_first_last", "maybe", ["'true'/'false'"]),
    ("skip_slow_shapes", 2, ["'true'/'false'"]),
    ("pad_inner_dim", "enabled", ["'true'/'false'"]),
    ("enable_fsdp_float8_all_gather", "y", ["'true'/'false'"]),
    ("use_autocast_during_eval", 0.0, ["'true'/'false'"]),
    ("emulate", "auto", ["'true'/'false'"]),
    ("compile_fp8_layers", "sometimes", ["'true'/'false'"]),
    ("fp8_weights", "sometimes", ["'true'/'false'"]),
    ("weight_dtype", "fp8", ["'fp32'", "'fp16'", "'bf16'"]),
    ("weight_dtype", 16, ["'fp32'", "'fp16'", "'bf16'"]),
    ("weight_grad_dtype", "fp16", ["'fp32'", "'bf16'", "'fp8'"]),
    ("weight_grad_dtype", "int8", ["'fp32'", "'bf16'", "'fp8'"]),
    ("grad_comm_dtype", "fp16", ["'fp32'", "'bf16'", "'fp8'"]),
    ("module_filter_fn", "lm_head", ["fn(module, fqn)"]),
    ("module_filter_fn", lambda module: True, ["fn(module, fqn)"]),  # failed at prepare() with a bare TypeError
    ("module_filter_fn", lambda module, fqn, extra: True, ["fn(module, fqn)"]),
    ("optimizer_states", "fp4", ["optimizer_states='fp4' is not", "'fp32'", "'fp8'", "'e4m3'", "('e4m3', 'fp16')"]),
    ("include", b"abc", ["include=b'abc' must be a list of module-name patterns"]),
    ("optimizer_states", ("e4m3",), ["'fp32'", "'fp8'"]),
    ("optimizer_states", ("e4m3", "int8"), ["'e5m2'"]),
    ("optimizer_states", "e4m3+fp16+fp32", ["'e4m3+fp16'"]),
    ("optimizer_states", 8, ["'fp8'"]),
    ("skip_first_blocks", -1, ["integer >= 0", "transformer blocks"]),
    ("skip_first_blocks", "x", ["integer >= 0"]),
    ("skip_first_blocks", True, ["integer >= 0"]),
    ("skip_last_blocks", "-2", ["integer >= 0", "transformer blocks"]),
    ("skip_last_blocks", 1.5, ["integer >= 0"]),
    ("skip_last_blocks", "1.0", ["integer >= 0"]),
    # int() reads these, or fails with its own message; str.isdigit() let them through to it
    ("amax_history_len", "\u00b2", [">= 1", "<= 65536"]),
    ("margin", "--1", [">= 0", "<= 8"]),
    ("margin", "\u0663", [">= 0", "<= 8"]),  # Arabic-Indic 3
    ("skip_first_blocks", "--2", ["integer >= 0", "transformer blocks"]),
    ("skip_last_blocks", "\u00b9", ["integer >= 0"]),
    ("amax_history_len", "1" * 5000, ["<= 65536"]),  # past int()'s digit limit
    ("name", "no_such_recipe", ["is not a named recipe; known:", "msamp_o2", "`lowprec recipes`"]),
    ("name", 3, ["must be a recipe name"]),
    ("name", "fp16_mixed", ["is not offered by lowprec", "not an FP8 recipe"]),
    ("activation_dtype", "bf16", ["'fp8'", "None", "'off'", "autocast"]),
    ("activation_dtype", "e5m2", ["'fp8'", "None"]),
    ("activation_dtype", 8, ["'fp8'", "None"]),
    ("reduce_amax", "sometimes", ["'true'/'false'"]),
    ("reduce_amax", 2, ["'true'/'false'"]),
    ("optimizer_in_backward", "sometimes", ["'true'/'false'"]),
    ("optimizer_in_backward", 2, ["'true'/'false'"]),
]


@pytest.mark.parametrize("field,value,accepted", BAD_VALUES, ids=lambda x: repr(x)[:30])
def test_bad_value_names_field_and_accepted_values(field, value, accepted):
    with pytest.raises(ValueError) as err:
        FP8RecipeKwargs(**{field: value})
    message = str(err.value)
    assert f"FP8RecipeKwargs.{field}" in message
    for fragment in accepted:
        assert fragment in message


def test_every_field_has_a_bad_value_case():
    fields = {f.name for f in dataclasses.fields(FP8RecipeKwargs)}
    assert fields == {field for field, _, _ in BAD_VALUES}


def test_defaults():
    r = FP8RecipeKwargs()
    assert (r.backend, r.recipe, r.exclude, r.include) == ("auto", None, (), None)
    # the output head converts by default (measured: docs/performance.md); slow shapes stay high precision
    assert r.skip_first_last is False and r.skip_slow_shapes is True
    assert r.opt_level is None and r.pad_inner_dim is None and r.emulate is None


# ---- backend names ---------------------------------------------------------------------------
@pytest.mark.parametrize("alias", ["AO", "ao", "torchao", " TorchAO "])
def test_torchao_aliases(alias):
    assert FP8RecipeKwargs(backend=alias).backend == "torchao"


@pytest.mark.parametrize("alias", ["auto", "AUTO"])
def test_auto(alias):
    assert FP8RecipeKwargs(backend=alias).backend == "auto"


@pytest.mark.parametrize("alias", ["TE", "transformer_engine", "Transformer-Engine", "te"])
def test_te_aliases(alias):
    assert FP8RecipeKwargs(backend=alias).backend == "te"


@pytest.mark.parametrize("alias", ["msamp", "ms-amp", "MS_AMP"])
def test_msamp_aliases(alias):
    assert FP8RecipeKwargs(backend=alias).backend == "msamp"


@pytest.mark.parametrize("value,canonical", [("fp16", "fp16"), ("float16", "fp16"), ("torch.bfloat16", "bf16"),
                                             ("BF16", "bf16"), ("half", "fp16")])
def test_weight_dtype_spellings(value, canonical):
    assert FP8RecipeKwargs(backend="msamp", weight_dtype=value).weight_dtype == canonical


@pytest.mark.parametrize("backend", ["torchao", "te", "msamp"])
@pytest.mark.parametrize("weight", ["fp32", "fp16", "bf16"])
def test_weight_dtype_for_every_backend(backend, weight):
    assert FP8RecipeKwargs(backend=backend, weight_dtype=weight).weight_dtype == weight


@pytest.mark.parametrize("value, canonical", [("fp8", "fp8"), ("e4m3", "fp8"), ("BF16", "bf16"),
                                              ("torch.float32", "fp32")])
def test_weight_grad_dtype_spellings(value, canonical):
    assert FP8RecipeKwargs(backend="torchao", weight_grad_dtype=value).weight_grad_dtype == canonical


@pytest.mark.parametrize("grad", ["fp32", "bf16"])
def test_msamp_keeps_weight_gradients_in_fp8_only(grad):
    with pytest.raises(ValueError, match=f"weight_grad_dtype='{grad}' cannot be honoured by backend 'msamp'.*'fp8'"):
        FP8RecipeKwargs(backend="msamp", weight_grad_dtype=grad)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_fp32_gradients_of_fp16_weights_are_refused(level):
    # the message names the weight dtype as the level implies it, not as if the user had written it
    with pytest.raises(ValueError, match=rf"weight_grad_dtype='fp32' cannot be kept with weight_dtype='fp16' "
                                         rf"\(from opt_level='{level}'\): fp16 weights have no FP32 master"):
        FP8RecipeKwargs(backend="torchao", opt_level=level, weight_grad_dtype="fp32")
    with pytest.raises(ValueError, match=r"weight_grad_dtype='fp32' cannot be kept with weight_dtype='bf16':"):
        FP8RecipeKwargs(backend="te", weight_dtype="bf16", weight_grad_dtype="fp32")
    # with FP32 weights the level's other parts still apply
    r = FP8RecipeKwargs(backend="torchao", opt_level=level, weight_dtype="fp32", weight_grad_dtype="fp32")
    assert (r.opt_level, r.weight_dtype, r.weight_grad_dtype) == (level, "fp32", "fp32")


def test_fp8_weights_and_weight_storage_knobs_are_one_choice():
    with pytest.raises(ValueError, match="fp8_weights=True keeps TE's FP8 weights.*weight_dtype='bf16'"):
        FP8RecipeKwargs(backend="te", fp8_weights=True, weight_dtype="bf16")
    with pytest.raises(ValueError) as err:  # only what was set: no "weight_dtype=None"
        FP8RecipeKwargs(backend="te", fp8_weights=True, weight_grad_dtype="bf16")
    assert "combined with weight_grad_dtype='bf16'; set one" in str(err.value) and "None" not in str(err.value)


# ---- recipes -----------------------------------------------------------------------------------
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp", "RowWise"])
def test_torchao_recipes(recipe):
    assert FP8RecipeKwargs(backend="torchao", recipe=recipe).recipe == recipe.lower()


@pytest.mark.parametrize("recipe", ["delayed", "mxfp8", "block", "nope"])
def test_recipe_not_offered_by_torchao_lists_offered(recipe):
    with pytest.raises(ValueError, match="FP8RecipeKwargs.recipe") as err:
        FP8RecipeKwargs(backend="torchao", recipe=recipe)
    message = str(err.value)
    assert repr(recipe) in message and "'torchao'" in message
    for offered in ("'tensorwise'", "'rowwise'", "'rowwise_with_gw_hp'"):
        assert offered in message


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise_with_gw_hp", "delayed", "mxfp8"])
def test_auto_accepts_a_recipe_any_backend_offers(recipe):
    assert FP8RecipeKwargs(recipe=recipe).recipe == recipe


def test_auto_rejects_a_recipe_no_backend_offers():
    with pytest.raises(ValueError, match="not a recipe of any backend") as err:
        FP8RecipeKwargs(recipe="blockwise_fp4")
    assert "torchao:rowwise" in str(err.value) and "te:delayed" in str(err.value)


# ---- formats -----------------------------------------------------------------------------------
@pytest.mark.parametrize("given,expected", [("hybrid", "HYBRID"), ("e4m3", "E4M3"), (" E4M3 ", "E4M3")])
def test_fp8_format_is_normalised(given, expected):
    assert FP8RecipeKwargs(fp8_format=given).fp8_format == expected


@pytest.mark.parametrize("value", ["E5M2", "e5m2"])
def test_e5m2_is_explained(value):
    with pytest.raises(ValueError, match="FP8RecipeKwargs.fp8_format") as err:
        FP8RecipeKwargs(fp8_format=value)
    assert "pure E5M2 training is not supported" in str(err.value)
    assert "'HYBRID'" in str(err.value)


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_with_gw_hp"])
def test_rowwise_is_e4m3_only(recipe):
    assert FP8RecipeKwargs(backend="torchao", recipe=recipe, fp8_format="E4M3").fp8_format == "E4M3"
    with pytest.raises(ValueError, match=r"FP8RecipeKwargs.fp8_format='HYBRID' cannot be used .*'E4M3'"):
        FP8RecipeKwargs(backend="torchao", recipe=recipe, fp8_format="HYBRID")


def test_tensorwise_accepts_both_formats():
    for fmt in ("HYBRID", "E4M3"):
        assert FP8RecipeKwargs(backend="torchao", fp8_format=fmt).fp8_format == fmt


# ---- options a torchao recipe cannot honour ------------------------------------------------------
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
@pytest.mark.parametrize(
    "field,value", [("margin", 1), ("amax_history_len", 16), ("amax_history_len", 1024), ("amax_compute_algo", "max")]
)
def test_delayed_scaling_options_rejected_for_current_scaling(recipe, field, value):
    with pytest.raises(ValueError, match=f"FP8RecipeKwargs.{field}=") as err:
        FP8RecipeKwargs(backend="torchao", recipe=recipe, **{field: value})
    assert "delayed" in str(err.value) and "current tensor" in str(err.value)


# ---- reduce_amax: delayed scaling only ------------------------------------------------------------
@pytest.mark.parametrize("backend,recipe", [("torchao", "tensorwise"), ("torchao", "rowwise"),
                                            ("torchao", "rowwise_with_gw_hp"), ("te", "current"), ("te", "block"),
                                            ("te", "mxfp8"), ("te", "tensorwise")])
@pytest.mark.parametrize("value,shown", [(False, False), (True, True), ("0", False)])
def test_reduce_amax_refused_by_name_for_current_scaling(backend, recipe, value, shown):
    # Both values: with no amax history, on and off are equally meaningless, and either is a misunderstanding.
    with pytest.raises(ValueError) as err:
        FP8RecipeKwargs(backend=backend, recipe=recipe, reduce_amax=value)
    message = str(err.value)
    assert f"FP8RecipeKwargs.reduce_amax={shown!r}" in message
    assert "applies to delayed (amax-history) scaling" in message and "current tensor" in message
    assert "te:delayed" in message and "msamp:delayed" in message


@pytest.mark.parametrize("backend,recipe", [("te", "delayed"), ("te", "delayed_scaling"), ("te", None),
                                            ("msamp", "delayed"), ("msamp", None)])
@pytest.mark.parametrize("value,expected", [(None, None), (True, True), (False, False), ("off", False), ("1", True)])
def test_reduce_amax_accepted_by_delayed_recipes(backend, recipe, value, expected):
    assert FP8RecipeKwargs(backend=backend, recipe=recipe, reduce_amax=value).reduce_amax is expected


def test_reduce_amax_refused_from_the_environment_names_the_variable(monkeypatch):
    monkeypatch.setenv("ACCELERATE_FP8_REDUCE_AMAX", "false")
    with pytest.raises(ValueError, match=r"reduce_amax=False applies to delayed .*ACCELERATE_FP8_REDUCE_AMAX"):
        FP8RecipeKwargs(backend="torchao")
    assert FP8RecipeKwargs(backend="msamp").reduce_amax is False


def test_reduce_amax_refused_for_a_delayed_recipe_that_does_not_offer_it():
    """A plug-in's delayed recipe that does not declare `reduces_amax` gets no promise it cannot keep."""
    from lowprec.frontend.specs import BackendSpec, RecipeInfo

    spec = BackendSpec(name="plug", display_name="plug", adapter="x:Y", default_recipe="hist",
                       recipes={"hist": RecipeInfo("hist", "history", ("HYBRID",), delayed=True)})
    spec.check_recipe(FP8RecipeKwargs(backend="msamp"))  # reduce_amax unset: nothing to refuse
    with pytest.raises(ValueError) as err:
        spec.check_recipe(FP8RecipeKwargs(backend="msamp", reduce_amax=False))
    assert "FP8RecipeKwargs.reduce_amax=False cannot be honoured by plug recipe 'hist'" in str(err.value)
    assert "te:delayed, msamp:delayed" in str(err.value)
    with pytest.raises(ValueError, match="reduces_amax=True needs delayed=True"):
        RecipeInfo("cur", "current", ("HYBRID",), reduces_amax=True)


def test_reduce_amax_with_auto_passes_over_current_scaling_backends():
    from lowprec.backends import auto_choice
    from lowprec.backends.context import RunContext
    from lowprec.planning.hardware import DeviceInfo

    context = RunContext(device=DeviceInfo("cpu", "CPU", None), compiled=True)  # torchao first, then te, then msamp
    cls, passed_over = auto_choice(FP8RecipeKwargs(reduce_amax=False), context)
    assert any(line.startswith("torchao: FP8RecipeKwargs.reduce_amax=False applies to delayed")
               for line in passed_over)
    assert cls is not None and cls.name != "torchao"


def test_margin_zero_is_a_noop_for_torchao():
    assert FP8RecipeKwargs(backend="torchao", margin=0).margin == 0


def test_delayed_options_accepted_with_auto():
    r = FP8RecipeKwargs(margin=2, amax_history_len="16", amax_compute_algo="MAX")
    assert (r.margin, r.amax_history_len, r.amax_compute_algo) == (2, 16, "max")


def test_opt_level_o3_is_msamps():
    assert FP8RecipeKwargs(backend="msamp", opt_level="o3").opt_level == "O3"  # where it runs: at prepare()


@pytest.mark.parametrize("level", ["O1", "o2"])
def test_opt_level_o1_o2_accepted_by_msamp_which_honours_the_whole_row(level):
    assert FP8RecipeKwargs(backend="msamp", opt_level=level).opt_level == level.upper()


@pytest.mark.parametrize("backend", ["torchao", "te", "msamp"])
@pytest.mark.parametrize("level", ["O1", "o2"])
def test_levels_o1_o2_are_presets_of_the_storage_knobs_for_every_backend(backend, level):
    from lowprec.frontend.specs import backend_spec

    r = FP8RecipeKwargs(backend=backend, opt_level=level)
    storage = backend_spec(backend).storage(r)
    assert storage == {"opt_level": level.upper(), "weight_dtype": "fp16", "weight_grad_dtype": "fp8",
                       "optimizer_states": "fp32" if level.upper() == "O1" else "fp8"}
    # an explicit knob wins over the level's value
    assert backend_spec(backend).storage(r.replace(weight_dtype="bf16"))["weight_dtype"] == "bf16"


@pytest.mark.parametrize("backend", ["torchao", "te"])
def test_o3_names_the_levels_and_knobs_that_exist(backend):
    with pytest.raises(ValueError) as err:
        FP8RecipeKwargs(backend=backend, opt_level="O3")
    message = str(err.value)
    assert f"opt_level='O3' is not available with backend {backend!r}" in message and "'O1', 'O2'" in message
    assert "weight_dtype, weight_grad_dtype, optimizer_states" in message
    assert "backend='msamp' under FSDP2" in message


@pytest.mark.parametrize("backend", ["torchao", "te", "msamp"])
@pytest.mark.parametrize("value, expected", [("fp8", "fp8"), ("FP32", "fp32"), (("e4m3", "fp16"), "fp8"),
                                             ("e4m3,e4m3", "e4m3+e4m3"), (["bf16", "fp32"], "bf16+fp32"),
                                             ("float8_e5m2+float16", "e5m2+fp16")])
def test_optimizer_states_for_every_backend(backend, value, expected):
    assert FP8RecipeKwargs(backend=backend, optimizer_states=value).optimizer_states == expected


def test_optimizer_states_overrides_its_level_like_every_storage_knob():
    from lowprec.frontend.specs import backend_spec

    r = FP8RecipeKwargs(backend="msamp", opt_level="O1", optimizer_states="fp8")
    assert backend_spec("msamp").storage(r)["optimizer_states"] == "fp8"
    assert backend_spec("msamp").storage(r.replace(optimizer_states=None))["optimizer_states"] == "fp32"


def test_opt_level_and_fp8_weights_both_choose_the_weights_and_the_optimizer():
    with pytest.raises(ValueError, match="fp8_weights=True and opt_level='O2' both choose the weights and the"):
        FP8RecipeKwargs(backend="te", fp8_weights=True, opt_level="O2")


@pytest.mark.parametrize("value, expected", [("fp8", "fp8"), ("bf16", "bf16"), ("fp16", "fp16"), ("fp32", "fp32"),
                                             (("e4m3", "bf16"), "e4m3+bf16")])
def test_optimizer_states_with_fp8_weights_are_fused_adams_moments(value, expected):
    assert FP8RecipeKwargs(backend="te", fp8_weights=True, optimizer_states=value).optimizer_states == expected


@pytest.mark.parametrize("value", ["e5m2+fp16", ("e4m3", "e5m2")])
def test_optimizer_states_fused_adam_cannot_keep_are_refused_by_name(value):
    with pytest.raises(ValueError, match=r"optimizer_states='.*' with fp8_weights=True: TE's FusedAdam keeps Adam's "
                                         r"moments in 'fp32', 'bf16', 'fp16', 'e4m3' .* not 'e5m2'"):
        FP8RecipeKwargs(backend="te", fp8_weights=True, optimizer_states=value)


@pytest.mark.parametrize("value", ["none", "None", "O0", ""])
def test_opt_level_none_spellings(value):
    assert FP8RecipeKwargs(backend="torchao", opt_level=value).opt_level is None


@pytest.mark.parametrize("value", [False, "false", "0"])
def test_fp8_off_in_eval_rejected_for_torchao(value):
    with pytest.raises(ValueError, match="FP8RecipeKwargs.use_autocast_during_eval=False cannot be honoured"):
        FP8RecipeKwargs(backend="torchao", use_autocast_during_eval=value)


def test_fp8_in_eval_accepted_for_torchao():
    assert FP8RecipeKwargs(backend="torchao", use_autocast_during_eval=True).use_autocast_during_eval is True


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_with_gw_hp"])
def test_fsdp_fp8_all_gather_only_for_tensorwise(recipe):
    assert FP8RecipeKwargs(backend="torchao", enable_fsdp_float8_all_gather=True).enable_fsdp_float8_all_gather
    assert FP8RecipeKwargs(backend="torchao", recipe=recipe, enable_fsdp_float8_all_gather=False)
    message = f"enable_fsdp_float8_all_gather=True cannot be honoured by torchao recipe '{recipe}'"
    with pytest.raises(ValueError, match=message):
        FP8RecipeKwargs(backend="torchao", recipe=recipe, enable_fsdp_float8_all_gather=True)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_pad_inner_dim_accepted_by_every_torchao_recipe(recipe):
    # torchao pads the data of both GEMM operands along K; the scales lie along the outer dims.
    assert FP8RecipeKwargs(backend="torchao", recipe=recipe, pad_inner_dim=True).pad_inner_dim is True


def test_emulate_accepted_by_torchao():
    assert FP8RecipeKwargs(backend="torchao", emulate="yes").emulate is True


# ---- parsing --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "value,expected",
    [
        ("lm_head", ("lm_head",)),
        ("lm_head, *.mlp.*", ("lm_head", "*.mlp.*")),
        (["lm_head", "layers.0.*"], ("lm_head", "layers.0.*")),
        (("a",), ("a",)),
        ([], ()),
    ],
)
@pytest.mark.parametrize("field", ["include", "exclude"])
def test_patterns(field, value, expected):
    assert getattr(FP8RecipeKwargs(**{field: value}), field) == expected


@pytest.mark.parametrize(
    "value,expected",
    [("1", True), ("true", True), ("True", True), (" on ", True), (1, True), (True, True),
     ("0", False), ("false", False), ("FALSE", False), ("off", False), (0, False), (False, False)],
)
@pytest.mark.parametrize("field", ["skip_first_last", "skip_slow_shapes", "pad_inner_dim", "emulate"])
def test_bools(field, value, expected):
    assert getattr(FP8RecipeKwargs(**{field: value}), field) is expected


@pytest.mark.parametrize("value,expected", [(None, 0), (0, 0), (2, 2), ("3", 3), (" 12 ", 12), (1000, 1000)])
@pytest.mark.parametrize("field", ["skip_first_blocks", "skip_last_blocks"])
def test_block_counts(field, value, expected):
    # no upper bound here: the recipe does not know the model, planning checks the blocks it has
    assert getattr(FP8RecipeKwargs(**{field: value}), field) == expected


def test_new_fields_come_last_so_positional_construction_is_unchanged():
    assert [f.name for f in dataclasses.fields(FP8RecipeKwargs)] == [
        "backend", "recipe", "fp8_format", "margin", "amax_history_len", "amax_compute_algo", "opt_level", "include",
        "exclude", "skip_first_last", "skip_slow_shapes", "module_filter_fn", "pad_inner_dim",
        "enable_fsdp_float8_all_gather", "use_autocast_during_eval", "fp8_weights", "weight_dtype", "emulate",
        "optimizer_states", "weight_grad_dtype", "grad_comm_dtype", "compile_fp8_layers", "skip_first_blocks",
        "skip_last_blocks", "name", "activation_dtype", "reduce_amax", "optimizer_in_backward"]
    r = FP8RecipeKwargs("torchao", "rowwise", None, None, None, None, None, None, ["lm_head"], True)
    assert (r.backend, r.recipe, r.exclude, r.skip_first_last, r.skip_first_blocks) == (
        "torchao", "rowwise", ("lm_head",), True, 0)


@pytest.mark.parametrize("value,expected", [("3", 3), (" 8 ", 8), (0, 0), ("0", 0), ("+2", 2), ("-0", 0)])
def test_margin_from_string(value, expected):
    assert FP8RecipeKwargs(margin=value).margin == expected


def test_amax_history_len_from_string():
    assert FP8RecipeKwargs(amax_history_len="1024").amax_history_len == 1024


def test_bounds_are_inclusive():
    r = FP8RecipeKwargs(backend="te", margin=8, amax_history_len=65536)
    assert (r.margin, r.amax_history_len) == (8, 65536)


def test_module_filter_fn_kept():
    def keep(module, fqn):
        return fqn != "lm_head"

    assert FP8RecipeKwargs(module_filter_fn=keep).module_filter_fn is keep


# ---- replace / to_kwargs / describe -----------------------------------------------------------------
def test_replace_revalidates():
    base = FP8RecipeKwargs(backend="torchao", recipe="rowwise")
    with pytest.raises(ValueError, match="FP8RecipeKwargs.fp8_format='HYBRID'"):
        base.replace(fp8_format="HYBRID")
    with pytest.raises(ValueError, match="FP8RecipeKwargs.margin"):
        base.replace(margin=2)
    with pytest.raises(ValueError, match="FP8RecipeKwargs.recipe='rowwise' is not a recipe of backend 'te'"):
        base.replace(backend="te")


def test_replace_parses_and_keeps_other_fields():
    base = FP8RecipeKwargs(backend="torchao", recipe="rowwise", exclude=["lm_head"])
    changed = base.replace(recipe="TENSORWISE", skip_first_last="1")
    assert (changed.recipe, changed.skip_first_last, changed.exclude) == ("tensorwise", True, ("lm_head",))
    assert base.recipe == "rowwise" and base.skip_first_last is False  # original untouched


def test_to_kwargs_default_is_empty():
    assert FP8RecipeKwargs().to_kwargs() == {}


def test_to_kwargs_returns_only_non_defaults():
    r = FP8RecipeKwargs(backend="ao", recipe="rowwise", exclude="lm_head", skip_slow_shapes=False)
    assert r.to_kwargs() == {
        "backend": "torchao",
        "recipe": "rowwise",
        "exclude": ("lm_head",),
        "skip_slow_shapes": False,
    }


def test_to_kwargs_ignores_environment_for_the_defaults(monkeypatch):
    monkeypatch.setenv("ACCELERATE_FP8_BACKEND", "torchao")
    r = FP8RecipeKwargs()
    assert r.to_kwargs() == {"backend": "torchao"}


def test_describe():
    assert FP8RecipeKwargs().describe() == ""
    r = FP8RecipeKwargs(backend="torchao", recipe="rowwise", skip_first_last=True)
    assert r.describe() == "backend='torchao', recipe='rowwise', skip_first_last=True"


def test_describe_skips_defaults_set_explicitly():
    r = FP8RecipeKwargs(backend="auto", exclude=[], skip_first_last=False, skip_slow_shapes="1", margin=0)
    assert r.describe() == "margin=0"


def test_describe_shows_block_counts_only_when_set():
    assert FP8RecipeKwargs(skip_first_blocks=0, skip_last_blocks="0").describe() == ""
    assert FP8RecipeKwargs(skip_first_blocks="2").describe() == "skip_first_blocks=2"
    assert FP8RecipeKwargs(skip_last_blocks=1).to_kwargs() == {"skip_last_blocks": 1}


@pytest.mark.parametrize("value,expected", [(None, None), ("fp8", "fp8"), (" FP8 ", "fp8"), ("e4m3", "fp8"),
                                            ("float8_e4m3fn", "fp8"), ("none", None), ("off", None), ("", None),
                                            (False, None)])
def test_activation_dtype_values(value, expected):
    assert FP8RecipeKwargs(activation_dtype=value).activation_dtype == expected


def test_activation_dtype_off_in_the_environment_is_off(monkeypatch):
    monkeypatch.setenv("ACCELERATE_FP8_ACTIVATION_DTYPE", "none")
    assert FP8RecipeKwargs().activation_dtype is None
    monkeypatch.setenv("ACCELERATE_FP8_ACTIVATION_DTYPE", "fp16")
    with pytest.raises(ValueError, match="activation_dtype='fp16'.*ACCELERATE_FP8_ACTIVATION_DTYPE"):
        FP8RecipeKwargs()


# ---- fields assigned after construction -------------------------------------------------------------
@pytest.mark.parametrize("field,value,accepted", [
    ("margin", 200, ["<= 8", "underflow"]),
    ("fp8_format", "e5m2", ["'HYBRID'", "'E4M3'"]),
    ("amax_history_len", "--5", [">= 1"]),
    ("opt_level", "O9", ["'O1'", "'O2'", "'O3'"]),
    ("module_filter_fn", "lm_head", ["fn(module, fqn)"]),
    ("backend", "cuda", ["'auto'", "'msamp'"]),
])
def test_assignment_is_checked_like_construction(field, value, accepted):
    r = FP8RecipeKwargs(backend="msamp")
    before = getattr(r, field)
    with pytest.raises(ValueError) as err:
        setattr(r, field, value)
    assert f"FP8RecipeKwargs.{field}" in str(err.value)
    for fragment in accepted:
        assert fragment in str(err.value)
    assert getattr(r, field) == before  # a refused value is not kept


def test_assignment_is_checked_against_the_other_fields():
    r = FP8RecipeKwargs(backend="torchao", recipe="rowwise")
    with pytest.raises(ValueError, match=r"FP8RecipeKwargs.margin=4 applies to delayed.*\.replace\(") as err:
        r.margin = 4
    assert "te:delayed" in str(err.value) and r.margin is None
    with pytest.raises(ValueError, match="FP8RecipeKwargs.fp8_format='HYBRID' cannot be used"):
        r.fp8_format = "hybrid"
    assert r.fp8_format is None


def test_assignment_parses_and_none_restores_the_default():
    r = FP8RecipeKwargs(backend="msamp", exclude=["lm_head"])
    r.margin, r.fp8_format, r.backend = "3", "e4m3", "MS-AMP"
    assert (r.margin, r.fp8_format, r.backend) == (3, "E4M3", "msamp")
    r.exclude, r.backend, r.skip_slow_shapes = None, None, None
    assert (r.exclude, r.backend, r.skip_slow_shapes) == ((), "auto", True)
    assert r.replace(margin=2).margin == 2 and r.margin == 3


def test_assigning_another_name_is_refused_like_replace():
    r = FP8RecipeKwargs.from_name("msamp_o2")
    r.name = r.name  # unchanged: nothing to refuse
    with pytest.raises(ValueError, match=r"FP8RecipeKwargs.name='tensorwise' cannot be assigned.*from_name"):
        r.name = "tensorwise"
    assert r.name == "msamp_o2"


@pytest.mark.parametrize("field,value,quoted", [
    ("weight_dtype", torch.float8_e4m3fn, "weight_dtype=torch.float8_e4m3fn is not one of 'fp32', 'fp16', 'bf16'"),
    ("weight_dtype", 1, "weight_dtype=1 is not one of"),
    ("grad_comm_dtype", 8, "grad_comm_dtype=8 is not one of 'fp32', 'bf16', 'fp8'"),
    ("weight_grad_dtype", "float8_e5m2", "weight_grad_dtype='float8_e5m2' is not one of"),
])
def test_a_bad_dtype_is_quoted_as_written(field, value, quoted):
    # the message quoted the alias it mapped to ('fp8' for torch.float8_e4m3fn) or a str of it ('1' for 1)
    with pytest.raises(ValueError, match=re.escape(f"FP8RecipeKwargs.{quoted}")):
        FP8RecipeKwargs(**{field: value})


def test_assigning_a_misspelt_field_is_refused():
    # it became an attribute nothing reads, and the run kept the old window
    r = FP8RecipeKwargs(backend="msamp")
    with pytest.raises(AttributeError, match=r"no field 'amax_histroy_len'; did you mean 'amax_history_len'\?"):
        r.amax_histroy_len = 5
    with pytest.raises(AttributeError, match=r"no field 'speed' \(fields: .*margin"):
        r.speed = "fast"
    assert not hasattr(r, "amax_histroy_len") and r == FP8RecipeKwargs(backend="msamp")
    r._scratch = 1  # private attributes stay free


def test_copies_keep_checking_assignments():
    import copy
    import pickle

    for r in (copy.deepcopy(FP8RecipeKwargs(backend="msamp")), pickle.loads(pickle.dumps(FP8RecipeKwargs()))):
        with pytest.raises(ValueError, match="FP8RecipeKwargs.margin=9"):
            r.margin = 9


# ---- backend="auto": some backend it may choose must honour the options together ---------------------
@pytest.mark.parametrize("kwargs,refused", [
    (dict(recipe="tensorwise", margin=4), ["FP8RecipeKwargs.margin=4", "te: ", "torchao: "]),
    (dict(weight_dtype="bf16", weight_grad_dtype="fp32"), ["weight_grad_dtype='fp32'", "weight_dtype='bf16'",
                                                           "te, torchao: ", "msamp: "]),
    (dict(fp8_weights=True, opt_level="O2"), ["fp8_weights=True and opt_level='O2'", "te: ", "torchao: ", "msamp: "]),
    (dict(optimizer_in_backward=True, opt_level="O2"), ["optimizer_in_backward=True", "(from opt_level='O2')",
                                                        "te, torchao, msamp: "]),
])
def test_auto_refuses_options_no_backend_honours_together(kwargs, refused):
    # These passed construction and failed only at Accelerator(...), as "te: transformer_engine is not installed"
    with pytest.raises(ValueError, match=r"FP8RecipeKwargs\(backend='auto'\): no backend can honour") as err:
        FP8RecipeKwargs(**kwargs)
    for fragment in refused:
        assert fragment in str(err.value)


@pytest.mark.parametrize("kwargs", [dict(margin=4), dict(fp8_weights=True), dict(recipe="delayed", margin=2),
                                    dict(weight_dtype="bf16", weight_grad_dtype="fp8"), dict(opt_level="O3")])
def test_auto_accepts_what_one_backend_honours(kwargs):
    # margin asks for delayed scaling: te's, or msamp's (with its level) where te cannot run it (docs/performance.md)
    assert FP8RecipeKwargs(**kwargs).backend == "auto"


def test_auto_refusal_after_construction():
    r = FP8RecipeKwargs(recipe="tensorwise")
    with pytest.raises(ValueError, match=r"backend='auto'\): no backend can honour.*margin=4"):
        r.margin = 4
