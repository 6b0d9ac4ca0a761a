"""TorchAO adapter: numerics against an FP32 reference, configuration per recipe and engine."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lowprec import FP8RecipeKwargs, RunContext, build_plan
from lowprec.backends import create_backend
from lowprec.planning.hardware import DeviceInfo, device_info

pytest.importorskip("torchao")

CPU = RunContext(device=device_info("cpu"))
H100 = DeviceInfo("cuda", "H100", (9, 0))


def sqnr(reference: torch.Tensor, value: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB (higher is closer)."""
    return (20 * torch.log10(reference.norm() / (reference - value).norm())).item()


def converted(model: nn.Module, **recipe_kwargs):
    recipe = FP8RecipeKwargs(backend="torchao", skip_first_last=False, skip_slow_shapes=False, **recipe_kwargs)
    backend = create_backend(recipe, CPU)
    plan = build_plan(model, recipe, context=CPU, backend=backend)
    model = backend.convert(model, plan)
    plan.verify(model, backend.is_converted)
    return model, plan, backend


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256), nn.GELU(), nn.Linear(256, 512))


# (recipe, fp8_format, min output dB, min input-grad dB, min weight-grad dB)
NUMERICS = [
    ("tensorwise", "HYBRID", 23.0, 18.0, 18.0),
    ("tensorwise", "E4M3", 23.0, 21.5, 21.5),
    ("rowwise", None, 23.0, 21.5, 21.5),
    ("rowwise_with_gw_hp", None, 23.0, 21.5, 23.5),
]


@pytest.mark.parametrize("recipe,fmt,min_out,min_dx,min_dw", NUMERICS)
@pytest.mark.parametrize("seed", [0, 1])
def test_numerics_against_fp32(recipe, fmt, min_out, min_dx, min_dw, seed):
    reference = mlp(seed)
    model, plan, _ = converted(copy.deepcopy(reference), recipe=recipe, fp8_format=fmt)
    assert len(plan.converted) == 3
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(seed))
    x_ref, x_fp8 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref, y_fp8 = reference(x_ref), model(x_fp8)
    grad = torch.randn_like(y_ref)
    y_ref.backward(grad)
    y_fp8.backward(grad)

    out = sqnr(y_ref, y_fp8)
    # Above the floor: the recipe is right. Below 35 dB: FP8 really ran (FP32/BF16 would be far closer).
    assert min_out < out < 35, out
    assert min_dx < sqnr(x_ref.grad, x_fp8.grad) < 35
    for ref_layer, fp8_layer in zip(reference, model):
        if isinstance(ref_layer, nn.Linear):
            assert min_dw < sqnr(ref_layer.weight.grad, fp8_layer.weight.grad) < 40


def test_hybrid_uses_e5m2_for_gradients():
    """HYBRID must quantise output gradients more coarsely than E4M3: E5M2 has one mantissa bit less."""
    results = {}
    for fmt in ("HYBRID", "E4M3"):
        reference = mlp(3)
        model, _, _ = converted(copy.deepcopy(reference), fp8_format=fmt)
        x = torch.randn(64, 256, requires_grad=True)
        model(x).backward(torch.ones(64, 512))
        x_ref = x.detach().clone().requires_grad_()
        reference(x_ref).backward(torch.ones(64, 512))
        results[fmt] = sqnr(x_ref.grad, x.grad)
        dtype = model[0].config.cast_config_grad_output.target_dtype
        assert dtype == (torch.float8_e5m2 if fmt == "HYBRID" else torch.float8_e4m3fn)
    assert results["HYBRID"] < results["E4M3"] - 2.0, results


def test_forward_equals_explicit_fp8_quantisation():
    """Emulation is exact FP8: the forward equals quantise(x) @ quantise(w).T with per-tensor scales."""
    torch.manual_seed(0)
    layer = nn.Linear(128, 64, bias=False)
    model, _, _ = converted(nn.Sequential(copy.deepcopy(layer)))
    x = torch.randn(32, 128)

    def q(t):
        scale = torch.finfo(torch.float8_e4m3fn).max / t.abs().max().clamp(min=1e-12)
        return (t * scale).to(torch.float8_e4m3fn).float() / scale

    expected = q(x) @ q(layer.weight.detach()).T
    assert sqnr(expected, model(x).detach()) > 60


