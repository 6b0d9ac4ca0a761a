"""TransformerEngine adapter on CPU: the error without TE, recipe validation, the plan for an assumed GPU,
and the adapter's calls into TE against a stand-in (tests/backends/fake_te.py).

Also here: test_te_modules.py (checkpoint format, conversion), test_te_accelerator.py (through
lowprec.Accelerator). Numerics, FP8 really running and torch.compile need TE's kernels:
tests/gpu/test_te_gpu.py.
"""

from __future__ import annotations

import threading

import fake_te as fake
import pytest
import torch
from fake_te import fake_te, te_missing  # noqa: F401  (fixtures)
from torch import nn

from lowprec import (
    Accelerator,
    BackendUnavailableError,
    FP8RecipeKwargs,
    MissingDependencyError,
    RunContext,
    build_plan,
)
from lowprec.backends import auto_choice, create_backend, resolve_backend
from lowprec.backends.te import TEBackend
from lowprec.planning.hardware import DeviceInfo, device_info

CPU = device_info("cpu")
A100 = DeviceInfo("cuda", "A100", (8, 0))
L40S = DeviceInfo("cuda", "L40S", (8, 9))
H100 = DeviceInfo("cuda", "H100", (9, 0))
B200 = DeviceInfo("cuda", "B200", (10, 0))
RTX5090 = DeviceInfo("cuda", "RTX 5090", (12, 0))

RECIPES = ["delayed", "current", "block", "mxfp8"]
DEVICE_FOR = {"delayed": H100, "current": H100, "block": H100, "mxfp8": B200}
ALIGN = {"delayed": 16, "current": 16, "block": 128, "mxfp8": 32}
DEFAULT_FORMAT = {"delayed": "HYBRID", "current": "HYBRID", "block": "E4M3", "mxfp8": "E4M3"}
TE_RECIPE_CLASS = {"delayed": "DelayedScaling", "current": "Float8CurrentScaling", "block": "Float8BlockScaling",
                   "mxfp8": "MXFP8BlockScaling"}


def te_kwargs(**kwargs) -> FP8RecipeKwargs:
    kwargs.setdefault("skip_first_last", False)
    kwargs.setdefault("skip_slow_shapes", False)
    return FP8RecipeKwargs(backend="te", **kwargs)


def te_backend(recipe: str = "delayed", *, device: DeviceInfo | None = None, engine: str = "single",
               compiled: bool = False, **kwargs) -> TEBackend:
    """An adapter for planning: TransformerEngine need not be installed."""
    context = RunContext(device=device or DEVICE_FOR[recipe], engine=engine, compiled=compiled)
    return create_backend(te_kwargs(recipe=recipe, **kwargs), context, require_package=False)


def te_plan(model: nn.Module, recipe: str = "delayed", **kwargs):
    backend = te_backend(recipe, **kwargs)
    return build_plan(model, backend.recipe, context=backend.context, backend=backend), backend


def by_name(plan) -> dict:
    return {d.fqn: d for d in plan.modules}


def hf_class(module: str, name: str) -> type:
    """A class from transformers, or skip where this transformers version lacks it."""
    mod = pytest.importorskip(f"transformers.models.{module}")
    if not hasattr(mod, name):
        pytest.skip(f"transformers has no {name}")
    return getattr(mod, name)


# ---- without TransformerEngine -----------------------------------------------------------------------
@pytest.mark.parametrize("recipe", RECIPES)
def test_create_backend_without_te_says_what_to_install(te_missing, recipe):
    r = FP8RecipeKwargs(backend="te", recipe=recipe)  # validation needs no package
    with pytest.raises(BackendUnavailableError) as err:
        create_backend(r, RunContext(device=DEVICE_FOR[recipe]))
    message = str(err.value)
    assert message.startswith("FP8RecipeKwargs(backend='te') cannot be used: transformer_engine is not installed")
    assert "pip install --no-build-isolation 'transformer_engine[pytorch]>=2.9'" in message


def test_accelerator_without_te_fails_at_construction(te_missing, fresh_accelerate_state):
    # issue 16: this used to surface only at prepare(); now before any model exists
    with pytest.raises(BackendUnavailableError, match=r"transformer_engine is not installed.*pip install"):
        Accelerator(mixed_precision="fp8", kwargs_handlers=[FP8RecipeKwargs(backend="te")])


@pytest.mark.parametrize("recipe", ["current", "block", "mxfp8"])  # recipes only TE offers
def test_auto_with_a_te_only_recipe_names_te_and_the_install_command(te_missing, recipe):
    with pytest.raises(BackendUnavailableError) as err:
        resolve_backend(FP8RecipeKwargs(recipe=recipe), DEVICE_FOR[recipe])
    lines = str(err.value).splitlines()
    te_line = next(line for line in lines if line.strip().startswith("te:"))
    assert "transformer_engine is not installed" in te_line and "pip install" in te_line
    assert any(line.strip().startswith("torchao:") and f"{recipe!r} is not a recipe" in line for line in lines)


def test_planning_needs_no_te_but_converting_does(te_missing):
    model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64))
    plan, backend = te_plan(model, "current")
    assert [d.convert for d in plan.modules] == [True, True]
    for call in (lambda: backend.convert(model, plan), lambda: backend.forward_context(model), backend.te_recipe):
        with pytest.raises(MissingDependencyError,
                           match=r"backend='te' needs transformer_engine: transformer_engine is not installed"):
            call()
    assert type(model[0]) is nn.Linear


def test_install_hint_names_a_doc_that_exists():
    import pathlib

    from lowprec.utils.imports import OPTIONAL_PACKAGES

    hint = OPTIONAL_PACKAGES["transformer_engine"].install_hint
    doc = "docs/backends/te.md"
    assert doc in hint
    assert (pathlib.Path(__file__).parents[2] / doc).is_file()


def test_fake_te_does_not_outlive_its_test():
    import sys

    from lowprec.utils import imports

    with pytest.MonkeyPatch.context() as mp:
        pytorch = fake.install(mp)
        imports.availability.cache_clear()
        assert imports.is_available("transformer_engine")
        assert imports.require("transformer_engine", feature="test") is pytorch
        names = ("transformer_engine", "transformer_engine.common", "transformer_engine.common.recipe",
                 "transformer_engine.pytorch")
        doubles = {name: sys.modules[name] for name in names}
        assert all(module.__spec__.origin is None for module in doubles.values())  # built here, not imported
    imports.availability.cache_clear()
    assert all(sys.modules.get(name) is not module for name, module in doubles.items())


# ---- recipe validation (no package needed) -----------------------------------------------------------
@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_is_accepted_with_its_default_format(recipe):
    backend = te_backend(recipe)
    assert backend.recipe_name == recipe and backend.fp8_format == DEFAULT_FORMAT[recipe]
    assert not backend.emulated and backend.execution_note == f"hardware FP8 on {DEVICE_FOR[recipe].describe()}"


def test_default_recipe_is_delayed_hybrid():
    backend = create_backend(FP8RecipeKwargs(backend="te"), RunContext(device=H100), require_package=False)
    assert (backend.recipe_name, backend.fp8_format) == ("delayed", "HYBRID")


