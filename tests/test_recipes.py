"""Named recipes (issue 30): Megatron-Bridge's names and lowprec's own resolve to the fields they set, every
field set explicitly wins, unknown names fail by name, and users register their own (`lowprec.recipes`)."""

from __future__ import annotations

import json

import pytest
from torch import nn

import lowprec
import lowprec.recipes
from lowprec import BackendUnavailableError, FP8RecipeKwargs, plan_for
from lowprec.cli import main

# name -> the fields it must set (Megatron-Bridge's training/mixed_precision.py, TE as Megatron runs it)
SHIPPED = {
    "bf16_with_fp8_delayed_scaling_mixed": dict(backend="te", recipe="delayed", fp8_format="HYBRID", margin=0,
                                                amax_history_len=1024, amax_compute_algo="max"),
    "bf16_with_fp8_mixed": dict(backend="te", recipe="delayed", amax_history_len=1024),
    "bf16_with_fp8_current_scaling_mixed": dict(backend="te", recipe="current", fp8_format="HYBRID",
                                                skip_first_blocks=1, skip_last_blocks=1),
    "nemotron_h_bf16_with_fp8_current_scaling_mixed": dict(backend="te", recipe="current", skip_first_blocks=2,
                                                           skip_last_blocks=2),
    "nanov2_bf16_with_fp8_current_scaling_mixed": dict(backend="te", recipe="block", skip_first_blocks=2,
                                                       skip_last_blocks=2),
    "bf16_with_fp8_subchannel_scaling_mixed": dict(backend="te", recipe="block"),
    "bf16_with_mxfp8_mixed": dict(backend="te", recipe="mxfp8", fp8_format="E4M3"),
    "torchao_tensorwise": dict(backend="torchao", recipe="tensorwise"),
    "torchao_rowwise": dict(backend="torchao", recipe="rowwise"),
    "torchao_rowwise_with_gw_hp": dict(backend="torchao", recipe="rowwise_with_gw_hp"),
    "te_delayed": dict(backend="te", recipe="delayed"),
    "te_current": dict(backend="te", recipe="current"),
    "msamp_o1": dict(backend="msamp", opt_level="O1"),
    "msamp_o2": dict(backend="msamp", opt_level="O2"),
    "msamp_o3": dict(backend="msamp", opt_level="O3"),
}


def test_every_shipped_name_is_listed():
    assert set(lowprec.recipes.names()) == set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_a_shipped_name_sets_its_fields(name):
    recipe = FP8RecipeKwargs(name=name)
    assert recipe.name == name
    assert {k: getattr(recipe, k) for k in SHIPPED[name]} == SHIPPED[name]
    assert FP8RecipeKwargs.from_name(name) == recipe


@pytest.mark.parametrize("spelling", ["BF16-with-FP8-current-scaling-mixed", " bf16_with_fp8_current_scaling_mixed "])
def test_names_match_without_case_and_with_hyphens(spelling):
    # Megatron-Bridge registers 'bf16-with-fp8-...' beside 'bf16_with_fp8_...' for NeMo 2 users
    assert FP8RecipeKwargs(name=spelling).name == "bf16_with_fp8_current_scaling_mixed"


def test_fields_set_in_code_win_over_the_name():
    recipe = FP8RecipeKwargs.from_name("bf16_with_fp8_current_scaling_mixed", recipe="delayed", skip_last_blocks=0)
    assert (recipe.backend, recipe.recipe, recipe.skip_first_blocks, recipe.skip_last_blocks) == ("te", "delayed", 1, 0)


def test_a_field_the_name_set_is_named_as_its_source_when_refused():
    # the caller wrote recipe='current'; amax_history_len=1024 came from the name, which the error must say
    with pytest.raises(ValueError, match=r"amax_history_len=1024 .*\(amax_history_len set by named recipe "
                                         r"'bf16_with_fp8_delayed_scaling_mixed'\)"):
        FP8RecipeKwargs.from_name("bf16_with_fp8_delayed_scaling_mixed", recipe="current")
    with pytest.raises(ValueError, match=r"recipe='delayed' is not a recipe of backend 'torchao'.*recipe set by named "
                                         r"recipe"):
        FP8RecipeKwargs(name="bf16_with_fp8_delayed_scaling_mixed", backend="torchao")