def test_bf16_autocast_output_dtype():
    model, _, _ = converted(mlp())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(torch.randn(16, 256))
    assert y.dtype == torch.bfloat16


@pytest.mark.parametrize(
    "engine,recipe,option,expected",
    [
        ("fsdp2", "tensorwise", None, True),
        ("fsdp2", "tensorwise", False, False),
        ("fsdp2", "rowwise", None, False),
        ("ddp", "tensorwise", None, False),
        ("deepspeed", "tensorwise", None, False),  # the weight subclass breaks DeepSpeed's prepare
        ("deepspeed", "tensorwise", True, False),
        ("single", "tensorwise", True, False),
    ],
)
def test_fsdp_float8_all_gather_only_under_fsdp2(engine, recipe, option, expected):
    recipe_kwargs = FP8RecipeKwargs(backend="torchao", recipe=recipe, enable_fsdp_float8_all_gather=option)
    backend = create_backend(recipe_kwargs, RunContext(device=H100, engine=engine, world_size=2))
    config = backend.float8_config()
    assert config.enable_fsdp_float8_all_gather is expected
    assert (backend.post_optimizer_step(nn.Linear(16, 16)) is not None) is expected
    assert config.emulate is False


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_config_matches_torchao_named_recipe(recipe):
    from torchao.float8 import Float8LinearConfig

    backend = create_backend(FP8RecipeKwargs(backend="torchao", recipe=recipe), RunContext(device=H100))
    expected = Float8LinearConfig.from_recipe_name(recipe)
    assert backend.float8_config() == expected
    assert not backend.emulated


def test_emulated_on_cpu_and_forbidden_when_asked():
    from lowprec import BackendUnavailableError

    backend = create_backend(FP8RecipeKwargs(backend="torchao"), CPU)
    assert backend.emulated and backend.float8_config().emulate
    with pytest.raises(BackendUnavailableError, match="emulate=False"):
        create_backend(FP8RecipeKwargs(backend="torchao", emulate=False), CPU)


def test_pad_inner_dim_converts_odd_layers_and_runs():
    torch.manual_seed(0)
    model, plan, _ = converted(nn.Sequential(nn.Linear(100, 200), nn.Linear(200, 36)), pad_inner_dim=True)
    assert [d.convert for d in plan.modules] == [True, True]
    y = model(torch.randn(10, 100))  # 10 tokens: not a multiple of 16 either
    y.sum().backward()
    assert y.shape == (10, 36)


def test_mha_out_proj_is_not_converted():
    model = nn.ModuleDict({"attn": nn.MultiheadAttention(64, 4), "proj": nn.Linear(64, 64)})
    model, plan, backend = converted(model)
    assert [d.fqn for d in plan.modules] == ["proj"]
    assert not backend.is_converted(model["attn"].out_proj)


def test_compile_of_converted_model():
    model, _, _ = converted(mlp())
    compiled = torch.compile(model)
    x = torch.randn(32, 256)
    torch.testing.assert_close(compiled(x), model(x), rtol=1e-2, atol=1e-2)
    compiled(x).sum().backward()
    assert model[0].weight.grad is not None