@pytest.mark.parametrize(
    "recipe,fmt,ok",
    [("delayed", "E4M3", True), ("delayed", "HYBRID", True), ("current", "E4M3", True), ("current", "HYBRID", True),
     ("block", "E4M3", True), ("block", "HYBRID", False), ("mxfp8", "E4M3", True), ("mxfp8", "HYBRID", True)],
)
def test_fp8_format_per_recipe(recipe, fmt, ok):
    if ok:
        assert te_backend(recipe, fp8_format=fmt).fp8_format == fmt
    else:
        with pytest.raises(ValueError, match=rf"fp8_format='{fmt}' cannot be used with te recipe '{recipe}', which "
                                             r"supports 'E4M3'"):
            FP8RecipeKwargs(backend="te", recipe=recipe, fp8_format=fmt)


@pytest.mark.parametrize("name", ["rowwise", "nvfp4", "fp8"])
def test_unknown_recipe_lists_the_te_recipes(name):
    with pytest.raises(ValueError) as err:
        FP8RecipeKwargs(backend="te", recipe=name)
    assert str(err.value) == (f"FP8RecipeKwargs.recipe={name!r} is not a recipe of backend 'te'; it offers "
                              "'delayed' (also 'delayed_scaling'), 'current' (also 'tensorwise', 'current_scaling'), "
                              "'block' (also 'blockwise', 'subchannel', 'block_scaling'), 'mxfp8'")


@pytest.mark.parametrize("alias,canonical", [
    ("tensorwise", "current"), ("TensorWise", "current"), ("current_scaling", "current"), ("blockwise", "block"),
    ("subchannel", "block"), ("block_scaling", "block"), ("delayed_scaling", "delayed"),
])
def test_te_and_megatron_recipe_names_are_aliases(fake_te, alias, canonical):
    # Megatron-Core / NeMo spell TE's recipes fp8_recipe='tensorwise' / 'blockwise'; Megatron-Bridge says subchannel
    backend = te_backend(alias, device=DEVICE_FOR[canonical])
    assert backend.recipe_name == canonical and backend.info is backend.recipes[canonical]
    assert type(backend.te_recipe()).__name__ == TE_RECIPE_CLASS[canonical]
    plan = build_plan(nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256)), backend.recipe,
                      context=backend.context, backend=backend)
    assert plan.recipe == canonical and plan.converted
    assert plan.notes[0] == (f"recipe {alias.lower()!r} is NVIDIA TransformerEngine's {canonical!r}: "
                             f"{backend.info.summary}")
    assert plan.notes[0] in str(plan)


def test_a_recipe_named_by_its_own_name_gets_no_alias_note(fake_te):
    plan, _ = te_plan(nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256)), "current")
    assert not any("TransformerEngine's" in note for note in plan.notes)


@pytest.mark.parametrize("compiled,chosen", [(False, "te"), (True, "torchao")])
def test_auto_with_an_alias_takes_the_first_backend_offering_it(fake_te, compiled, chosen):
    # torchao's own 'tensorwise' and TE's alias of 'current' are the same scaling: auto's order decides
    context = RunContext(device=DEVICE_FOR["current"], compiled=compiled)
    backend = create_backend(FP8RecipeKwargs(backend="auto", recipe="tensorwise"), context, require_package=False)
    assert (backend.name, backend.recipe_name) == (chosen, "current" if chosen == "te" else "tensorwise")


@pytest.mark.parametrize("fmt,hint", [("E5M2", "E5M2 is used for gradients by 'HYBRID'"), ("fp4", "'HYBRID', 'E4M3'")])
def test_bad_fp8_format(fmt, hint):
    with pytest.raises(ValueError, match=f"FP8RecipeKwargs.fp8_format='{fmt}' is not one of") as err:
        FP8RecipeKwargs(backend="te", fp8_format=fmt)
    assert hint in str(err.value)


@pytest.mark.parametrize("recipe", ["current", "block", "mxfp8"])
@pytest.mark.parametrize("option,value", [("margin", 1), ("amax_history_len", 16),
                                          ("amax_compute_algo", "most_recent")])
def test_delayed_scaling_options_are_rejected_for_recipes_without_history(recipe, option, value):
    with pytest.raises(ValueError) as err:
        FP8RecipeKwargs(backend="te", recipe=recipe, **{option: value})
    message = str(err.value)
    assert message.startswith(f"FP8RecipeKwargs.{option}={value!r} applies to delayed (amax-history) scaling")
    assert f"te recipe '{recipe}' scales from the current tensor" in message
    assert "te:delayed" in message  # where the option does apply


@pytest.mark.parametrize("recipe", ["current", "block", "mxfp8"])
def test_margin_zero_is_a_no_op_for_current_scaling(recipe):
    backend = te_backend(recipe, margin=0)
    assert "margin" not in backend.effective_options()


def test_delayed_scaling_options_are_applied():
    backend = te_backend("delayed", margin=2, amax_history_len=16, amax_compute_algo="most_recent", fp8_format="E4M3")
    opts = backend.effective_options()
    assert (opts["margin"], opts["amax_history_len"], opts["amax_compute_algo"], opts["fp8_format"]) == (
        2, 16, "most_recent", "E4M3")
    defaults = te_backend("delayed").effective_options()
    assert (defaults["margin"], defaults["amax_history_len"], defaults["amax_compute_algo"]) == (0, 1024, "max")


@pytest.mark.parametrize(
    "recipe,device,why",
    [
        ("delayed", L40S, None),
        ("current", L40S, None),
        ("delayed", A100, "A100 (sm_80) has no FP8 tensor cores"),
        ("delayed", CPU, "CPU has no FP8 tensor cores"),
        ("block", L40S, "recipe 'block' needs sm_90+, L40S (sm_89) is older"),
        ("block", B200, None),
        ("mxfp8", H100, "recipe 'mxfp8' needs sm_100+, H100 (sm_90) is older"),
        ("mxfp8", RTX5090, "recipe 'mxfp8' is not supported on RTX 5090 (sm_120)"),
    ],
)
def test_hardware_each_recipe_needs(recipe, device, why):
    if why is None:
        assert not te_backend(recipe, device=device).emulated
        return
    with pytest.raises(BackendUnavailableError) as err:
        te_backend(recipe, device=device)
    assert str(err.value) == (f"backend 'te' recipe '{recipe}' cannot run here: {why}, and NVIDIA TransformerEngine "
                              "has no emulation mode")


def test_emulation_is_refused():
    with pytest.raises(ValueError, match="emulate=True cannot be honoured: backend 'te' has no emulation mode"):
        FP8RecipeKwargs(backend="te", emulate=True)
    assert not te_backend("current", emulate=False).emulated


def test_delayed_scaling_under_torch_compile_is_an_error():
    with pytest.raises(ValueError) as err:
        te_backend("delayed", compiled=True)
    assert "recipe='delayed') cannot run under torch.compile" in str(err.value)
    assert "Use recipe='current'" in str(err.value)


def test_te_without_a_recipe_under_torch_compile_uses_current_scaling():
    backend = create_backend(te_kwargs(), RunContext(device=H100, compiled=True), require_package=False)
    assert backend.recipe_name == "current"
    assert create_backend(te_kwargs(), RunContext(device=H100), require_package=False).recipe_name == "delayed"


def test_auto_under_torch_compile_chooses_a_compilable_te_recipe(fake_te, monkeypatch):
    # issue 16: auto picked TE's delayed recipe and then failed under compile (the demo on a GPU host)
    from lowprec.backends.torchao import TorchAOBackend

    monkeypatch.setattr(TorchAOBackend, "availability", classmethod(lambda cls: (False, "torchao is not installed")))
    backend = create_backend(FP8RecipeKwargs(), RunContext(device=H100, compiled=True))
    assert (backend.name, backend.recipe_name) == ("te", "current")
    backend = create_backend(FP8RecipeKwargs(), RunContext(device=H100))
    assert (backend.name, backend.recipe_name) == ("te", "delayed")


