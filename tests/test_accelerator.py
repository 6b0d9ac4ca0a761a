"""`lowprec.Accelerator` end to end on CPU: conversion, training, Accelerate features, checkpoints."""

from __future__ import annotations

import os
import re

import pytest
import torch
from conftest import causal_lm_losses
from torch import nn

from lowprec import Accelerator, FP8RecipeKwargs

pytest.importorskip("torchao")
pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


def is_fp8(module: nn.Module) -> bool:
    return type(module).__name__ == "Float8Linear"


def regression_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 16)
    )


def regression_data(n: int = 256, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 32, generator=g)
    w = torch.randn(32, 16, generator=g) / 4
    return torch.utils.data.TensorDataset(x, torch.tanh(x @ w))


def recipe(**kwargs) -> FP8RecipeKwargs:
    kwargs.setdefault("backend", "torchao")
    kwargs.setdefault("skip_slow_shapes", False)
    return FP8RecipeKwargs(**kwargs)


def train(accelerator, model, optimizer, loader, epochs: int = 1, clip: float | None = None):
    losses = []
    model.train()
    for _ in range(epochs):
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = nn.functional.mse_loss(model(x).float(), y)
                accelerator.backward(loss)
                if clip is not None and accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), clip)
                optimizer.step()
                optimizer.zero_grad()
            losses.append(loss.item())
    return losses


@pytest.mark.parametrize("name", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_prepare_converts_per_plan_and_loss_falls(fresh_accelerate_state, name):
    # rowwise_with_gw_hp failed on a CPU in its first backward (torchao puts the input in CUDA autocast's dtype
    # only: its high-precision weight-gradient GEMM met a BF16 gradient and an FP32 input)
    accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[recipe(recipe=name)])
    model = regression_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = torch.utils.data.DataLoader(regression_data(), batch_size=32)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    plan = accelerator.precision_plan
    built = {name: is_fp8(m) for name, m in accelerator.unwrap_model(model).named_modules() if isinstance(m, nn.Linear)}
    assert built == {d.fqn: d.convert for d in plan.modules}
    assert built == {"0": True, "2": True, "4": True, "6": True}  # every Linear (skip_first_last is off by default)
    assert accelerator.mixed_precision == "fp8" and accelerator.fp8_enabled
    assert plan.emulated  # CPU

    losses = train(accelerator, model, optimizer, loader, epochs=6)
    first, last = sum(losses[:8]) / 8, sum(losses[-8:]) / 8
    assert last < 0.5 * first, (first, last)


def test_plan_is_logged_once(caplog):
    import logging

    caplog.set_level(logging.INFO, logger="lowprec")
    accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[recipe()])
    model = accelerator.prepare(regression_model())
    with pytest.raises(ValueError, match="already prepared"):  # a second prepare of the model is refused (issue 27)
        accelerator.prepare(model)
    logged = [r for r in caplog.records if "lowprec precision plan" in r.getMessage()]
    assert len(logged) == 1
    assert len(accelerator.precision_plans) == 1


def test_recipe_from_environment_alone(monkeypatch):
    """What `accelerate launch --config_file` produces from an `fp8_config:` section."""
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp8")
    monkeypatch.setenv("ACCELERATE_FP8_BACKEND", "AO")  # accelerate's own spelling
    monkeypatch.setenv("ACCELERATE_FP8_RECIPE", "rowwise_with_gw_hp")
    monkeypatch.setenv("ACCELERATE_FP8_SKIP_SLOW_SHAPES", "false")
    monkeypatch.setenv("ACCELERATE_FP8_EXCLUDE", "4")
    accelerator = Accelerator()
    model = accelerator.prepare(regression_model())
    plan = accelerator.precision_plan
    assert (plan.backend, plan.recipe) == ("torchao", "rowwise_with_gw_hp")
    assert [d.fqn for d in plan.converted] == ["0", "2", "6"]
    assert is_fp8(accelerator.unwrap_model(model)[2]) and not is_fp8(accelerator.unwrap_model(model)[4])


def test_accelerate_handler_is_translated():
    from accelerate.utils import AORecipeKwargs

    accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[AORecipeKwargs()])
    accelerator.prepare(regression_model())
    assert accelerator.precision_plan.backend == "torchao"
    assert accelerator.fp8_recipe.pad_inner_dim is True  # Accelerate's default, honoured


@pytest.mark.parametrize("mixed_precision", [None, "fp8"])
def test_lowprecs_handler_in_accelerates_accelerator_points_at_lowprecs(mixed_precision):
    # the most common mistake: before, a KeyError naming the class from deep inside Accelerate's __init__
    import accelerate

    class Subclass(accelerate.Accelerator):
        pass

    for cls in (accelerate.Accelerator, Subclass):
        with pytest.raises(TypeError) as err:
            cls(mixed_precision=mixed_precision, kwargs_handlers=[FP8RecipeKwargs(backend="torchao")])
        assert "lowprec.FP8RecipeKwargs works with lowprec.Accelerator: `from lowprec import Accelerator`" in str(
            err.value)
        assert "maps kwargs_handlers by exact class" in str(err.value)
    # lowprec's Accelerator and the handler's own uses are untouched
    handler = FP8RecipeKwargs(backend="torchao")
    assert handler.__class__ is FP8RecipeKwargs and handler.replace(recipe="rowwise").recipe == "rowwise"
    assert Accelerator(mixed_precision=mixed_precision, kwargs_handlers=[handler]).fp8_recipe is handler


def test_without_fp8_accelerate_is_untouched():
    accelerator = Accelerator(mixed_precision="bf16")
    model = accelerator.prepare(regression_model())
    assert accelerator.precision_plan is None and accelerator.mixed_precision == "bf16"
    assert not any(is_fp8(m) for m in model.modules())