@pytest.mark.slow
def test_fsdp2_fp8_all_gather_two_processes(tmp_path):
    import json
    import os
    import sys

    from conftest import free_port, run_processes

    script = os.path.join(os.path.dirname(__file__), "..", "distributed", "fsdp2_torchao.py")
    env = dict(os.environ, TORCHAO_FORCE_SKIP_LOADING_SO_FILES="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           script, str(tmp_path / "out.json")]
    proc = run_processes(cmd, env, timeout=600)
    errors = [line for line in proc.stderr.splitlines() if "Error" in line or "Traceback" in line]
    assert proc.returncode == 0, "\n".join(errors[:40]) + proc.stderr[-2000:]
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["weight_types"] == ["WeightWithDynamicFloat8CastTensor"]
    assert "weights all-gathered in FP8" in result["notes"][0] and "each shard cast in one kernel" in result["notes"][0]
    assert result["fused_gather_casts"] == 3  # each Linear's shard, after its precomputed scale
    assert result["losses"] == result["torchaos_cast_losses"]
    assert result["scales_equal_across_ranks"]
    assert result["max_scale_rel_error"] < 1e-5  # the precomputed scale is the global amax's
    assert result["last_loss"] < result["first_loss"]


def test_accelerate_parameter_lookup_sees_fp8_weight_subclass(fresh_accelerate_state, monkeypatch):
    """Accelerate's FSDP2 optimizer remap keys on data_ptr(); the FP8 all-gather weight reports 0."""
    import accelerate

    from lowprec import Accelerator

    accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[FP8RecipeKwargs(backend="torchao")])
    recipe = FP8RecipeKwargs(backend="torchao", skip_slow_shapes=False, skip_first_last=False)
    context = RunContext(device=device_info("cpu"), engine="fsdp2", world_size=2)
    backend = create_backend(recipe, context)
    model = mlp()
    model = backend.convert(model, build_plan(model, recipe, context=context, backend=backend))

    def weight_pointers():
        pointers = accelerator._get_named_parameters(model, drop_refs=True)
        return [v for k, v in pointers.items() if k.endswith("weight")]

    assert weight_pointers() == [0, 0, 0]  # no torchao model prepared yet: Accelerate is not told of the subclass
    accelerator._lowprec.append((model, backend, None))
    weights = weight_pointers()
    assert len(weights) == 3 and 0 not in weights and len(set(weights)) == 3
    # Outside the lookup Accelerate must still see no FP8 backend: its torchao conversion would run in prepare().
    monkeypatch.setattr(accelerate.Accelerator, "_prepare_ao",
                        lambda self, *args: pytest.fail("Accelerate's own torchao conversion ran"))
    other = accelerator.prepare(mlp(1))
    built = [type(m).__name__ == "Float8Linear" for m in other if not isinstance(m, nn.GELU)]
    assert built == [d.convert for d in accelerator.precision_plan.modules] == [True, True, True]


def test_fsdp2_optimizer_entries_expose_real_data_pointers():
    """Accelerate's FSDP2 optimizer swap reads p.data_ptr(); the FP8 all-gather weight reports 0."""
    recipe = FP8RecipeKwargs(backend="torchao", skip_slow_shapes=False, skip_first_last=False)
    context = RunContext(device=device_info("cpu"), engine="fsdp2", world_size=2)
    backend = create_backend(recipe, context)
    model = mlp()
    model = backend.convert(model, build_plan(model, recipe, context=context, backend=backend))
    optimizer = torch.optim.AdamW(model.parameters())
    assert sum(p.data_ptr() == 0 for p in optimizer.param_groups[0]["params"]) == 3
    single = create_backend(recipe, RunContext(device=device_info("cpu")))
    single.before_engine_prepare([model, optimizer])  # only FSDP2 needs it
    assert sum(p.data_ptr() == 0 for p in optimizer.param_groups[0]["params"]) == 3
    backend.before_engine_prepare([model, optimizer])
    pointers = [p.data_ptr() for p in optimizer.param_groups[0]["params"]]
    assert 0 not in pointers
    assert pointers[0] == model[0].weight._tensor.data_ptr() and pointers[1] == model[0].bias.data_ptr()


def _saved(model: nn.Module, x: torch.Tensor):
    """(what one forward saves for backward: [(type name, bytes)], input grad, parameter grads)."""
    saved = []

    def pack(t):
        inner = getattr(t, "_data", t)
        saved.append((type(t).__name__, inner.numel() * inner.element_size()))
        return t

    x = x.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = model(x)
    y.float().square().mean().backward()
    return saved, x.grad, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("fmt", ["HYBRID", "E4M3"])
