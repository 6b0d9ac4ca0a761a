"""compile_fp8_layers: converted layers compiled one by one in an eager model (Backend.layer_compile /
compile_layers), decided per backend, device, engine and compilation, and applied by prepare()."""

from __future__ import annotations

import pytest
import torch
from accelerate.state import AcceleratorState, GradientState
from torch import nn

from lowprec import Accelerator, FP8RecipeKwargs, RunContext, build_plan
from lowprec.backends import create_backend
from lowprec.backends.base import Backend
from lowprec.planning.hardware import assumed_device, device_info

H100 = assumed_device("9.0")


def _decision(backend="torchao", device=H100, engine="single", compiled=False, **kw):
    recipe = FP8RecipeKwargs(backend=backend, **kw)
    context = RunContext(device=device, engine=engine, world_size=1 if engine == "single" else 2, compiled=compiled)
    return create_backend(recipe, context, require_package=False).layer_compile()


@pytest.mark.parametrize("kwargs, expected, why", [
    (dict(), True, "eager model on an FP8 GPU"),
    (dict(engine="ddp"), True, "eager model"),
    (dict(compiled=True), False, "compiled whole"),
    (dict(compiled=True, compile_fp8_layers=True), False, "compiled whole"),
    (dict(device=device_info("cpu")), False, "emulated"),
    (dict(device=device_info("cpu"), compile_fp8_layers=True), True, "compile_fp8_layers=True"),
    (dict(compile_fp8_layers=False), False, "compile_fp8_layers=False"),
    (dict(engine="fsdp2"), True, "eager model"),
    (dict(engine="deepspeed"), True, "eager model"),
    (dict(engine="fsdp1"), False, "not measured under fsdp1"),
    (dict(backend="msamp"), True, "eager model on an FP8 GPU"),
    (dict(backend="msamp", engine="ddp"), True, "eager model"),
    # O3 under FSDP2: eager layers measured faster past the warm-up (results/gpu/2026-11-27-h200x2-steady-e8bb2bd)
    (dict(backend="msamp", engine="fsdp2", opt_level="O3"), False, "O3 under FSDP2: eager layers measured faster"),
    (dict(backend="msamp", engine="fsdp2", opt_level="O3", compile_fp8_layers=True), True, "compile_fp8_layers=True"),
    (dict(backend="msamp", engine="fsdp2", opt_level="O3", device=device_info("cpu")), False, "emulated"),
    (dict(backend="msamp", engine="deepspeed", opt_level="O3"), True, "eager model"),
    (dict(backend="msamp", engine="ddp", compile_fp8_layers=False), False, "compile_fp8_layers=False"),
])
def test_where_layers_are_compiled(kwargs, expected, why):
    on, reason = _decision(**kwargs)
    assert on is expected and why in reason


@pytest.mark.parametrize("backend, dynamic", [("torchao", None), ("msamp", True)])
def test_layers_compile_with_the_backends_dynamic_shape_choice(monkeypatch, backend, dynamic):
    # msamp: one graph with symbolic shapes from the first call (torch 2.11's dynamo failed when the
    # second layer shape re-traced its autograd.Function with dynamic shapes, on an H100)
    calls = []
    monkeypatch.setattr(nn.Module, "compile", lambda self, **kw: calls.append(kw))
    context = RunContext(device=H100)
    converted = create_backend(FP8RecipeKwargs(backend=backend), context, require_package=False)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 128))
    monkeypatch.setattr(type(converted), "converted_kind",
                        lambda self, m: "linear" if isinstance(m, nn.Linear) else None)
    assert converted.compile_layers(model) == 2
    assert calls == [{"backend": "inductor", "dynamic": dynamic}] * 2


def test_te_refuses_compiled_layers_naming_the_backends_that_take_it():
    with pytest.raises(ValueError, match=r"compile_fp8_layers=True cannot be honoured by backend 'te'.*torchao, msamp"):
        FP8RecipeKwargs(backend="te", compile_fp8_layers=True)


def test_the_environment_sets_it(monkeypatch):
    monkeypatch.setenv("ACCELERATE_FP8_COMPILE_FP8_LAYERS", "false")
    assert FP8RecipeKwargs(backend="torchao").compile_fp8_layers is False


def test_the_plan_says_when_layers_are_compiled():
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64))
    recipe = FP8RecipeKwargs(backend="torchao", skip_first_last=False, skip_slow_shapes=False)
    plan = build_plan(model, recipe, context=RunContext(device=H100), backend=create_backend(
        recipe, RunContext(device=H100), require_package=False))
    assert any("each of the 3 FP8 layers is compiled" in note for note in plan.notes), plan.notes
    compiled = RunContext(device=H100, compiled=True)
    plan = build_plan(model, recipe, context=compiled,
                      backend=create_backend(recipe, compiled, require_package=False))
    assert not any("is compiled by torch.compile" in note for note in plan.notes)