def test_auto_takes_te_for_eager_models_and_torchao_for_compiled_ones(fake_te):
    # measured on an H100 (lowprec.frontend.specs.AUTO_ORDER): TE's fused kernels win eager, torchao compiled
    pytest.importorskip("torchao")
    assert resolve_backend(FP8RecipeKwargs(), RunContext(device=H100)).name == "te"
    assert resolve_backend(FP8RecipeKwargs(), RunContext(device=H100, compiled=True)).name == "torchao"
    # what only TE offers still goes to TE under compile
    assert resolve_backend(FP8RecipeKwargs(recipe="block"), RunContext(device=H100, compiled=True)).name == "te"


def test_auto_with_delayed_asked_for_under_compile_moves_on_and_says_why(fake_te):
    # 'delayed' is offered by te and msamp; te cannot compile it, so auto takes the next that can
    recipe = FP8RecipeKwargs(recipe="delayed")
    assert resolve_backend(recipe, RunContext(device=H100, compiled=True)).name == "msamp"
    with pytest.raises(BackendUnavailableError) as err:
        resolve_backend(recipe.replace(emulate=False), RunContext(device=CPU, compiled=True))
    assert "te: recipe 'delayed' cannot run under torch.compile" in str(err.value)


def test_an_error_about_a_choice_auto_made_says_auto_made_it(fake_te, monkeypatch):
    # a failure only construction finds (auto's own checks passed)
    original = TEBackend.__init__

    def failing_init(self, recipe, context):
        original(self, recipe, context)
        raise BackendUnavailableError("TE says no")

    monkeypatch.setattr(TEBackend, "__init__", failing_init)
    with pytest.raises(BackendUnavailableError) as err:
        create_backend(FP8RecipeKwargs(), RunContext(device=H100))
    message = str(err.value)
    assert message.startswith("backend='auto' chose 'te' on H100 (sm_90)")
    assert "TE says no" in message and "Name a backend" in message


@pytest.mark.parametrize("recipe", ["current", "block", "mxfp8"])
def test_recipes_without_history_are_allowed_under_torch_compile(recipe):
    assert te_backend(recipe, compiled=True).context.compiled


@pytest.mark.parametrize(
    "option,value,why",
    [
        ("interval", 1, "TransformerEngine removed `interval` in v2.3"),
        ("interval", 4, "TransformerEngine removed `interval` in v2.3"),
        ("override_linear_precision", (False, False, True), "removed `override_linear_precision` in v2.0"),
        ("override_linear_precision", (False, False, False), "exclude=[...]"),
    ],
)
def test_options_te_removed_are_rejected_by_name(option, value, why):
    with pytest.raises(ValueError) as err:
        FP8RecipeKwargs(backend="te", **{option: value})
    assert str(err.value).startswith(f"FP8RecipeKwargs.{option}={value!r} cannot be honoured: ")
    assert why in str(err.value)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(pad_inner_dim=True), "pad_inner_dim=True cannot be honoured by backend 'te'"),
        (dict(enable_fsdp_float8_all_gather=True), "enable_fsdp_float8_all_gather=True cannot be honoured by te"),
        (dict(opt_level="O3"), "opt_level='O3' is not available with backend 'te'"),
    ],
)
def test_options_te_cannot_honour(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FP8RecipeKwargs(backend="te", **kwargs)


@pytest.mark.parametrize("flag,expected", [(None, False), (False, False), (True, True)])
def test_eval_precision_option(flag, expected):
    backend = te_backend("current", use_autocast_during_eval=flag)
    assert backend.effective_options()["use_autocast_during_eval"] is expected
    plan, _ = te_plan(nn.Sequential(nn.Linear(64, 64)), "current", use_autocast_during_eval=flag)
    assert ("eval runs in high precision (use_autocast_during_eval=False)" in plan.notes) is not expected


def test_mxfp8_from_accelerates_environment_variable(monkeypatch):
    monkeypatch.setenv("ACCELERATE_FP8_BACKEND", "te")
    monkeypatch.setenv("ACCELERATE_FP8_USE_MXFP8_BLOCK_SCALING", "true")
    assert FP8RecipeKwargs().recipe == "mxfp8"
    monkeypatch.setenv("ACCELERATE_FP8_RECIPE", "delayed")
    with pytest.raises(ValueError, match="asks for the MXFP8 recipe but ACCELERATE_FP8_RECIPE='delayed'"):
        FP8RecipeKwargs()


@pytest.mark.parametrize("engine,ok", [("single", True), ("ddp", True), ("fsdp2", True), ("fsdp1", False),
                                       ("deepspeed", False)])
def test_fp8_weights_only_where_supported(engine, ok):
    if ok:
        assert te_backend("current", engine=engine, fp8_weights=True).effective_options()["fp8_weights"] is True
    else:
        with pytest.raises(BackendUnavailableError, match=f"fp8_weights=True\\) is not supported with {engine}"):
            te_backend("current", engine=engine, fp8_weights=True)


def test_fp8_weights_needs_adam():
    backend = te_backend("current", fp8_weights=True)
    model = nn.Sequential(nn.Linear(64, 64))
    plan = build_plan(model, backend.recipe, context=backend.context, backend=backend)
    with pytest.raises(ValueError, match="needs master weights.*got SGD"):
        backend.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), plan)


@pytest.mark.parametrize("optimizer, match", [
    (lambda ps: torch.optim.SGD(ps, lr=0.1), "needs master weights.*got SGD"),
    (lambda ps: torch.optim.AdamW(ps, amsgrad=True), "FusedAdam, which has no amsgrad"),
])
@pytest.mark.parametrize("states", [None, "fp8"])
def test_fp8_weights_refuse_an_optimizer_fused_adam_cannot_replace_before_conversion(optimizer, match, states):
    # prepare() asks check_optimizer before it converts the model: a refusal then leaves the user's model untouched
    backend = te_backend("current", fp8_weights=True, optimizer_states=states)
    with pytest.raises(ValueError, match=match):
        backend.check_optimizer(optimizer(nn.Linear(8, 8).parameters()))
    backend.check_optimizer(torch.optim.AdamW(nn.Linear(8, 8).parameters()))


