"""Backend registry: names, auto-selection, and what happens when an optional package is missing."""

from __future__ import annotations

import pytest

from lowprec import BackendUnavailableError, FP8RecipeKwargs, MissingDependencyError, RunContext, build_plan
from lowprec.backends import (
    backend_class,
    canonical_name,
    create_backend,
    registered_backends,
    resolve_backend,
)
from lowprec.backends.msamp import MSAMPBackend
from lowprec.backends.te import TEBackend
from lowprec.backends.torchao import TorchAOBackend
from lowprec.planning.hardware import DeviceInfo, device_info
from lowprec.utils import imports

CPU = device_info("cpu")
H100 = DeviceInfo("cuda", "H100", (9, 0))
A100 = DeviceInfo("cuda", "A100", (8, 0))


@pytest.mark.parametrize(
    "name,canonical",
    [
        ("torchao", "torchao"), ("AO", "torchao"), (" ao ", "torchao"),
        ("te", "te"), ("TE", "te"), ("transformer_engine", "te"), ("Transformer-Engine", "te"),
        ("transformerengine", "te"),
        ("msamp", "msamp"), ("MS-AMP", "msamp"), ("ms_amp", "msamp"),
        ("auto", "auto"), ("Auto", "auto"),
    ],
)
def test_canonical_name(name, canonical):
    assert canonical_name(name) == canonical


@pytest.mark.parametrize("name", ["", "fp8", "torch_ao", "deepspeed", None])
def test_canonical_name_unknown(name):
    with pytest.raises(ValueError, match=r"FP8RecipeKwargs.backend=.* is not one of 'auto', 'torchao', 'te', 'msamp'"):
        canonical_name(name)


def test_registered_backends():
    assert registered_backends() == [TorchAOBackend, TEBackend, MSAMPBackend]
    assert backend_class("AO") is TorchAOBackend
    for cls in registered_backends():
        assert cls.default_recipe in cls.recipes
        for info in cls.recipes.values():
            assert info.formats and set(info.formats) <= {"HYBRID", "E4M3"}


# ---- resolve_backend --------------------------------------------------------------------------------
@pytest.mark.parametrize("device", [CPU, A100, H100], ids=["cpu", "a100", "h100"])
def test_auto_without_te_installed_is_torchao(device):
    # auto tries te, torchao, msamp in that order; tests/conftest.py hides any installed TE
    assert resolve_backend(FP8RecipeKwargs(), device) is TorchAOBackend


@pytest.mark.parametrize("name", ["rowwise", "rowwise_with_gw_hp"])
def test_auto_with_a_recipe_only_torchao_offers(name):
    assert resolve_backend(FP8RecipeKwargs(recipe=name), CPU) is TorchAOBackend


def test_auto_emulate_false_on_cpu_finds_nothing():
    with pytest.raises(BackendUnavailableError) as err:
        resolve_backend(FP8RecipeKwargs(emulate=False), CPU)
    message = str(err.value)
    assert "te: transformer_engine is not installed" in message
    assert "msamp: cannot run on CPU" in message
    assert "torchao: cannot run on CPU" in message


def test_auto_emulate_false_on_h100_is_torchao():
    assert resolve_backend(FP8RecipeKwargs(emulate=False), H100) is TorchAOBackend


@pytest.mark.parametrize(
    "kwargs,field,torchao_reason",
    [
        (dict(recipe="block"), "recipe", "not a recipe of backend 'torchao'"),
        # te alone honours these together (rowwise with HYBRID or a margin: refused at construction)
        (dict(margin=1, fp8_weights=True), "margin", "applies to delayed"),
        (dict(reduce_amax=True, fp8_weights=True), "reduce_amax", "applies to delayed"),
    ],
)
def test_auto_reports_why_each_backend_was_passed_over(kwargs, field, torchao_reason):
    r = FP8RecipeKwargs(**kwargs)  # accepted by auto at construction: a backend (te) honours the options together
    with pytest.raises(BackendUnavailableError, match="backend='auto'.* found no backend") as err:
        resolve_backend(r, H100)
    assert f"torchao: FP8RecipeKwargs.{field}=" in str(err.value)
    assert torchao_reason in str(err.value)
    assert "te: transformer_engine is not installed" in str(err.value)
    assert "msamp: FP8RecipeKwargs." in str(err.value)


@pytest.mark.parametrize("kwargs", [dict(recipe="delayed"), dict(margin=1)])
def test_auto_takes_msamp_for_what_only_it_offers_here(kwargs):
    # Without TE, the delayed recipe and its options exist only in msamp.
    assert resolve_backend(FP8RecipeKwargs(**kwargs), H100).name == "msamp"


def test_explicit_backend_resolves_to_itself():
    assert resolve_backend(FP8RecipeKwargs(backend="ao"), CPU) is TorchAOBackend