def test_replace_cannot_change_the_name_under_the_first_names_fields():
    recipe = FP8RecipeKwargs.from_name("bf16_with_fp8_delayed_scaling_mixed")
    with pytest.raises(ValueError, match=r"replace\(name='bf16_with_fp8_current_scaling_mixed'\) .*from_name\("):
        recipe.replace(name="bf16_with_fp8_current_scaling_mixed")
    assert recipe.replace(margin=1).margin == 1 and recipe.replace(name=recipe.name) == recipe


def test_fields_set_in_the_environment_win_over_the_name(monkeypatch):
    monkeypatch.setenv("ACCELERATE_FP8_OPT_LEVEL", "O1")
    monkeypatch.setenv("ACCELERATE_FP8_RECIPE_NAME", "msamp_o2")
    recipe = FP8RecipeKwargs()
    assert (recipe.name, recipe.backend, recipe.opt_level) == ("msamp_o2", "msamp", "O1")


@pytest.mark.parametrize("var", ["ACCELERATE_FP8_RECIPE_NAME", "ACCELERATE_FP8_NAME"])  # NAME: fp8_config: {name: }
def test_the_name_comes_from_the_environment(monkeypatch, var):
    monkeypatch.setenv(var, "torchao-rowwise")
    assert (FP8RecipeKwargs().backend, FP8RecipeKwargs().recipe) == ("torchao", "rowwise")
    monkeypatch.setenv(var, "no_such_recipe")
    with pytest.raises(ValueError, match=f"name='no_such_recipe' is not a named recipe; known: .*msamp_o3.*"
                                         f"\\(read from environment variable {var}\\)"):
        FP8RecipeKwargs()


@pytest.mark.parametrize("name,reason", [
    ("fp16_with_fp8_current_scaling_mixed", "not FP16 with loss scaling; use 'bf16_with_fp8_current_scaling_mixed'"),
    ("fp16-with-mxfp8-mixed", "use 'bf16_with_mxfp8_mixed'"),
    ("bf16_mixed", "it is not an FP8 recipe: use Accelerator\\(mixed_precision='bf16'"),
])
def test_names_lowprec_knows_but_does_not_offer_say_why(name, reason):
    with pytest.raises(ValueError, match=f"FP8RecipeKwargs.name={name!r} is not offered by lowprec: .*{reason}"):
        FP8RecipeKwargs(name=name)


@pytest.mark.parametrize("bad", ["", "nope", 3])
def test_an_unknown_name_fails_by_name(bad):
    with pytest.raises(ValueError, match=f"FP8RecipeKwargs.name={bad!r} (is not a named recipe|must be a recipe name)"):
        FP8RecipeKwargs(name=bad)


def test_a_name_this_machine_cannot_run_fails_like_any_recipe():
    from lowprec.backends import RunContext, create_backend
    from lowprec.planning.hardware import assumed_device

    with pytest.raises(BackendUnavailableError, match="backend 'te' recipe 'mxfp8' cannot run here: recipe 'mxfp8' "
                                                      "needs sm_100"):
        create_backend(FP8RecipeKwargs(name="bf16_with_mxfp8_mixed"), RunContext(device=assumed_device("9.0")),
                       require_package=False)


def test_the_plan_names_the_named_recipe():
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
    plan = plan_for(model, FP8RecipeKwargs(name="msamp_o2", skip_slow_shapes=False), capability="9.0")
    assert plan.notes[0] == ("named recipe 'msamp_o2' (lowprec): backend='msamp', opt_level='O2'; fields set "
                             "explicitly win over it")
    assert plan.notes[0] in str(plan)


# ---- registering ----------------------------------------------------------------------------------------
@pytest.fixture
def registered():
    added = []
    yield added
    for name in added:
        lowprec.recipes.unregister(name)