# ---- module selection and the plan ------------------------------------------------------------------
@pytest.mark.parametrize("recipe", RECIPES)
def test_linear_alignment_is_decided_per_module(recipe):
    a = ALIGN[recipe]
    model = nn.ModuleDict({
        "fits": nn.Linear(a, 2 * a),
        "bad_out": nn.Linear(a, a + a // 2),
        "bad_in": nn.Linear(a // 2, a),
        "bad_both": nn.Linear(a + a // 2, a // 2),
        "fits_after": nn.Linear(3 * a, a, bias=False),
    })
    plan, _ = te_plan(model, recipe)
    d = by_name(plan)
    assert [n for n, m in d.items() if m.convert] == ["fits", "fits_after"]  # no early return after a misfit
    rule = f"not divisible by {a} (TE '{recipe}' FP8 GEMM requirement)"
    assert d["bad_out"].reason == f"out_features={a + a // 2} {rule}"
    assert d["bad_in"].reason == f"in_features={a // 2} {rule}"
    assert d["bad_both"].reason == f"in_features={a + a // 2}, out_features={a // 2} {rule}"
    assert d["fits"].shape == (2 * a, a) and d["fits"].reason == "FP8"


@pytest.mark.parametrize(
    "in_features,out_features,expected",
    [
        (64, 96, {"delayed": True, "current": True, "block": False, "mxfp8": True}),
        (48, 48, {"delayed": True, "current": True, "block": False, "mxfp8": False}),
        (256, 384, {"delayed": True, "current": True, "block": True, "mxfp8": True}),
        (16, 8, {"delayed": False, "current": False, "block": False, "mxfp8": False}),
        (24, 32, {"delayed": False, "current": False, "block": False, "mxfp8": False}),
    ],
)
def test_alignment_differs_between_recipes(in_features, out_features, expected):
    for recipe, convert in expected.items():
        plan, _ = te_plan(nn.Sequential(nn.Linear(in_features, out_features)), recipe)
        assert plan.modules[0].convert is convert, (recipe, plan.modules[0].reason)


class CenteredRMSNorm(nn.Module):
    """Named like an RMSNorm, computes a LayerNorm without bias: TE's RMSNorm would change its output."""

    def __init__(self, n: int):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, n))

    def forward(self, x):
        x = x - x.mean(-1, keepdim=True)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def norm_zoo() -> nn.ModuleDict:
    llama = hf_class("llama.modeling_llama", "LlamaRMSNorm")
    gemma = hf_class("gemma.modeling_gemma", "GemmaRMSNorm")
    torch.manual_seed(0)
    zoo = nn.ModuleDict({
        "ln": nn.LayerNorm(64, eps=1e-3),
        "ln_no_affine": nn.LayerNorm(64, elementwise_affine=False),
        "ln_no_bias": nn.LayerNorm(64, bias=False),
        "rms": nn.RMSNorm(64),
        "rms_no_weight": nn.RMSNorm(64, elementwise_affine=False),
        "llama": llama(64, eps=1e-6),
        "gemma": gemma(64, eps=1e-6),
        "centered": CenteredRMSNorm(64),
        "proj": nn.Linear(64, 64),
    })
    with torch.no_grad():  # trained-looking weights: 1 and 1 + 0 would not tell the variants apart
        for name in ("rms", "llama", "gemma"):
            zoo[name].weight.copy_(torch.randn(64) * 0.3 + (0 if name == "gemma" else 1))
    return zoo


def test_norm_candidates_and_their_reasons():
    plan, backend = te_plan(norm_zoo(), "current")
    d = by_name(plan)
    kinds = {n: m.kind for n, m in d.items()}
    assert kinds == {"ln": "layernorm", "ln_no_affine": "layernorm", "ln_no_bias": "layernorm", "rms": "rmsnorm",
                     "rms_no_weight": "rmsnorm", "llama": "rmsnorm", "gemma": "rmsnorm", "centered": "rmsnorm",
                     "proj": "linear"}
    assert {n for n, m in d.items() if m.convert} == {"ln", "rms", "llama", "gemma", "proj"}
    assert d["ln_no_affine"].reason.startswith("LayerNorm without affine parameters")
    assert d["ln_no_bias"].reason.startswith("LayerNorm(bias=False)")
    assert d["rms_no_weight"].reason.startswith("RMSNorm without a 1-D weight")
    assert d["centered"].reason.startswith("CenteredRMSNorm does not compute x * rsqrt(mean(x^2) + eps) * w")
    assert d["ln"].shape == (64,) and d["llama"].shape == (64,)
    assert "4 of 8 norm layers replaced" in str(plan)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_variant_is_measured(dtype):
    zoo = norm_zoo().to(dtype)
    backend = te_backend("current")
    variants = {n: backend.rms_variant(zoo[n]) for n in ("rms", "llama", "gemma", "centered")}
    assert variants == {"rms": "standard", "llama": "standard", "gemma": "zero_centered", "centered": None}


@pytest.mark.parametrize("module,name,variant", [("llama.modeling_llama", "LlamaRMSNorm", "standard"),
                                                 ("gemma.modeling_gemma", "GemmaRMSNorm", "zero_centered"),
                                                 ("gemma2.modeling_gemma2", "Gemma2RMSNorm", "zero_centered")])
def test_rmsnorm_variant_on_meta_and_on_cpu(module, name, variant):
    cls = hf_class(module, name)
    backend = te_backend("current")
    with torch.device("meta"):
        on_meta = cls(64)
    on_cpu = cls(64)  # both alive: the adapter caches its answer by id(module)
    assert backend.rms_variant(on_meta) == variant
    assert backend.rms_variant(on_cpu) == variant


@pytest.mark.parametrize("module,name", [("gemma3n.modeling_gemma3n", "Gemma3nRMSNorm"),
                                         ("gemma4.modeling_gemma4", "Gemma4RMSNorm"),
                                         ("qwen3_next.modeling_qwen3_next", "Qwen3NextRMSNorm"),
                                         ("qwen3_5.modeling_qwen3_5", "Qwen3_5RMSNorm")])
def test_rmsnorm_variant_on_meta_matches_the_probe(module, name):
    cls = hf_class(module, name)
    backend = te_backend("current")
    on_cpu = cls(64)  # kept alive: the adapter caches its answer by id(module)
    measured = backend.rms_variant(on_cpu)
    assert measured in ("standard", "zero_centered")
    with torch.device("meta"):
        on_meta = cls(64)
    assert backend.rms_variant(on_meta) == measured


def block(width: int = 64) -> nn.ModuleDict:
    return nn.ModuleDict({
        "attn": nn.ModuleDict({"q": nn.Linear(width, width), "o": nn.Linear(width, width)}),
        "mlp": nn.ModuleDict({"up": nn.Linear(width, 4 * width), "down": nn.Linear(4 * width, width)}),
        "norm": nn.RMSNorm(width),
    })


def tiny_transformer() -> nn.ModuleDict:
    torch.manual_seed(0)
    return nn.ModuleDict({"layers": nn.ModuleList([block(), block()]), "final_norm": nn.LayerNorm(64),
                          "lm_head": nn.Linear(64, 512)})


def test_skip_first_last_keeps_the_edge_linears_and_not_the_norms():
    plan, _ = te_plan(tiny_transformer(), "delayed", skip_first_last=True)
    d = by_name(plan)
    assert d["layers.0.attn.q"].reason == "first Linear layer (skip_first_last=True)"
    assert d["lm_head"].reason == "last Linear layer (skip_first_last=True)"
    assert [n for n, m in d.items() if not m.convert] == ["layers.0.attn.q", "lm_head"]
    assert d["final_norm"].convert and d["layers.0.norm"].convert


def test_skip_slow_shapes_after_the_shape_rule():
    with torch.device("meta"):
        model = nn.ModuleDict({"small": nn.Linear(4096, 1024), "wide": nn.Linear(4096, 4096),
                               "deep": nn.Linear(8192, 1024), "odd": nn.Linear(100, 64)})
    plan, _ = te_plan(model, "current", skip_slow_shapes=True)  # planned for an H100
    d = by_name(plan)
    assert d["small"].reason == ("FP8 slower than BF16 on Hopper (sm_90) with TransformerEngine in an eager model "
                                 "for K=4096 <= 4096 and N=1024 <= 1024 (skip_slow_shapes=True)")
    assert d["wide"].convert and d["deep"].convert
    assert d["odd"].reason.startswith("in_features=100 not divisible by 16")
    assert d["odd"].option == ("backend 'te' cannot pad them (only backend='torchao' has pad_inner_dim=True); "
                               "resize them to fit")


@pytest.mark.parametrize("recipe,device,slow", [
    ("delayed", H100, True), ("block", H100, True),  # per-tensor thresholds: a lower bound for block scaling
    ("current", L40S, False), ("current", B200, False), ("mxfp8", B200, False),
])
def test_slow_shapes_only_where_measured(recipe, device, slow):
    with torch.device("meta"):
        model = nn.ModuleDict({"small": nn.Linear(4096, 1024)})
    plan, _ = te_plan(model, recipe, device=device, skip_slow_shapes=True)
    assert by_name(plan)["small"].convert is not slow
    unmeasured = [n for n in plan.notes if n.startswith("skip_slow_shapes: no measured thresholds")]
    assert bool(unmeasured) is not slow
    if not slow:
        assert device.describe().split("(")[-1].rstrip(")") in unmeasured[0]  # names the architecture


def test_include_patterns():
    plan, _ = te_plan(tiny_transformer(), "current", include=["*.mlp.*", "final_norm"])
    d = by_name(plan)
    assert sorted(n for n, m in d.items() if m.convert) == [
        "final_norm", "layers.0.mlp.down", "layers.0.mlp.up", "layers.1.mlp.down", "layers.1.mlp.up"]
    assert d["layers.0.norm"].reason == "not matched by any include pattern"


def test_exclude_patterns_cover_linears_norms_and_whole_blocks():
    plan, _ = te_plan(tiny_transformer(), "current", exclude=["layers.1", "lm_head", "*norm*"])
    d = by_name(plan)
    assert sorted(n for n, m in d.items() if m.convert) == [
        "layers.0.attn.o", "layers.0.attn.q", "layers.0.mlp.down", "layers.0.mlp.up"]
    assert d["layers.1.mlp.up"].reason == "excluded by pattern 'layers.1'"
    assert d["lm_head"].reason == "excluded by pattern 'lm_head'"
    assert d["layers.0.norm"].reason == "excluded by pattern '*norm*'"


def test_module_filter_fn_sees_te_candidates():
    seen = []

    def keep_attention(module, fqn):
        seen.append((type(module).__name__, fqn))
        return ".attn." in fqn

    plan, _ = te_plan(tiny_transformer(), "current", module_filter_fn=keep_attention)
    assert ("RMSNorm", "layers.0.norm") in seen and ("LayerNorm", "final_norm") in seen
    assert sorted(d.fqn for d in plan.converted) == ["layers.0.attn.o", "layers.0.attn.q", "layers.1.attn.o",
                                                     "layers.1.attn.q"]


def test_multihead_attention_projection_is_not_a_candidate():
    model = nn.ModuleDict({"attn": nn.MultiheadAttention(64, 4), "proj": nn.Linear(64, 64)})
    plan, _ = te_plan(model, "current")
    assert [d.fqn for d in plan.modules] == ["proj"]


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_plan_of_a_transformers_llama(device):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=100)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config)
    plan, _ = te_plan(model, "current")
    linears = [d for d in plan.modules if d.kind == "linear"]
    norms = [d for d in plan.modules if d.kind == "rmsnorm"]
    assert len(linears) == 15 and len(norms) == 5 and all(d.convert for d in norms)
    assert [d.fqn for d in linears if not d.convert] == ["lm_head"]
    assert by_name(plan)["lm_head"].reason.startswith("out_features=100 not divisible by 16")