# ---- create_backend -------------------------------------------------------------------------------------
def test_create_backend_binds_the_resolved_name():
    backend = create_backend(FP8RecipeKwargs(recipe="rowwise"), RunContext(device=CPU))
    assert isinstance(backend, TorchAOBackend)
    assert backend.recipe.backend == "torchao" and backend.recipe_name == "rowwise" and backend.fp8_format == "E4M3"


def test_create_backend_keeps_a_bound_recipe():
    r = FP8RecipeKwargs(backend="torchao")
    assert create_backend(r, RunContext(device=CPU)).recipe is r


@pytest.fixture
def torchao_missing(monkeypatch):
    """torchao looked up under a module name that does not exist (the rest of its entry unchanged)."""
    real = imports.OPTIONAL_PACKAGES["torchao"]
    monkeypatch.setitem(
        imports.OPTIONAL_PACKAGES,
        "torchao",
        imports.OptionalPackage("lowprec_no_such_module.float8", "lowprec-no-such-dist", real.min_version,
                                real.install_hint),
    )
    imports.availability.cache_clear()
    yield
    imports.availability.cache_clear()


@pytest.fixture
def torchao_too_old(monkeypatch):
    monkeypatch.setitem(
        imports.OPTIONAL_PACKAGES, "torchao",
        imports.OptionalPackage("torchao.float8", "torchao", "999.0",
                                imports.OPTIONAL_PACKAGES["torchao"].install_hint),
    )
    imports.availability.cache_clear()
    yield
    imports.availability.cache_clear()


def test_create_backend_without_torchao(torchao_missing):
    recipe = FP8RecipeKwargs(backend="torchao")  # validation needs no package
    with pytest.raises(BackendUnavailableError) as err:
        create_backend(recipe, RunContext(device=CPU))
    message = str(err.value)
    assert "backend='torchao'" in message and "not installed" in message
    assert "pip install 'torchao>=0.15'" in message and "pip install -e '.[torchao]'" in message


def test_auto_without_torchao_takes_msamp(torchao_missing):
    # msamp needs no optional package, so auto still finds an FP8 backend (never a BF16 fallback).
    assert create_backend(FP8RecipeKwargs(), RunContext(device=CPU)).name == "msamp"


def test_torchao_without_torchao(torchao_missing):
    with pytest.raises(BackendUnavailableError, match="torchao.*not installed.*pip install"):
        create_backend(FP8RecipeKwargs(backend="torchao"), RunContext(device=CPU))


def test_plan_without_torchao_with_an_adapter_created_for_planning(torchao_missing):
    import torch.nn as nn

    recipe = FP8RecipeKwargs(backend="torchao", skip_first_last=False, skip_slow_shapes=False)
    context = RunContext(device=H100)
    backend = create_backend(recipe, context, require_package=False)
    plan = build_plan(nn.Sequential(nn.Linear(64, 64)), recipe, context=context, backend=backend)
    assert [d.fqn for d in plan.converted] == ["0"]
    with pytest.raises(MissingDependencyError, match="pip install"):
        backend.float8_config()  # converting does need the package


def test_create_backend_with_torchao_too_old(torchao_too_old):
    message = r"torchao .* is installed but lowprec needs >= 999.0.*pip install"
    with pytest.raises(BackendUnavailableError, match=message):
        create_backend(FP8RecipeKwargs(backend="torchao"), RunContext(device=CPU))


def test_backend_availability_classmethod(torchao_missing):
    ok, reason = TorchAOBackend.availability()
    assert not ok and "pip install" in reason
    assert MSAMPBackend.availability() == (True, "")  # no package


# ---- utils.imports ---------------------------------------------------------------------------------------
def test_require_present_package():
    module = imports.require("torchao", feature="test")
    assert module.__name__ == "torchao.float8"
    assert imports.is_available("torchao")
    assert imports.installed_version("torchao")


def test_require_missing_package(torchao_missing):
    assert not imports.is_available("torchao")
    with pytest.raises(MissingDependencyError) as err:
        imports.require("torchao", feature="backend='torchao'")
    assert isinstance(err.value, ImportError)
    assert str(err.value).startswith(
        "backend='torchao' needs lowprec-no-such-dist: lowprec-no-such-dist is not installed")
    assert "pip install 'torchao>=0.15'" in str(err.value)


def test_require_too_old(torchao_too_old):
    with pytest.raises(MissingDependencyError, match="needs >= 999.0"):
        imports.require("torchao", feature="x")


def test_require_broken_install(monkeypatch):
    real = imports.importlib.import_module

    def broken(name, *args, **kwargs):
        if name.startswith("torchao"):
            raise OSError("libcudart.so.12: cannot open shared object file")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(imports.importlib, "import_module", broken)
    with pytest.raises(MissingDependencyError, match="installed but failed to import: OSError: libcudart"):
        imports.require("torchao", feature="backend='torchao'")


@pytest.mark.parametrize("name", list(imports.OPTIONAL_PACKAGES))
def test_every_optional_package_has_a_pip_hint(name):
    assert "pip install" in imports.OPTIONAL_PACKAGES[name].install_hint