@pytest.mark.parametrize("mixed_precision", ["bf16", "fp16", "no"])
def test_fp8_handler_with_other_mixed_precision_is_an_error(mixed_precision):
    with pytest.raises(ValueError, match="mixed_precision='fp8'"):
        Accelerator(mixed_precision=mixed_precision, kwargs_handlers=[recipe()])


@pytest.mark.parametrize("mixed_precision", [8, True, torch.float8_e4m3fn, "", " "])
def test_a_mixed_precision_that_is_no_str_is_named(mixed_precision):
    # an int failed on its missing .lower() (AttributeError); '' passed as unset where Accelerate refuses it
    error = ValueError if isinstance(mixed_precision, str) else TypeError
    with pytest.raises(error, match=r"mixed_precision=.*: give one of 'no', 'fp16', 'bf16', 'fp8' \(a str\)"):
        Accelerator(mixed_precision=mixed_precision, kwargs_handlers=[recipe()])


def test_two_fp8_handlers_is_an_error():
    from accelerate.utils import AORecipeKwargs

    with pytest.raises(ValueError, match="2 FP8 recipe handlers"):
        Accelerator(mixed_precision="fp8", kwargs_handlers=[recipe(), AORecipeKwargs()])


def test_handler_alone_turns_fp8_on():
    accelerator = Accelerator(kwargs_handlers=[recipe()])
    accelerator.prepare(regression_model())
    assert accelerator.mixed_precision == "fp8" and accelerator.precision_plan is not None


@pytest.fixture
def accelerate_fp8_calls(monkeypatch):
    """Accelerate's own FP8 code, recorded and stopped if it runs: lowprec must be the only one converting."""
    import accelerate.accelerator as accelerate_module

    calls = []

    def stop(name):
        def call(*args, **kwargs):
            calls.append(name)
            raise AssertionError(f"Accelerate's own FP8 path ran: {name}")

        return call

    for name in ("_prepare_ao", "_prepare_te", "_prepare_msamp"):
        monkeypatch.setattr(accelerate_module.Accelerator, name, stop(name))
    for name in ("convert_model_to_fp8_ao", "convert_model", "apply_fp8_autowrap"):
        monkeypatch.setattr(accelerate_module, name, stop(name))
    return calls


@pytest.mark.parametrize("env_backend,backend", [("AO", "torchao"), ("MSAMP", "msamp")])
def test_accelerates_own_fp8_paths_stay_off(monkeypatch, accelerate_fp8_calls, env_backend, backend):
    """ACCELERATE_FP8_BACKEND would send Accelerate's own code into torchao / MS-AMP; lowprec converts instead."""
    monkeypatch.setenv("ACCELERATE_FP8_BACKEND", env_backend)
    accelerator = Accelerator(mixed_precision="fp8")
    assert accelerator.fp8_recipe.backend == backend
    # For "fp8" without a handler Accelerate makes a recipe handler of its own (and a GradScaler for MS-AMP).
    assert (accelerator.ao_recipe_handler, accelerator.te_recipe_handler, accelerator.msamp_recipe_handler) == (
        None, None, None)
    assert accelerator.scaler is None and accelerator.state.mixed_precision == "bf16"
    model = regression_model()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    x, y = regression_data(16)[:]
    accelerator.backward(nn.functional.mse_loss(model(x).float(), y))
    optimizer.step()
    assert accelerator.precision_plan.backend == backend and accelerator.precision_plan.converted
    assert accelerate_fp8_calls == []


def test_accelerate_fp8_backend_te_gets_lowprecs_answer(monkeypatch, accelerate_fp8_calls):
    """Accelerate's TE path would fail with its own ImportError; lowprec's says what to install. (No TE here:
    tests/conftest.py hides it.)"""
    from lowprec import BackendUnavailableError

    monkeypatch.setenv("ACCELERATE_FP8_BACKEND", "TE")
    with pytest.raises(BackendUnavailableError) as err:
        Accelerator(mixed_precision="fp8")
    message = str(err.value)
    assert message.startswith("FP8RecipeKwargs(backend='te') cannot be used: transformer_engine is not installed")
    assert accelerate_fp8_calls == []


def test_prepare_model_directly_converts():
    accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[recipe(skip_first_last=False)])
    model = accelerator.prepare_model(regression_model())
    assert all(is_fp8(m) for m in model.modules() if isinstance(m, nn.Linear))


def test_gradient_accumulation_steps_once_per_window():
    accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[recipe()], gradient_accumulation_steps=2)
    model = regression_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(regression_data(64), batch_size=16)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    weight = accelerator.unwrap_model(model)[2].weight
    snapshots = [weight.detach().clone()]
    for x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(nn.functional.mse_loss(model(x).float(), y))
            optimizer.step()
            optimizer.zero_grad()
        snapshots.append(weight.detach().clone())
    changed = [not torch.equal(a, b) for a, b in zip(snapshots, snapshots[1:])]
    assert changed == [False, True, False, True]  # only micro-steps 2 and 4 step the optimizer


def test_clip_grad_norm_is_the_true_norm():
    accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[recipe()])
    model = regression_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    model, optimizer = accelerator.prepare(model, optimizer)
    x, y = regression_data(32)[:]
    accelerator.backward(nn.functional.mse_loss(model(x).float(), y))
    expected = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    total = accelerator.clip_grad_norm_(model.parameters(), max_norm=1e-3)
    torch.testing.assert_close(total, expected)
    clipped = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    assert clipped <= 1.01e-3