@pytest.mark.parametrize("recipe,fmt", [(r, f) for r in RECIPES for f in TEBackend.recipes[r].formats])
def test_precision_table_row(recipe, fmt):
    plan, _ = te_plan(nn.Sequential(nn.Linear(256, 256)), recipe, fp8_format=fmt)
    gemm = plan.tensor("gemm")
    assert gemm.dtype == {"HYBRID": "FP8 E4M3/E5M2", "E4M3": "FP8 E4M3"}[fmt]
    assert {"delayed": "amax of the last 1024 steps", "current": "amax of the current tensor",
            "block": "128x128 blocks (weights)", "mxfp8": "1x32 blocks with E8M0"}[recipe] in gemm.scaling
    assert plan.tensor("weight").dtype == "FP32" and plan.tensor("master_weight").dtype == "N/A"
    assert plan.bytes_per_param["weight"] == 4 and plan.bytes_per_param["master_weight"] == 0
    assert (plan.recipe, plan.fp8_format, plan.backend) == (recipe, fmt, "te")
    assert "TE FP8 GEMMs need batch x sequence divisible by 8 at run time (pad sequences)" in plan.notes
    delayed_note = ("DelayedScaling: the first step cast with scales from its own tensors (TE starts them at 1); "
                    "checkpoints keep scales and amax histories without pickle; not compilable")
    assert (delayed_note in plan.notes) is (recipe == "delayed")


def test_the_plan_says_how_delayed_scalings_first_step_is_cast(monkeypatch):
    monkeypatch.setenv("LOWPREC_TE_FIRST_SCALES", "0")
    plan, _ = te_plan(nn.Sequential(nn.Linear(256, 256)), "delayed")
    assert ("DelayedScaling: the first step cast with TE's initial scales of 1 (LOWPREC_TE_FIRST_SCALES=0); "
            "checkpoints keep scales and amax histories without pickle; not compilable") in plan.notes


@pytest.mark.parametrize("compiled", [False, True])
def test_a_compiled_model_is_told_what_te_costs_there(compiled):
    from lowprec.backends.te.adapter import COMPILED_NOTE

    with torch.device("meta"):
        wide = nn.Sequential(nn.Linear(4096, 4096), nn.Linear(4096, 4096))  # d4096: FP8 in either mode
        middle = nn.Sequential(nn.Linear(2048, 2048), nn.Linear(2048, 5632))  # d2048: FP8 only eager
        narrow = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 2816))  # d1024: BF16 in either mode
    plan, _ = te_plan(wide, "current", compiled=compiled, skip_slow_shapes=True)
    assert len(plan.converted) == 2
    assert (COMPILED_NOTE in plan.notes) is compiled
    plan, _ = te_plan(middle, "current", compiled=compiled, skip_slow_shapes=True)
    assert len(plan.converted) == (0 if compiled else 2)
    assert (COMPILED_NOTE in plan.notes) is compiled  # compiling is what keeps them: it says how to get FP8 back
    for model, kwargs in ((narrow, {}), (wide, {"exclude": ["*"]})):
        plan, _ = te_plan(model, "current", compiled=compiled, skip_slow_shapes=True, **kwargs)
        assert not plan.converted and COMPILED_NOTE not in plan.notes  # not for want of an eager model


@pytest.mark.parametrize("skip_slow_shapes", [True, False])
@pytest.mark.parametrize("compiled", [False, True])
def test_norms_stay_the_models_own_in_a_compiled_model(compiled, skip_slow_shapes):
    with torch.device("meta"):
        model = nn.ModuleDict({"ln": nn.LayerNorm(4096), "rms": nn.RMSNorm(4096), "fc": nn.Linear(4096, 4096)})
    plan, _ = te_plan(model, "current", compiled=compiled, skip_slow_shapes=skip_slow_shapes)
    d = by_name(plan)
    assert d["fc"].convert  # a d4096 GEMM pays in either mode
    kept = compiled and skip_slow_shapes
    for name in ("ln", "rms"):
        assert d[name].convert is not kept
        if kept:
            assert d[name].rule == "skip_slow_shapes" and "TE's norm would be a graph break" in d[name].reason
            assert d[name].option == "skip_slow_shapes=False replaces them anyway (though slower)"