def test_tensorwise_saves_the_forwards_fp8_input_with_torchaos_gradients(fmt):
    # torchao saves the high-precision input and casts it again in backward; with per-tensor scaling that cast is
    # the forward's, so lowprec hands torchao the FP8 input it would make: the same bits, half the bytes saved
    from torchao.float8 import convert_to_float8_training

    model, plan, backend = converted(mlp(), fp8_format=fmt)
    assert backend.saves_fp8_input
    reference = convert_to_float8_training(mlp(), config=backend.float8_config())
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(3))
    ours, dx, dw = _saved(model, x)
    theirs, ref_dx, ref_dw = _saved(reference, x)
    assert torch.equal(dx, ref_dx) and all(torch.equal(a, b) for a, b in zip(dw, ref_dw))
    inputs = [b for name, b in ours if name == "Float8TrainingTensor"]
    assert len(inputs) == 3 and sum(inputs) == 64 * (256 + 512 + 256)  # one byte per element
    assert not any(name == "Float8TrainingTensor" for name, _ in theirs)
    assert sum(b for _, b in theirs) - sum(b for _, b in ours) == 3 * 64 * (256 + 512 + 256)  # FP32 -> FP8 here
    assert plan.activations.fp8_linear_inputs.startswith("FP8 E4M3, per-tensor scale (the forward's cast")


@pytest.mark.parametrize("how", ["whole model", "each layer"])
def test_compiled_layers_leave_what_to_save_to_the_partitioner(how):
    # a compiled graph receives the input anyway and keeps it, casting again in backward (a cast made before
    # the graph would break it in two): torchao's own forward, and the plan says BF16
    recipe = FP8RecipeKwargs(backend="torchao", skip_first_last=False, skip_slow_shapes=False,
                             compile_fp8_layers=how == "each layer" or None)
    context = RunContext(device=H100, compiled=how == "whole model")
    backend = create_backend(recipe, context, require_package=False)
    assert not backend.saves_fp8_input
    plan = build_plan(mlp(), recipe, context=context, backend=backend)
    assert plan.activations.fp8_linear_inputs == ("BF16: compiled: the graph keeps the input it receives and casts "
                                                  "it again in backward")


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_with_gw_hp"])
def test_rowwise_recipes_keep_the_high_precision_input_and_say_why(recipe):
    model, plan, backend = converted(mlp(), recipe=recipe)
    assert not backend.saves_fp8_input
    assert all("forward" not in vars(m) for m in model.modules())  # torchao's own forward, untouched
    assert plan.activations.fp8_linear_inputs.startswith(f"BF16: recipe {recipe!r} casts it again in backward")


def test_tensorwise_casts_the_input_once_in_torchaos_recipe():
    # what lowprec relies on (the backend refuses to convert otherwise): torchao casts the input for the
    # weight gradient exactly as for the output
    _, _, backend = converted(mlp())
    config = backend.float8_config()
    assert config.cast_config_input == config.cast_config_input_for_grad_weight


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_a_copy_keeps_the_fp8_input_forward(how, tmp_path):
    model, _, _ = converted(mlp())
    if how == "deepcopy":
        clone = copy.deepcopy(model)
    else:  # the whole model pickled (a bound method of a function the class lacks did not load)
        torch.save(model, tmp_path / "model.pt")
        clone = torch.load(tmp_path / "model.pt", weights_only=False)
    forwards = [m for m in clone.modules() if "forward" in vars(m)]
    assert len(forwards) == 3 and all(m.forward.args[0] is m for m in forwards)
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(0))
    saved, dx, _ = _saved(clone, x)
    assert sum(name == "Float8TrainingTensor" for name, _ in saved) == 3
    assert torch.equal(dx, _saved(model, x)[1])


@pytest.mark.parametrize(("compiled", "compile_fp8_layers", "said"), [
    (False, False, True),  # eager model, eager FP8 layers: the only case without a compiled FP8 cast
    (False, None, False),  # lowprec compiles each FP8 layer on an FP8 GPU
    (True, None, False),  # the model is compiled
])
def test_the_plan_asks_for_torch_compile_only_where_nothing_compiles_the_fp8_layers(compiled, compile_fp8_layers,
                                                                                     said):
    from lowprec import FP8RecipeKwargs
    from lowprec.planning.hardware import assumed_device
    from lowprec.runtime.planner import build_plan
    from lowprec.runtime.run_context import RunContext

    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    recipe = FP8RecipeKwargs(backend="torchao", skip_slow_shapes=False, skip_first_last=False,
                             compile_fp8_layers=compile_fp8_layers)
    plan = build_plan(model, recipe, context=RunContext(device=assumed_device("9.0"), engine="ddp", world_size=2,
                                                        compiled=compiled))
    assert any("needs torch.compile" in n for n in plan.notes) == said, plan.notes