def test_save_state_load_state_resumes_exactly(tmp_path):
    data = regression_data(128)

    def setup(seed):
        accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[recipe()])
        model = regression_model(seed)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        loader = torch.utils.data.DataLoader(data, batch_size=32)
        return accelerator, *accelerator.prepare(model, optimizer, scheduler, loader)

    def steps(accelerator, model, optimizer, scheduler, loader):
        out = []
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x).float(), y)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            out.append(loss.item())
        return out

    accelerator, model, optimizer, scheduler, loader = setup(0)
    steps(accelerator, model, optimizer, scheduler, loader)
    accelerator.save_state(str(tmp_path / "ckpt"))
    continued = steps(accelerator, model, optimizer, scheduler, loader)

    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    accelerator, model, optimizer, scheduler, loader = setup(1)  # different init: the checkpoint must win
    accelerator.load_state(str(tmp_path / "ckpt"))
    resumed = steps(accelerator, model, optimizer, scheduler, loader)
    assert resumed == continued


def test_checkpoint_loads_into_a_plain_model(tmp_path):
    accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[recipe()])
    model = regression_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = torch.utils.data.DataLoader(regression_data(), batch_size=32)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    train(accelerator, model, optimizer, loader)

    accelerator.save_model(model, str(tmp_path / "model"))  # safetensors
    plain = regression_model(seed=5)
    from safetensors.torch import load_file

    state = load_file(str(tmp_path / "model" / "model.safetensors"))
    plain.load_state_dict(state, strict=True)  # same keys, plain tensors: no FP8 classes needed
    trained = accelerator.unwrap_model(model)
    for name, tensor in plain.state_dict().items():
        torch.testing.assert_close(tensor, trained.state_dict()[name])
    assert all(type(m) is nn.Linear for m in plain.modules() if isinstance(m, nn.Linear))

    torch.save(trained.state_dict(), tmp_path / "sd.pt")
    reloaded = torch.load(tmp_path / "sd.pt", weights_only=True)
    regression_model().load_state_dict(reloaded, strict=True)


def test_tiny_llama_trains_through_accelerate():
    from lowprec.demo.data import Windows, stdlib_corpus
    from lowprec.demo.model import PRESETS, build_model

    preset = PRESETS["tiny"]
    accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[recipe(skip_first_last=False)])
    torch.manual_seed(0)
    model = build_model(preset)
    corpus = stdlib_corpus(max_bytes=2**20)
    loader = torch.utils.data.DataLoader(Windows(corpus.train, 64, 12 * 8, seed=0), batch_size=8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    plan = accelerator.precision_plan
    assert len(plan.converted) == 2 * 7 + 1  # every projection and the head
    losses = causal_lm_losses(accelerator, model, optimizer, loader)
    assert losses[-1] < losses[0] - 1.0, losses
    fp8_modules = [n for n, m in accelerator.unwrap_model(model).named_modules() if is_fp8(m)]
    assert sorted(fp8_modules) == sorted(d.fqn for d in plan.converted)


@pytest.mark.slow
def test_ddp_two_processes_gloo(tmp_path):
    """Two CPU processes over gloo: FP8 layers, gradients in sync, loss falls.

    `accelerate launch --multi_gpu` is torchrun underneath, but on a CPU-only host it exports
    ACCELERATE_USE_CPU=False and Accelerate then sees one process; so torchrun is called directly
    with the variables `accelerate launch --mixed_precision fp8` exports.
    """
    from conftest import run_two_ranks

    script = os.path.join(os.path.dirname(__file__), "distributed", "ddp_train.py")
    result = run_two_ranks(script, out=tmp_path / "result.json", timeout=600, ACCELERATE_USE_CPU="1",
                           ACCELERATE_MIXED_PRECISION="fp8")
    assert result["world_size"] == 2 and result["engine"] == "ddp"
    assert result["fp8_modules"] == ["0", "2", "4", "6"]
    assert result["max_param_diff_across_ranks"] == 0.0
    assert result["last_loss"] < 0.6 * result["first_loss"]


# ---- errors at construction, not at prepare() (issue 16) -----------------------------------------
def test_emulate_false_without_fp8_hardware_fails_at_construction(monkeypatch):
    from lowprec import BackendUnavailableError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(BackendUnavailableError) as err:
        Accelerator(mixed_precision="fp8", kwargs_handlers=[recipe(emulate=False)], cpu=True)
    assert "emulate=False forbids emulation" in str(err.value)


def test_te_without_transformer_engine_fails_at_construction(monkeypatch):
    from lowprec import BackendUnavailableError

    monkeypatch.setattr("lowprec.backends.base.availability",
                        lambda name: (False, f"{name} is not installed. Install it with: X"))
    with pytest.raises(BackendUnavailableError) as err:
        Accelerator(mixed_precision="fp8", kwargs_handlers=[FP8RecipeKwargs(backend="te", recipe="current")], cpu=True)
    assert str(err.value).startswith(
        "FP8RecipeKwargs(backend='te') cannot be used: transformer_engine is not installed")


# ---- values accelerate launch exports whether or not they were chosen (issue 16) -----------------
LAUNCHER = {"ACCELERATE_FP8_OVERRIDE_FPROP": "False", "ACCELERATE_FP8_OPT_LEVEL": "O2",
            "ACCELERATE_FP8_PAD_INNER_DIM": "1", "ACCELERATE_FP8_MARGIN": "0"}


def test_launcher_default_that_would_change_the_run_is_a_plan_note_not_a_warning(monkeypatch):
    # Every `accelerate launch --mixed_precision fp8` run exports these, written in fp8_config or not: a warning
    # would come with every launched run (issue 31). The plan's notes say which were set aside and how to apply one.
    import warnings

    for name, value in LAUNCHER.items():
        monkeypatch.setenv(name, value)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[recipe()], cpu=True)
        accelerator.prepare(regression_model())
    assert not [w for w in record if "ACCELERATE_FP8_" in str(w.message)]
    plan = accelerator.precision_plan
    assert plan.opt_level is None and plan.options["pad_inner_dim"] is False  # set aside, not applied
    note = next(n for n in plan.notes if n.startswith("accelerate launch exported its own defaults"))
    assert "ACCELERATE_FP8_OPT_LEVEL=O2 (in force: None)" in note and "ACCELERATE_FP8_PAD_INNER_DIM=1" in note
    assert "MARGIN" not in note  # torchao's tensorwise recipe has no margin: nothing is lost
    assert "`lowprec_<key>:` in fp8_config" in note
    assert note in str(plan) and note not in plan.summary()