def test_fp8_weights_in_the_plan():
    model = nn.ModuleDict({"a": nn.Linear(64, 64), "odd": nn.Linear(64, 40), "norm": nn.LayerNorm(64)})
    plan, _ = te_plan(model, "current", fp8_weights=True)
    assert plan.tensor("weight").dtype == "FP8 E4M3 (Linear), FP32 (rest)"
    assert plan.tensor("master_weight").dtype == "FP32 (TE FusedAdam)"
    # converted Linear weights only: TE's quantized init leaves biases in high precision
    share = 64 * 64 / sum(p.numel() for p in model.parameters())
    assert plan.bytes_per_param["weight"] == pytest.approx(share * 1 + (1 - share) * 4)
    assert plan.bytes_per_param["master_weight"] == pytest.approx(share * 4)
    assert "fp8_weights: Adam/AdamW is replaced by TE FusedAdam(master_weights=True), moments FP32+FP32" in plan.notes
    assert plan.bytes_per_param["optimizer_states"] == 8.0
    assert plan.tensor("optimizer_states").dtype == "FP32+FP32"


@pytest.mark.parametrize("states, dtype, nbytes, how", [
    ("fp8", "FP8 E4M3+FP16", 3.0, "unscaled to FP32 copies for each step's kernel"),
    ("bf16", "BF16+BF16", 4.0, "read by its kernel as stored"),
    ("fp32", "FP32+FP32", 8.0, "FP32, its default"),
    ("e4m3+bf16", "FP8 E4M3+BF16", 3.0, "unscaled to FP32 copies for each step's kernel"),
])
@pytest.mark.parametrize("engine", ["single", "fsdp2"])
def test_fp8_weights_plan_shows_fused_adams_moments(states, dtype, nbytes, how, engine):
    model = nn.ModuleDict({"a": nn.Linear(64, 64), "norm": nn.LayerNorm(64)})
    plan, backend = te_plan(model, "current", engine=engine, fp8_weights=True, optimizer_states=states)
    row = plan.tensor("optimizer_states")
    assert row.dtype == dtype and "TE FusedAdam" in row.scaling and how in row.scaling
    n = backend.context.world_size if engine == "fsdp2" else 1
    assert plan.bytes_per_param["optimizer_states"] == pytest.approx(nbytes / n)
    assert f"moments {dtype}" in plan.notes[next(i for i, x in enumerate(plan.notes) if x.startswith("fp8_weights:"))]


def test_plan_of_a_model_with_nothing_to_convert():
    plan, _ = te_plan(nn.Sequential(nn.Linear(10, 20), nn.Linear(20, 10)), "current")
    assert not plan.converted
    assert plan.notes[0].startswith("no module runs in FP8")


# ---- the adapter's calls into TE (stand-in TE) -----------------------------------------------------------
@pytest.mark.parametrize("recipe", RECIPES)
def test_te_recipe_object(fake_te, recipe):
    kwargs = dict(margin=3, amax_history_len=32, amax_compute_algo="most_recent") if recipe == "delayed" else {}
    made = te_backend(recipe, fp8_format="E4M3", **kwargs).te_recipe()
    assert type(made).__name__ == TE_RECIPE_CLASS[recipe]
    assert made.fp8_format is fake.Format.E4M3
    if recipe == "delayed":
        assert made == fake.DelayedScaling(margin=3, fp8_format=fake.Format.E4M3, amax_history_len=32,
                                           amax_compute_algo="most_recent", reduce_amax=True)
        assert te_backend("delayed").te_recipe() == fake.DelayedScaling(
            margin=0, fp8_format=fake.Format.HYBRID, amax_history_len=1024, amax_compute_algo="max", reduce_amax=True)


@pytest.mark.parametrize("value,expected", [(None, True), (True, True), (False, False)])
def test_reduce_amax_reaches_delayed_scaling(fake_te, value, expected):
    """reduce_amax (None: on, TE's and NeMo's default) is DelayedScaling's own field, in the recipe te.autocast
    gets, in the options the plan shows and in the GEMM row's words."""
    backend = te_backend("delayed", reduce_amax=value)
    assert backend.te_recipe().reduce_amax is expected
    assert backend.effective_options()["reduce_amax"] is expected
    model = nn.Linear(16, 16)
    with backend.forward_context(model)():
        pass
    assert fake.autocast_calls[-1]["recipe"].reduce_amax is expected
    plan, _ = te_plan(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)), "delayed", reduce_amax=value,
                      skip_first_last=False)
    assert plan.options["reduce_amax"] is expected
    words = "amax reduced across ranks" if expected else "each rank's own amax (reduce_amax=False)"
    assert words in plan.tensor("gemm").scaling


@pytest.mark.parametrize("recipe", ["current", "block", "mxfp8"])
def test_reduce_amax_not_an_option_of_current_scaling(recipe):
    assert "reduce_amax" not in te_backend(recipe).effective_options()


@pytest.mark.parametrize("eval_fp8", [None, False, True])
def test_forward_context_follows_train_and_eval(fake_te, eval_fp8):
    backend = te_backend("current", use_autocast_during_eval=eval_fp8)
    model = nn.Linear(16, 16)
    context = backend.forward_context(model)
    for training, expected in ((True, True), (False, bool(eval_fp8))):
        model.train(training)
        with context():
            pass
        call = fake.autocast_calls[-1]
        assert call["enabled"] is expected
        assert type(call["recipe"]).__name__ == "Float8CurrentScaling"


def test_is_converted_recognises_te_modules_only(fake_te):
    backend = te_backend("current")
    assert backend.is_converted(fake_te.Linear(16, 16, device="cpu"))
    assert backend.is_converted(fake_te.RMSNorm(16, device="cpu"))
    assert not backend.is_converted(nn.Linear(16, 16)) and not backend.is_converted(nn.LayerNorm(16))

    class Linear(nn.Linear):  # a user class of the same name elsewhere
        pass

    assert not backend.is_converted(Linear(16, 16))


def test_a_model_already_in_te_is_planned_as_converted(fake_te):
    model = nn.ModuleDict({"te": fake_te.Linear(64, 64, device="cpu"), "plain": nn.Linear(64, 64)})
    plan, _ = te_plan(model, "current")
    d = by_name(plan)
    assert d["te"].reason == "already an FP8 module" and d["plain"].convert


def test_already_converted_norms_keep_their_kind(fake_te):
    model = nn.ModuleDict({"proj": fake_te.Linear(64, 64, device="cpu"), "norm": fake_te.RMSNorm(64, device="cpu"),
                           "ln": fake_te.LayerNorm(64, device="cpu")})
    plan, _ = te_plan(model, "current")
    assert {d.fqn: d.kind for d in plan.modules} == {"proj": "linear", "norm": "rmsnorm", "ln": "layernorm"}