def test_a_user_registers_a_recipe_by_its_function(registered):
    @lowprec.recipes.register
    def team_fp8():
        """Our FP8: TE current scaling, the first two blocks in BF16.

        Longer text the listing leaves out."""
        return {"backend": "te", "recipe": "current", "skip_first_blocks": 2}

    registered.append("team_fp8")
    named = lowprec.recipes.get("TEAM-FP8")
    assert (named.name, named.source, named.summary) == (
        "team_fp8", "user", "Our FP8: TE current scaling, the first two blocks in BF16.")
    recipe = FP8RecipeKwargs(name="team_fp8")
    assert (recipe.backend, recipe.recipe, recipe.skip_first_blocks) == ("te", "current", 2)
    assert "team_fp8" in lowprec.recipes.names()


def test_registering_refuses_a_taken_name_unless_replacing(registered):
    with pytest.raises(ValueError, match="'msamp_o2' is already a named recipe; pass replace=True"):
        lowprec.recipes.register(name="msamp-o2")(lambda: {"backend": "msamp"})
    lowprec.recipes.register(name="mine", summary="first")(lambda: {"backend": "msamp"})
    registered.append("mine")
    lowprec.recipes.register(name="mine", summary="second", replace=True)(lambda: {"backend": "torchao"})
    assert lowprec.recipes.get("mine").summary == "second" and FP8RecipeKwargs(name="mine").backend == "torchao"


@pytest.mark.parametrize("returns,error,message", [
    ({"backend": "te", "fp8_recipe": "tensorwise"}, ValueError, "sets 'fp8_recipe', which is not a field"),
    ({"name": "msamp_o2"}, ValueError, "sets 'name', which is not a field"),
    ([("backend", "te")], TypeError, "must return a mapping of FP8RecipeKwargs fields"),
])
def test_registering_checks_the_fields_now(returns, error, message):
    with pytest.raises(error, match=message):
        lowprec.recipes.register(name="broken")(lambda: returns)
    with pytest.raises(ValueError, match="not a named recipe"):
        lowprec.recipes.get("broken")


@pytest.mark.parametrize("call,error,message", [
    (lambda r: r(3), TypeError, "3 is not a function; register a function that returns"),
    (lambda r: r("mine"), TypeError, r"'mine' is not a function; .* \(a name goes in name=: "),
    (lambda r: r(name="")(lambda: {"backend": "msamp"}), ValueError, "name '' must be letters, digits"),
    (lambda r: r(name=1), TypeError, "name=1 must be a str"),
    (lambda r: r(name="ok", summary=3), TypeError, "summary=3 must be a str"),
])
def test_registering_names_a_bad_argument(call, error, message):
    # register(3) and register("mine") failed on a missing __name__; name='' registered the function's own name
    with pytest.raises(error, match=message):
        call(lowprec.recipes.register)
    assert "ok" not in lowprec.recipes.names() and "lambda" not in " ".join(lowprec.recipes.names())


def test_a_bad_value_fails_when_the_recipe_is_built_and_names_the_recipe(registered):
    lowprec.recipes.register(name="typo")(lambda: {"backend": "msamp", "opt_level": "O4"})
    registered.append("typo")
    with pytest.raises(ValueError, match="opt_level='O4' is not one of .* \\(set by named recipe 'typo'\\)"):
        FP8RecipeKwargs(name="typo")


# ---- the CLI --------------------------------------------------------------------------------------------
def test_lowprec_recipes_lists_every_name_with_what_it_sets(capsys):
    assert main(["recipes"]) == 0
    out = capsys.readouterr().out
    for name in SHIPPED:
        assert f"\n{name}  [" in out
    assert "sets: backend='te', recipe='current', fp8_format='HYBRID', skip_first_blocks=1, skip_last_blocks=1" in out
    assert main(["recipes", "--json", "msamp_o3"]) == 0
    assert json.loads(capsys.readouterr().out) == [{
        "name": "msamp_o3", "source": "lowprec", "summary": lowprec.recipes.get("msamp_o3").summary,
        "sets": {"backend": "msamp", "opt_level": "O3"}}]
    assert main(["recipes", "nope"]) == 2
    assert "name='nope' is not a named recipe" in capsys.readouterr().err


def test_lowprec_plan_takes_a_name(capsys):
    assert main(["plan", "--name", "msamp_o2", "--model", "tiny", "--capability", "9.0", "--opt-level", "O1"]) == 0
    out = capsys.readouterr().out
    assert "backend msamp" in out and "memory level O1" in out and "named recipe 'msamp_o2'" in out