def test_launcher_default_equal_to_what_is_in_force_is_silent(monkeypatch):
    import warnings

    for name, value in LAUNCHER.items():
        monkeypatch.setenv(name, value)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        # msamp's default level is O2 and it has no pad_inner_dim: the exported values change nothing
        accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[FP8RecipeKwargs(backend="msamp")], cpu=True)
        accelerator.prepare(regression_model())
    assert not [w for w in record if "ACCELERATE_FP8_" in str(w.message)]
    assert not [n for n in accelerator.precision_plan.notes if "accelerate launch exported" in n]


def test_launcher_default_overridden_in_code_is_not_reported(monkeypatch):
    import warnings

    for name, value in LAUNCHER.items():
        monkeypatch.setenv(name, value)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        handler = recipe(backend="msamp", opt_level="O1", pad_inner_dim=False)
        accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[handler], cpu=True)
        accelerator.prepare(regression_model())
    assert not [w for w in record if "ACCELERATE_FP8_" in str(w.message)]
    assert not [n for n in accelerator.precision_plan.notes if "accelerate launch exported" in n]


# ---- a run with few or no FP8 layers says so at prepare() (issue 16) -----------------------------------
def shortfall_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "runs in FP8" in str(w.message) or "run in FP8" in str(w.message)]


def prepare_recording(accelerator, *objects):
    import warnings

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        result = accelerator.prepare(*objects)
    return result, shortfall_warnings(record), record


def test_no_fp8_layer_is_one_warning_naming_the_option():
    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(64, 256)
            self.down = nn.Linear(256, 64)

    recipe = FP8RecipeKwargs(backend="torchao", skip_first_last=True)
    accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[recipe])
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters())
    _, found, record = prepare_recording(accelerator, model, optimizer)
    assert len(found) == 1, found
    assert found[0].startswith("lowprec: model MLP: no Linear layer (of 2) runs in FP8 on CPU")
    assert "2 Linear layers: first and last Linear layers (skip_first_last=True) -> skip_first_last=False" in found[0]
    # it points at the caller's prepare(), not at lowprec
    assert next(w for w in record if "runs in FP8" in str(w.message)).filename == __file__


def test_exclude_covering_everything_is_a_warning():
    accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[recipe(exclude="*")])
    _, found, _ = prepare_recording(accelerator, regression_model())
    assert len(found) == 1 and "4 Linear layers: excluded by pattern '*' -> remove '*' from exclude" in found[0]


def test_exclude_pattern_matching_nothing_fails_before_conversion():
    accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[recipe(exclude=["lm_haed"])])
    model = regression_model()
    with pytest.raises(ValueError, match="exclude has 'lm_haed', which matches no module of Sequential"):
        accelerator.prepare(model)
    assert not any(is_fp8(m) for m in model.modules())