@pytest.mark.parametrize("available", [True, False])
def test_block_scaling_is_checked_with_te_on_a_gpu(fake_te, monkeypatch, available):
    # TE knows what its block-scaling kernels need (CUDA and cuBLAS versions) beyond sm_90.
    fake.block_scaling.available, fake.block_scaling.reason = available, "needs CUDA 12.9 or newer"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    if available:
        assert te_backend("block").recipe_name == "block"
        return
    with pytest.raises(BackendUnavailableError) as err:
        te_backend("block")
    assert str(err.value) == "FP8RecipeKwargs(backend='te', recipe='block') cannot run here: needs CUDA 12.9 or newer"
    assert te_backend("current").recipe_name == "current"  # only block scaling asks


def test_block_scaling_planned_without_a_gpu_does_not_ask_te(fake_te):
    fake.block_scaling.available = False  # would refuse, were it asked
    assert te_backend("block").recipe_name == "block"


class LockedRMSNorm(nn.Module):
    """Computes an RMSNorm but holds a lock, which deepcopy refuses: on the meta device it cannot be probed."""

    def __init__(self, n: int):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, n))
        self.lock = threading.Lock()

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def test_rmsnorm_that_cannot_be_probed_on_meta_stays_high_precision():
    on_cpu = LockedRMSNorm(64)
    with torch.device("meta"):
        on_meta = LockedRMSNorm(64)
    plan, backend = te_plan(nn.ModuleDict({"loaded": on_cpu, "on_meta": on_meta}), "current")
    d = by_name(plan)
    assert d["loaded"].convert and backend.rms_variant(on_cpu) == "standard"
    assert not d["on_meta"].convert and backend.rms_variant(on_meta) is None
    assert d["on_meta"].reason.startswith("LockedRMSNorm does not compute x * rsqrt(mean(x^2) + eps) * w")


# ---- fp8_weights: Adam/AdamW -> TE FusedAdam with FP32 masters (stand-in TE) ---------------------------------
def fp8_weights_setup():
    backend = te_backend("current", fp8_weights=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64))
    return backend, model, build_plan(model, backend.recipe, context=backend.context, backend=backend)


@pytest.mark.parametrize("cls,kwargs,adam_w_mode", [(torch.optim.AdamW, {}, 1), (torch.optim.Adam, {}, 0),
                                                    (torch.optim.Adam, dict(decoupled_weight_decay=True), 1)],
                         ids=["adamw", "adam", "adam-decoupled"])
def test_fp8_weights_moves_adam_to_fused_adam_with_its_settings(fake_te, cls, kwargs, adam_w_mode):
    backend, model, plan = fp8_weights_setup()
    decay, no_decay = [model[0].weight], [model[0].bias, *model[1].parameters()]
    optimizer = cls([{"params": decay}, {"params": no_decay, "weight_decay": 0.0, "lr": 1e-4}], lr=3e-3,
                    betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, foreach=False, **kwargs)
    torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)  # puts initial_lr in every group
    new = backend.wrap_optimizer(optimizer, plan)
    assert type(new) is fake_te.optimizers.FusedAdam
    assert (new.adam_w_mode, new.master_weights, new.master_weight_dtype) == (adam_w_mode, True, torch.float32)
    assert [g["params"] for g in new.param_groups] == [decay, no_decay]
    settings = [{k: v for k, v in g.items() if k not in ("params", "bias_correction")} for g in new.param_groups]
    # per-group values and a scheduler's keys carried over; torch's switches (foreach, ...) left to FusedAdam
    assert settings == [dict(lr=3e-3, initial_lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1),
                        dict(lr=1e-4, initial_lr=1e-4, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.0)]


@pytest.mark.parametrize("kwargs, named", [(dict(amsgrad=True), "amsgrad"), (dict(maximize=True), "maximize")])
def test_fp8_weights_refuses_adam_settings_fused_adam_lacks(fake_te, kwargs, named):
    backend, model, plan = fp8_weights_setup()
    with pytest.raises(ValueError, match=f"FusedAdam, which has no {named}; set {named}=False or fp8_weights=False"):
        backend.wrap_optimizer(torch.optim.AdamW(model.parameters(), **kwargs), plan)


@pytest.mark.parametrize("states, m, v", [(None, torch.float32, torch.float32), ("fp8", torch.uint8, torch.float16),
                                          ("bf16", torch.bfloat16, torch.bfloat16),
                                          ("e4m3+bf16", torch.uint8, torch.bfloat16)])
def test_fp8_weights_give_fused_adam_the_moments_optimizer_states_chooses(fake_te, states, m, v):
    backend = te_backend("current", fp8_weights=True, optimizer_states=states)
    model = nn.Sequential(nn.Linear(64, 64))
    plan = build_plan(model, backend.recipe, context=backend.context, backend=backend)
    optimizer = torch.optim.AdamW(model.parameters())
    backend.check_optimizer(optimizer)  # FusedAdam's rules, not lowprec's low-bit Adam's
    new = backend.wrap_optimizer(optimizer, plan)
    assert type(new) is fake_te.optimizers.FusedAdam and (new.exp_avg_dtype, new.exp_avg_sq_dtype) == (m, v)


@pytest.mark.parametrize("recipe, states, model_dtype", [("delayed", None, torch.float32),
                                                         ("delayed", None, torch.bfloat16),
                                                         ("delayed", "fp8", torch.float32),
                                                         ("current", "bf16", torch.float32),
                                                         ("current", "e4m3+bf16", torch.bfloat16)])
def test_fused_adam_built_with_fp8_weights_matches_its_plan(fake_te, recipe, states, model_dtype):
    # prepare() checks the optimizer it built against the plan: FusedAdam's moments are its exp_avg_dtype /
    # exp_avg_sq_dtype (uint8: E4M3), whatever the parameters' dtype
    backend = te_backend(recipe, fp8_weights=True, optimizer_states=states)
    model = nn.Sequential(nn.Linear(64, 64)).to(model_dtype)
    plan = build_plan(model, backend.recipe, context=backend.context, backend=backend)
    new = backend.wrap_optimizer(torch.optim.AdamW(model.parameters()), plan)
    plan.verify_optimizer(new)  # no PlanMismatchError


def test_a_user_fused_adam_without_master_weights_keeps_the_parameters_dtype_rule(fake_te):
    from lowprec.optim.levels import built_states

    optimizer = fake_te.optimizers.FusedAdam(nn.Linear(4, 4).parameters(), exp_avg_dtype=torch.bfloat16)
    assert built_states(optimizer, "FP32") == "FP32+FP32"  # not lowprec's: no plan row of its own


@pytest.mark.parametrize("states", ["bf16", ("bf16", "bf16")])
def test_bf16_moments_with_delayed_fp8_weights_are_refused_naming_what_works(states):
    # TE's FP8-weight Adam kernel for delayed scaling takes FP32 moments; both-BF16 ones reach it as stored
    with pytest.raises(ValueError, match="recipe='delayed', fp8_weights=True, optimizer_states='bf16'.*use "
                                         "recipe='current', or optimizer_states 'fp16', 'fp8'"):
        te_backend("delayed", fp8_weights=True, optimizer_states=states)