@pytest.mark.parametrize("backend", ["torchao", "msamp"])
def test_prepare_compiles_each_converted_layer_and_numerics_do_not_change(monkeypatch, backend):
    if backend == "torchao":
        pytest.importorskip("torchao")
    # dynamo traces each layer as on a GPU; the "eager" backend runs the traced graph without code generation
    monkeypatch.setattr(Backend, "LAYER_COMPILE_BACKEND", "eager")

    def run(compile_layers: bool) -> tuple[list[float], int]:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        torch._dynamo.reset()
        recipe = FP8RecipeKwargs(backend=backend, skip_first_last=False, skip_slow_shapes=False,
                                 compile_fp8_layers=compile_layers)
        accelerator = Accelerator(kwargs_handlers=[recipe])
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        compiled = sum(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 32, generator=g)
        losses = []
        for _ in range(4):
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses, compiled

    eager, none = run(False)
    layered, compiled = run(True)
    assert (none, compiled) == (0, 2)
    assert layered == pytest.approx(eager, rel=1e-5)


def test_compile_layers_raises_dynamos_recompile_limit_to_what_the_layers_need(monkeypatch):
    # Dynamo keeps weight shapes static: one graph per shape, per input dtype, per warm-up state. Past its
    # limit every further variant runs eager for the rest of the run (the d4096 proxy needed 12 > 8).
    import torch._dynamo.config as dynamo_config

    monkeypatch.setattr(nn.Module, "compile", lambda self, **kw: None)
    backend = create_backend(FP8RecipeKwargs(backend="msamp"), RunContext(device=H100), require_package=False)
    model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 48), nn.Linear(48, 16), nn.Linear(16, 16))
    monkeypatch.setattr(type(backend), "converted_kind", lambda self, m: "linear" if isinstance(m, nn.Linear) else None)
    with dynamo_config.patch(recompile_limit=2):
        backend.compile_layers(model)
        assert dynamo_config.recompile_limit == 4 * backend.LAYER_COMPILE_VARIANTS_PER_SHAPE + 8
    with dynamo_config.patch(recompile_limit=1000):
        backend.compile_layers(model)
        assert dynamo_config.recompile_limit == 1000  # raised only, never lowered


def test_compiled_msamp_layers_of_many_shapes_stay_compiled_past_warm_up(monkeypatch):
    # three shapes, two input dtypes, through the warm-up flip: every call runs a compiled graph, none falls
    # back to eager at dynamo's recompile limit
    import torch._dynamo.config as dynamo_config
    from torch._dynamo.utils import counters

    from lowprec.backends.msamp.linear import FP8Linear, update_delayed_scales

    monkeypatch.setattr(Backend, "LAYER_COMPILE_BACKEND", "eager")
    torch._dynamo.reset()
    counters.clear()
    backend = create_backend(FP8RecipeKwargs(backend="msamp", compile_fp8_layers=True),
                             RunContext(device=device_info("cpu")), require_package=False)
    layers = nn.ModuleList([FP8Linear(32, 64, emulate=True, amax_history_len=2), FP8Linear(64, 48, emulate=True,
                            amax_history_len=2), FP8Linear(48, 32, emulate=True, amax_history_len=2)])
    with dynamo_config.patch(recompile_limit=8):  # torch's default
        assert backend.compile_layers(layers) == 3
        for _ in range(4):  # warm-up is 2 steps: both states met
            for dtype in (torch.float32, torch.bfloat16):
                h = torch.randn(8, 32, dtype=dtype)
                for layer in layers:
                    h = layer(h)
                h.float().sum().backward()
            update_delayed_scales(list(layers))
    assert not layers[0].in_time()
    assert not any("recompile limit" in reason.lower() for reason in counters["unimplemented"]), counters


@pytest.mark.parametrize("backend, window, later", [
    ("msamp", None, "once more at step 16"),  # the default window: its delayed-scale variants compile then
    ("msamp", 4, "once more at step 4"),
    ("msamp", 1, None),  # scales always from the tensor at hand: one variant
    ("torchao", None, None),
])
def test_the_plan_says_when_compiled_layers_compile_again(backend, window, later):
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64))
    recipe = FP8RecipeKwargs(backend=backend, skip_first_last=False, skip_slow_shapes=False,
                             **({"amax_history_len": window} if window else {}))
    plan = build_plan(model, recipe, context=RunContext(device=H100), backend=create_backend(
        recipe, RunContext(device=H100), require_package=False))
    note = next(note for note in plan.notes if "FP8 layers is compiled" in note)
    assert (later in note) if later else ("once more" not in note), note


def test_a_compiled_msamp_layer_adds_no_graph_for_its_amaxes_rows():
    # inductor, dynamic shapes: one graph for a single token (dynamo specialises 1), one for a token count that
    # is not a multiple of 16 (the GEMM's padding) and one for one that is; the amaxes over rows
    # (kernels.fused.padded_rows) must add none, e.g. for an input of a single row
    from torch._dynamo.utils import counters

    from lowprec.backends.msamp.linear import FP8Linear

    torch._dynamo.reset()
    counters.clear()
    layer = FP8Linear(768, 768, bias=False, emulate=True)
    nn.init.normal_(layer.weight, std=0.02)
    layer.compile(dynamic=True)
    for tokens in (1, 2, 16, 48, 5):  # 2 and 5 x 768 elements: one row of 4096 without the extra row
        x = torch.randn(tokens, 768, requires_grad=True)
        layer(x).float().sum().backward()
    assert counters["stats"]["unique_graphs"] == 3, counters["stats"]
    torch._dynamo.reset()