class Stack(nn.Module):
    """Four blocks in an nn.ModuleList between an input and an output Linear."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(32, 64)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64)) for _ in range(4))
        self.out = nn.Linear(64, 16)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = x + block(x)
        return self.out(x)


def test_kept_blocks_stay_plain_linears_through_prepare():
    accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[recipe(skip_first_blocks=1, skip_last_blocks=1)])
    model = Stack()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    built = accelerator.unwrap_model(model)
    for name in ("blocks.0.0", "blocks.0.2", "blocks.3.0", "blocks.3.2"):
        assert type(built.get_submodule(name)) is nn.Linear, name
    assert all(is_fp8(built.get_submodule(n)) for n in ("inp", "blocks.1.0", "blocks.1.2", "blocks.2.0", "out"))
    assert {d.fqn: d.rule for d in accelerator.precision_plan.skipped} == {
        "blocks.0.0": "skip_first_blocks", "blocks.0.2": "skip_first_blocks",
        "blocks.3.0": "skip_last_blocks", "blocks.3.2": "skip_last_blocks"}
    x, y = next(iter(torch.utils.data.DataLoader(regression_data(), batch_size=32)))
    before = built.blocks[0][0].weight.detach().clone()
    accelerator.backward(nn.functional.mse_loss(model(x).float(), y))
    optimizer.step()
    assert not torch.equal(before, built.blocks[0][0].weight)  # a kept block still trains


def test_too_many_blocks_fail_at_prepare_before_conversion():
    accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[recipe(skip_first_blocks=3, skip_last_blocks=2)])
    model = Stack()
    with pytest.raises(ValueError, match="skip_first_blocks=3 and skip_last_blocks=2 keep 5 blocks in high precision, "
                                         "but Stack has 4"):
        accelerator.prepare(model)
    assert not any(is_fp8(m) for m in model.modules())


def test_grad_comm_dtype_on_one_process_is_a_warning():
    with pytest.warns(UserWarning, match=r"grad_comm_dtype='bf16' has no effect in this run: one process"):
        accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[recipe(grad_comm_dtype="bf16")])
    assert accelerator.fp8_recipe.grad_comm_dtype == "bf16"  # accepted: the same recipe runs on several processes


@pytest.mark.parametrize(("fields", "said"), [
    (dict(backend="msamp", reduce_amax=False), "reduce_amax=False has no effect in this run: one process"),
    (dict(backend="torchao", enable_fsdp_float8_all_gather=True),
     "enable_fsdp_float8_all_gather=True has no effect in this run: it applies under FSDP2, and this run's engine "
     "is single"),
])
def test_an_option_this_run_cannot_use_is_a_warning(fields, said):
    with pytest.warns(UserWarning, match=re.escape(said)):
        Accelerator(mixed_precision="fp8", kwargs_handlers=[recipe(**fields)])


def test_each_model_with_no_fp8_layer_gets_its_warning():
    accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[recipe(exclude="*")])
    _, found, _ = prepare_recording(accelerator, regression_model(), regression_model(1))
    assert len(found) == 2


def test_defaults_on_four_square_linears_warn_only_when_few_convert():
    # On the CPU nothing is measured to be slow: every Linear converts; with first and last kept, half
    # the parameters are FP8, which is not "few" either.
    for skip_first_last, expected in ((None, [True] * 4), (True, [False, True, True, False])):
        accelerator = Accelerator(mixed_precision="fp8",
                                  kwargs_handlers=[FP8RecipeKwargs(backend="torchao", skip_first_last=skip_first_last)])
        _, found, _ = prepare_recording(accelerator, nn.Sequential(*(nn.Linear(256, 256) for _ in range(4))))
        plan = accelerator.precision_plan
        assert [d.convert for d in plan.modules] == expected and found == []
    note = "skip_slow_shapes: no measured thresholds for CPU (emulated); every eligible Linear is converted"
    assert note in plan.notes


def test_most_layers_in_fp8_is_silent():
    accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[recipe(skip_first_last=False)])
    _, found, _ = prepare_recording(accelerator, regression_model())
    assert found == [] and len(accelerator.precision_plan.converted) == 4


def test_accelerate_ao_recipe_on_a_small_mlp_warns():
    from accelerate.utils import AORecipeKwargs

    accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[AORecipeKwargs()])
    _, found, _ = prepare_recording(accelerator, nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)))
    assert len(found) == 1
    assert "skip_first_last=False" in found[0] and "AORecipeKwargs has only module_filter_func" in found[0]


@pytest.mark.parametrize("knobs, where", [(dict(backend="msamp", opt_level="O2"), "in FP8 on its layers"),
                                          (dict(backend="torchao", opt_level="O2"), "gradient stores, not in .grad"),
                                          (dict(backend="torchao"), None)])
def test_a_model_prepared_without_its_optimizer_warns_where_gradients_live(fresh_accelerate_state, knobs, where):
    import warnings as _warnings

    import lowprec.runtime.notices as module

    module._warned.clear()
    recipe = FP8RecipeKwargs(skip_first_last=False, skip_slow_shapes=False, **knobs)
    accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[recipe], cpu=True)
    with _warnings.catch_warnings(record=True) as caught:
        _warnings.simplefilter("always")
        accelerator.prepare(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)))
    messages = [str(w.message) for w in caught if "only an optimizer prepared" in str(w.message)]
    if where is None:
        assert messages == []
    else:
        assert len(messages) == 1 and where in messages[0] and f"backend={knobs['backend']!r}" in messages[0]


# ---- a dynamo setting left by an earlier Accelerator (issue 26) ------------------------------------------------
def _compiled_first():
    from accelerate.utils import TorchDynamoPlugin

    return Accelerator(mixed_precision="bf16", dynamo_plugin=TorchDynamoPlugin(backend="inductor"))


def test_an_accelerator_after_a_compiled_one_says_it_compiles_and_plans_so(fresh_accelerate_state):
    # Accelerate keeps the first AcceleratorState: this one compiles its model although nothing here asked. The
    # plan must say so (speed rules and auto's order differ for compiled models), not show an "eager" run.
    _compiled_first()
    with pytest.warns(UserWarning, match="ask for dynamo_backend=NO.*earlier Accelerator in this "
                      "process set dynamo_backend=INDUCTOR"):
        accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[recipe()])
    assert accelerator.run_context().compiled
    accelerator.prepare(regression_model())
    plan = accelerator.precision_plan
    assert plan.model_mode.startswith("compiled") and "inherited from an earlier Accelerator" in plan.model_mode
    assert "model:     compiled" in str(plan)


def test_an_explicit_dynamo_setting_the_state_would_ignore_is_refused(fresh_accelerate_state):
    _compiled_first()
    with pytest.raises(ValueError, match=r"asks for dynamo_backend=NO.*set dynamo_backend=INDUCTOR.*_reset_state"):
        Accelerator(mixed_precision="fp8", kwargs_handlers=[recipe()], dynamo_backend="no")


def test_the_same_dynamo_setting_again_is_quiet(fresh_accelerate_state, recwarn):
    from accelerate.utils import TorchDynamoPlugin

    _compiled_first()
    accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[recipe()],
                              dynamo_plugin=TorchDynamoPlugin(backend="inductor"))
    assert not [w for w in recwarn if "earlier Accelerator" in str(w.message)]
    assert accelerator.run_context().compile_source == ""
    accelerator.prepare(regression_model())
    assert accelerator.precision_plan.model_mode == "compiled (torch.compile)"


def test_an_eager_accelerator_plans_an_eager_model(fresh_accelerate_state, recwarn):
    accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[recipe()])
    accelerator.prepare(regression_model())
    assert accelerator.precision_plan.model_mode == "eager"
    assert not [w for w in recwarn if "earlier Accelerator" in str(w.message)]


def test_the_plan_says_how_auto_chose_its_backend(fresh_accelerate_state):
    accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[FP8RecipeKwargs()])
    accelerator.prepare(regression_model())
    plan = accelerator.precision_plan
    # the CPU host has no TE (conftest): auto passes it over, by name and why, and takes torchao
    assert plan.backend == "torchao"
    assert plan.choice.startswith("backend='auto' chose 'torchao': the first of te, torchao, msamp (the order for "
                                  "eager models)")
    assert "passed over te: transformer_engine is not installed" in plan.choice
    assert f"backend:   {plan.choice}" in str(plan)
    accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[recipe()])
    accelerator.prepare(regression_model())
    assert accelerator.precision_plan.choice == "backend='torchao' named by the recipe"


# ---- non-finite values stay non-finite through every backend and level (issue 27) -------------------------------
@pytest.mark.parametrize("config", [dict(backend="torchao"), dict(backend="torchao", opt_level="O1"),
                                    dict(backend="torchao", opt_level="O2"), dict(backend="msamp", opt_level="O1"),
                                    dict(backend="msamp", opt_level="O2")], ids=lambda c: "-".join(c.values()))
@pytest.mark.parametrize("where", ["input", "grad"])
def test_an_overflow_is_never_trained_on_as_a_finite_step(fresh_accelerate_state, config, where):
    # msamp clamped an inf to +-448/scale: loss and gradient norm stayed finite (1e5) and a normal step was taken,
    # unseen by a loop that skips non-finite steps. As in BF16, the loss (inf input) and the gradient norm must not
    # be finite: the norm counts the gradients lowprec keeps outside .grad (FP8 stores) too.
    accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[recipe(**config)])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128, bias=False), nn.ReLU(), nn.Linear(128, 32, bias=False))
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    x, g = torch.randn(16, 64), torch.randn(16, 32)
    (x if where == "input" else g)[2, 3] = float("inf")
    loss = (model(x).float() * g).sum()
    accelerator.backward(loss)
    norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
    assert not torch.isfinite(loss) and not torch.isfinite(torch.as_tensor(norm)), (loss, norm)


# ---- a converted model or a prepared optimizer handed to prepare() again (issue 27) ------------------------------
@pytest.fixture
def prepared_msamp(fresh_accelerate_state):
    accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[recipe(backend="msamp", opt_level="O2")])
    model = regression_model()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    return accelerator, model, optimizer


@pytest.mark.parametrize("call", ["model and optimizer", "model", "prepare_model"])
def test_preparing_a_model_twice_is_refused_by_name(prepared_msamp, call):
    accelerator, model, optimizer = prepared_msamp
    with pytest.raises(ValueError, match=r"model Sequential was already prepared by this Accelerator \(backend "
                                         r"'msamp', recipe 'delayed', O2\): prepare\(\) each model once"):
        if call == "model and optimizer":
            accelerator.prepare(model, optimizer)
        elif call == "model":
            accelerator.prepare(model)
        else:
            accelerator.prepare_model(model)


def test_a_prepared_optimizer_is_refused_by_name(prepared_msamp):
    accelerator, _, optimizer = prepared_msamp
    with pytest.raises(ValueError, match="already prepared .*AcceleratedOptimizer around LowBitAdamW"):
        accelerator.prepare(optimizer)


def test_a_model_converted_by_another_accelerator_is_refused_with_the_way_out(prepared_msamp):
    from accelerate.state import AcceleratorState, GradientState

    _, model, _ = prepared_msamp
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    other = Accelerator(mixed_precision="fp8", kwargs_handlers=[recipe(backend="msamp", opt_level="O2")])
    with pytest.raises(ValueError, match=r"already converted to FP8 by another lowprec\.Accelerator .*"
                                         r"portable_state_dict"):
        other.prepare(model, torch.optim.AdamW(model.parameters()))
    # the way out it names works: the exported weights load into a fresh plain model, which prepares and trains
    import lowprec

    fresh = regression_model(seed=1)
    fresh.load_state_dict(lowprec.portable_state_dict(model))
    fresh, optimizer = other.prepare(fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-3))
    assert other.precision_plan.backend == "msamp" and type(optimizer.optimizer).__name__ == "LowBitAdamW"


# ---- checkpoints across optimizer-state precisions (issue 27) ----------------------------------------------------
def _moments(optimizer) -> list[torch.Tensor]:
    """Every parameter's (exp_avg, exp_avg_sq) in FP32, dequantised where lowprec stores them scaled."""
    from lowprec.kernels.adam import SCALED

    base = getattr(optimizer, "optimizer", optimizer)
    out = []
    for group in base.param_groups:
        for p in group["params"]:
            state = base.state[p]
            for key in ("exp_avg", "exp_avg_sq"):
                scale = state.get(f"{key}_scale")
                value = state[key].float()
                out.append(value / scale if scale is not None and state[key].dtype in SCALED else value)
    return out