def test_bf16_moments_with_delayed_fp8_weights_are_refused_where_the_recipe_is_made_or_picked():
    # named: refused by FP8RecipeKwargs itself (it was accepted there and refused only at prepare() or `lowprec plan`)
    with pytest.raises(ValueError, match="recipe='delayed', fp8_weights=True, optimizer_states='bf16'"):
        FP8RecipeKwargs(backend="te", recipe="delayed", fp8_weights=True, optimizer_states="bf16")
    # unset: the adapter picks 'delayed' for an eager model and refuses it there; a compiled one gets 'current'
    recipe = FP8RecipeKwargs(backend="te", fp8_weights=True, optimizer_states="bf16")
    with pytest.raises(ValueError, match="recipe='delayed', fp8_weights=True, optimizer_states='bf16'"):
        create_backend(recipe, RunContext(device=DEVICE_FOR["delayed"]), require_package=False)
    compiled = create_backend(recipe, RunContext(device=DEVICE_FOR["current"], compiled=True), require_package=False)
    assert compiled.recipe_name == "current"


class _Shard:
    """A parameter as FSDP2 leaves it, for `empty_shard_problem`: its global shape and a one-dimensional mesh."""

    def __init__(self, *shape: int, world: int):
        self.shape, self.device_mesh = torch.Size(shape), type("Mesh", (), {"ndim": 1, "size": lambda _, d: world})()

    def dim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return self.shape.numel()


@pytest.mark.parametrize("moments, shapes, world, refused", [
    ((torch.float16, torch.float16), [(64, 8), (8,)], 2, False),
    ((torch.uint8, torch.float16), [(64, 8), (1,)], 2, True),  # a Linear(h, 1)'s bias: rank 1 holds nothing
    ((torch.uint8, torch.float16), [(5, 3)], 4, True),  # the ranks hold 2, 2, 1 and 0 rows
    ((torch.uint8, torch.float16), [(3, 3)], 4, True),  # 1, 1, 1 and 0
    ((torch.uint8, torch.float16), [(3, 3)], 2, False),  # 2 and 1
    ((torch.bfloat16, torch.float32), [(1,)], 2, False),  # BF16 and FP32 moments are not rescaled from an aminmax
])
def test_fp16_and_fp8_moments_refuse_fsdp2_shards_empty_on_a_rank(moments, shapes, world, refused):
    from types import SimpleNamespace

    from lowprec.backends.te.fsdp import empty_shard_problem

    optimizer = SimpleNamespace(exp_avg_dtype=moments[0], exp_avg_sq_dtype=moments[1],
                                param_groups=[{"params": [_Shard(*s, world=world) for s in shapes]}])
    problem = empty_shard_problem(optimizer)
    assert (problem is not None) == refused
    if refused:
        assert "have no elements on some rank" in problem and "use optimizer_states 'fp32', 'bf16'" in problem


def test_fp8_weights_seeds_fp32_masters_from_the_weights_before_quantisation(fake_te):
    backend, model, plan = fp8_weights_setup()
    # What convert() records for each FP8-only weight it builds; it builds them on the GPU only.
    original = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    backend._hp_weights[id(model[0].weight)] = original
    new = backend.wrap_optimizer(torch.optim.AdamW(model.parameters()), plan)
    assert list(new.scaled_state) == [(id(model[0].weight), "master_param")]
    assert torch.equal(new.scaled_state[(id(model[0].weight), "master_param")], original)
    assert backend._hp_weights == {}


def test_fp8_weights_missing_from_the_optimizer_warn(fake_te):
    backend, model, plan = fp8_weights_setup()
    frozen = nn.Linear(64, 64).weight
    backend._hp_weights[id(frozen)] = torch.zeros(64, 64)
    with pytest.warns(UserWarning, match="some FP8-only weights were not in the optimizer passed to prepare"):
        new = backend.wrap_optimizer(torch.optim.AdamW(model.parameters()), plan)
    assert new.scaled_state == {} and backend._hp_weights == {}


def test_without_fp8_weights_the_optimizer_is_kept(fake_te):
    backend = te_backend("current")
    model = nn.Sequential(nn.Linear(64, 64))
    optimizer = torch.optim.AdamW(model.parameters())
    plan = build_plan(model, backend.recipe, context=backend.context, backend=backend)
    assert backend.wrap_optimizer(optimizer, plan) is optimizer


@pytest.mark.parametrize(("option", "value"), [("amax_history_len", 16), ("margin", 1), ("reduce_amax", False),
                                               ("amax_compute_algo", "most_recent")])
def test_a_delayed_only_option_is_refused_where_te_runs_current_by_default(option, value):
    # no recipe named: a compiled model runs 'current', which has no amax history to honour the option with
    with pytest.raises(ValueError) as err:
        create_backend(te_kwargs(**{option: value}), RunContext(device=H100, compiled=True), require_package=False)
    message = str(err.value)
    assert "names no recipe" in message and "'current'" in message and "compiled model" in message
    assert f"{option}={value!r}" in message
    # an eager model runs 'delayed', which honours it
    backend = create_backend(te_kwargs(**{option: value}), RunContext(device=H100), require_package=False)
    assert backend.recipe_name == "delayed"


def test_auto_passes_over_te_where_its_compiled_default_cannot_honour_an_option(fake_te):
    recipe = FP8RecipeKwargs(amax_history_len=16)
    cls, passed_over = auto_choice(recipe, RunContext(device=H100, compiled=True))
    assert cls.name == "msamp"  # the compilable backend with delayed scaling
    te_reason = next(r for r in passed_over if r.startswith("te:"))
    assert "names no recipe" in te_reason and "amax_history_len=16" in te_reason


def test_fp8_weights_give_fused_adam_every_parameters_state_before_a_checkpoint(fake_te):
    # With fp8_weights the FP8 weights' masters are seeded before any step, so FusedAdam holds some state, and DCP's
    # optimizer state dict (what Accelerate saves and loads under FSDP2) makes state only for an optimizer holding
    # none: its load then failed for the embeddings (one H200, 128d7a2). The backend gives every trainable parameter
    # the state its first step would; the seeded master is kept, a frozen parameter gets none.
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    backend, model, plan = fp8_weights_setup()
    model[1].bias.requires_grad_(False)
    original = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    backend._hp_weights[id(model[0].weight)] = original
    new = backend.wrap_optimizer(torch.optim.AdamW(model.parameters()), plan)
    assert set(get_optimizer_state_dict(model, new)["state"]) == {"0.weight"}
    backend.complete_optimizer_state(new)
    state = get_optimizer_state_dict(model, new)["state"]
    assert set(state) == {"0.weight", "0.bias", "1.weight"}
    assert torch.equal(state["0.weight"]["master_param"], original)
    for name, p in [("0.bias", model[0].bias), ("1.weight", model[1].weight)]:
        assert torch.equal(state[name]["master_param"], p.detach().float())
        assert not state[name]["exp_avg"].any() and not state[name]["exp_avg_sq"].any()
    assert [g["step"] for g in new.param_groups] == [0]  # FusedAdam's first step is 1 from 0 as from no count
    new.param_groups[0]["step"] = 7
    before = {k: {n: t.clone() for n, t in v.items()} for k, v in state.items()}
    backend.complete_optimizer_state(new)  # a second save: nothing changes
    assert new.param_groups[0]["step"] == 7
    after = get_optimizer_state_dict(model, new)["state"]
    assert all(torch.equal(after[k][n], t) for k, v in before.items() for n, t in v.items())


def test_without_fp8_weights_the_optimizer_state_is_left_alone(fake_te):
    backend = te_backend("current")
    model = nn.Sequential(nn.Linear(8, 8))
    optimizer = torch.optim.AdamW(model.parameters())
    backend.complete_optimizer_state(optimizer)
    assert not optimizer.state