def _fresh_prepared(spec: dict, seed: int):
    """A new Accelerator (Accelerate's state reset) with `recipe(**spec)`, and a regression model + AdamW prepared."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[recipe(**spec)])
    model = regression_model(seed)
    return accelerator, *accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))


@pytest.mark.parametrize("saved,loaded", [
    (dict(optimizer_states="fp8"), dict()),  # FP8 states into plain AdamW: moments were 5e5x-1e14x too large
    (dict(), dict(optimizer_states="fp8")),  # plain AdamW into FP8 states: KeyError 'exp_avg_scale' at the step
    (dict(backend="msamp", opt_level="O1"), dict(backend="msamp", opt_level="O2")),  # kept O1's FP32 states
    (dict(backend="msamp", opt_level="O2"), dict(backend="msamp", opt_level="O1")),
], ids=["fp8-to-plain", "plain-to-fp8", "O1-to-O2", "O2-to-O1"])
def test_a_checkpoint_of_another_state_precision_is_converted(tmp_path, fresh_accelerate_state, saved, loaded):
    accelerator, model, optimizer = _fresh_prepared(saved, 0)
    loader = torch.utils.data.DataLoader(regression_data(96), batch_size=32)
    for x, y in loader:
        accelerator.backward(nn.functional.mse_loss(model(x).float(), y))
        optimizer.step()
        optimizer.zero_grad()
    before = _moments(optimizer)
    accelerator.save_state(str(tmp_path / "ckpt"))

    accelerator, model, optimizer = _fresh_prepared(loaded, 1)
    planned = accelerator.precision_plan.tensor("optimizer_states").dtype
    accelerator.load_state(str(tmp_path / "ckpt"))
    from lowprec.optim.levels import built_states

    # the plan's state precision, not the file's
    assert built_states(optimizer.optimizer, accelerator.precision_plan.param_dtype) == planned
    after = _moments(optimizer)
    for a, b in zip(before, after):  # the same moments, up to the rounding of the coarser format (E4M3: 2**-4)
        assert torch.allclose(b, a, rtol=0.07, atol=0.07 * a.abs().max().item()), (a.abs().max(), b.abs().max())
    x, y = next(iter(loader))
    accelerator.backward(nn.functional.mse_loss(model(x).float(), y))
    optimizer.step()  # and training goes on
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("saved,loaded", [(dict(backend="msamp", opt_level="O2"), dict(backend="torchao")),
                                          (dict(backend="torchao"), dict(backend="msamp", opt_level="O2"))],
                         ids=["msamp-to-torchao", "torchao-to-msamp"])
def test_a_checkpoint_of_another_backend_loads_its_weights(tmp_path, fresh_accelerate_state, saved, loaded):
    # Before: torch's strict load copied every weight, then raised on msamp's scale entries (missing or
    # unexpected): a half-loaded model. Now the weights load and the scaling state restarts, with a warning.
    accelerator, model, optimizer = _fresh_prepared(saved, 0)
    x, y = next(iter(torch.utils.data.DataLoader(regression_data(32), batch_size=32)))
    accelerator.backward(nn.functional.mse_loss(model(x).float(), y))
    optimizer.step()
    weights = {k: v.float().clone() for k, v in accelerator.get_state_dict(model).items()}
    accelerator.save_state(str(tmp_path / "ckpt"))

    accelerator, model, optimizer = _fresh_prepared(loaded, 1)
    with pytest.warns(UserWarning, match=f"loaded into this {loaded['backend']} model was saved under another"):
        accelerator.load_state(str(tmp_path / "ckpt"))
    for key, value in accelerator.get_state_dict(model).items():
        assert torch.allclose(value.float(), weights[key], rtol=1e-3, atol=1e-4), key  # FP16 storage at most
    accelerator.backward(nn.functional.mse_loss(model(x).float(), y))
    optimizer.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize(("saved_len", "loaded_len"), [(16, 4), (4, 16)])
def test_amax_windows_of_another_length_are_converted(tmp_path, fresh_accelerate_state, monkeypatch, saved_len,
                                                      loaded_len):
    monkeypatch.setattr("lowprec.runtime.notices._warned", set())  # the warning is once per process
    # the first tensors were copied, then torch raised on the window's shape: a half-loaded model
    accelerator, model, optimizer = _fresh_prepared(dict(backend="msamp", opt_level="O2",
                                                         amax_history_len=saved_len), 0)
    x, y = next(iter(torch.utils.data.DataLoader(regression_data(32), batch_size=32)))
    for _ in range(3):
        accelerator.backward(nn.functional.mse_loss(model(x).float(), y))
        optimizer.step()
        optimizer.zero_grad()
    saved = {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    accelerator.save_state(str(tmp_path / "ckpt"))

    accelerator, model, optimizer = _fresh_prepared(dict(backend="msamp", opt_level="O2",
                                                         amax_history_len=loaded_len), 1)
    with pytest.warns(UserWarning, match="amax histories in the checkpoint had another length"):
        accelerator.load_state(str(tmp_path / "ckpt"))
    loaded = accelerator.unwrap_model(model).state_dict()
    keep = min(saved_len, loaded_len)
    for key, value in loaded.items():
        if key.endswith("amax_history"):
            assert value.shape[1] == loaded_len
            assert torch.equal(value[:, :keep], saved[key][:, :keep]) and not value[:, keep:].any()
        else:
            assert torch.equal(value, saved[key]), key
    accelerator.backward(nn.functional.mse_loss(model(x).float(), y))
    optimizer.step()


def _bad_window(column: int, value: float) -> torch.Tensor:
    window = torch.zeros(2, 16)
    window[1, column] = value
    return window


@pytest.mark.parametrize("bad", ["inf scale", "zero scale", "nan scale", "weight shape", "nan amax", "inf amax",
                                 "negative amax", "negative steps", "nan steps"])
def test_a_checkpoint_that_does_not_fit_is_refused_before_anything_is_copied(fresh_accelerate_state, bad):
    accelerator, model, _ = _fresh_prepared(dict(backend="msamp", opt_level="O2"), 0)
    inner = accelerator.unwrap_model(model)
    state = {k: v.clone() + (1 if v.is_floating_point() and k.endswith(("weight", "bias")) else 0)
             for k, v in inner.state_dict().items()}
    last = [k for k in state if k.endswith(".weight")][-1]
    suffix = ("fp8_meta_amax_history" if "amax" in bad else "fp8_meta_steps" if "steps" in bad
              else "fp8_meta_scale_input")
    key = {"weight shape": last}.get(bad, next(k for k in state if k.endswith(suffix)))
    state[key] = {"inf scale": torch.tensor(float("inf")), "zero scale": torch.tensor(0.0),
                  "nan scale": torch.tensor(float("nan")), "weight shape": torch.zeros(3, 3),
                  "nan amax": _bad_window(3, float("nan")), "inf amax": _bad_window(15, float("inf")),
                  "negative amax": _bad_window(0, -1.0), "negative steps": torch.tensor(-5),
                  "nan steps": torch.tensor(float("nan"))}[bad]
    before = {k: v.clone() for k, v in inner.state_dict().items()}
    with pytest.raises(ValueError, match=r"does not fit the msamp model .* nothing was loaded:\n  " + re.escape(key)):
        inner.load_state_dict(state)
    after = inner.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_a_nan_amax_of_the_step_in_progress_loads(fresh_accelerate_state):
    # saved between a backward that overflowed and its step: the step's update drops it, as it would have
    accelerator, model, _ = _fresh_prepared(dict(backend="msamp", opt_level="O2"), 0)
    inner = accelerator.unwrap_model(model)
    state = inner.state_dict()
    key = next(k for k in state if k.endswith("fp8_meta_amax_history"))
    state[key] = _bad_window(0, float("nan"))
    inner.load_state_dict(state)
    assert torch.isnan(inner.state_dict()[key][1, 0])


# ---- the old -> new Parameter table (issue 29: FP8 under FSDP2 held 4 bytes per converted weight element more
# than BF16 on every rank: the table kept the unsharded converted weights alive after fully_shard replaced them)


def test_the_replaced_parameter_table_keeps_only_what_the_model_still_holds():
    from lowprec.runtime.params import ReplacedParams

    table = ReplacedParams()
    old, kept, dropped = (nn.Parameter(torch.zeros(2)) for _ in range(3))
    other_old = nn.Parameter(torch.zeros(2))
    table.add(old, kept)
    table.add(other_old, dropped)
    table.keep_only([kept])
    assert table.get(old) is kept and table.get(other_old) is None and len(table) == 1


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_prepare_keeps_no_converted_weight_the_engine_replaced(fresh_accelerate_state, monkeypatch):
    # FSDP2's fully_shard registers new (sharded) Parameters in place of the converted ones; Accelerate builds
    # FSDP only on GPUs, so its prepare_model is given that one effect here
    import gc
    import weakref

    import accelerate

    real, converted = accelerate.Accelerator.prepare_model, []

    def sharding_prepare_model(self, model, *args, **kwargs):
        model = real(self, model, *args, **kwargs)
        for module in model.modules():
            weight = getattr(module, "weight", None)
            if isinstance(weight, nn.Parameter) and type(module).__name__ == "FP8Linear":
                converted.append(weakref.ref(weight))
                module.weight = nn.Parameter(weight.detach().clone())
        return model

    monkeypatch.setattr(accelerate.Accelerator, "prepare_model", sharding_prepare_model)
    accelerator = Accelerator(cpu=True, kwargs_handlers=[
        FP8RecipeKwargs(backend="msamp", opt_level="O1", skip_first_last=False, skip_slow_shapes=False)])
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))
    prepared = accelerator.prepare(model)
    gc.collect()
    assert len(converted) == 2
    assert all(ref() is None for ref in converted), "a converted weight the engine replaced is still alive"
    assert len(accelerator._replaced_params) == 0
    del prepared


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_an_optimizer_built_on_the_original_model_is_pointed_at_the_converted_weights(fresh_accelerate_state):
    # the table outlives prepare() where the model still holds the converted weights (no FSDP2)
    accelerator = Accelerator(cpu=True, kwargs_handlers=[
        FP8RecipeKwargs(backend="msamp", opt_level="O1", skip_first_last=False, skip_slow_shapes=False)])
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    prepared = accelerator.prepare(model)
    optimizer = accelerator.prepare(optimizer)
    inner = accelerator.unwrap_model(prepared)
    ids = {id(p) for group in optimizer.optimizer.param_groups for p in group["params"]}
    assert ids == {id(p) for p in inner.parameters()}


@pytest.mark.parametrize("policy_reduce, applied", [(None, "bf16"), ("BF16", None)])
def test_the_engine_gets_the_backends_gradient_dtype_not_only_the_recipes(monkeypatch, policy_reduce, applied):
    # msamp O3 under FSDP2 on one host sets BF16 itself where the FSDP plugin's policy names no reduce dtype: that
    # choice, not the recipe's (None), is what goes to the plugin before FSDP2 wraps the model
    from lowprec import RunContext
    from lowprec.planning.engines import EnginePrecision
    from lowprec.planning.hardware import device_info
    from lowprec.runtime import accelerator as module

    context = RunContext(device=device_info("cpu"), engine="fsdp2", world_size=2,
                         precision=EnginePrecision(grad_reduce=policy_reduce, source="a test's plugin"))
    monkeypatch.setattr(module.Accelerator, "run_context", lambda self: context)
    plugin = object()
    monkeypatch.setattr(module, "engine_plugin", lambda state, engine: plugin)
    seen = []
    monkeypatch.setattr(module, "apply_grad_comm_dtype", lambda choice, engine, p: seen.append((choice, engine, p)))
    Accelerator(kwargs_handlers=[FP8RecipeKwargs(backend="msamp", opt_level="O3")])
    assert seen == [(applied, "fsdp2", plugin)]
