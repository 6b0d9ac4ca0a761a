"""TorchAO backend on an FP8 GPU (Hopper): real FP8 GEMMs, numerics, compiled training.

Run on a GPU host with `pytest -m gpu`; skipped elsewhere.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lowprec import Accelerator, FP8RecipeKwargs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
        reason="needs a Hopper (sm_90) or newer GPU",
    ),
]
pytest.importorskip("torchao")


def sqnr(reference: torch.Tensor, value: torch.Tensor) -> float:
    return (20 * torch.log10(reference.float().norm() / (reference.float() - value.float()).norm())).item()


def model_on_gpu(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024), nn.GELU(),
                         nn.Linear(1024, 4096)).cuda()


def _prepare(recipe_name, **kwargs):
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    recipe = FP8RecipeKwargs(backend="torchao", recipe=recipe_name, skip_first_last=False, skip_slow_shapes=False,
                             emulate=False, **kwargs)
    return Accelerator(mixed_precision="fp8", kwargs_handlers=[recipe])


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_hardware_fp8_gemms_are_used(recipe):
    accelerator = _prepare(recipe)
    model = accelerator.prepare(model_on_gpu())
    plan = accelerator.precision_plan
    assert not plan.emulated and plan.execution.startswith("hardware FP8")
    x = torch.randn(4096, 1024, device="cuda")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(x).float().sum().backward()
    ops = {e.key for e in prof.key_averages()}
    assert "aten::_scaled_mm" in ops, sorted(o for o in ops if "mm" in o)


@pytest.mark.parametrize(
    "recipe,fmt,min_out,min_dx", [("tensorwise", "HYBRID", 23, 18), ("tensorwise", "E4M3", 23, 21),
                                  ("rowwise", None, 23, 21), ("rowwise_with_gw_hp", None, 23, 21)]
)
def test_numerics_against_fp32_on_gpu(recipe, fmt, min_out, min_dx):
    reference = model_on_gpu()
    accelerator = _prepare(recipe, fp8_format=fmt)
    model = accelerator.prepare(copy.deepcopy(reference))
    x = torch.randn(4096, 1024, device="cuda")
    x_ref, x_fp8 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref = reference(x_ref)
    with accelerator.autocast():
        y_fp8 = model(x_fp8)
    grad = torch.randn_like(y_ref)
    y_ref.backward(grad)
    y_fp8.float().backward(grad)
    # BF16 output rounding is included: FP8 must still sit in the FP8 band, not at BF16 level (~40 dB+).
    assert min_out < sqnr(y_ref, y_fp8) < 35
    assert min_dx < sqnr(x_ref.grad, x_fp8.grad) < 35


@pytest.mark.parametrize("level", [None, "O2"])
def test_compiled_llama_training_on_gpu(level):
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import TorchDynamoPlugin

    from lowprec.demo.data import Windows, stdlib_corpus
    from lowprec.demo.model import PRESETS, build_model

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    recipe = FP8RecipeKwargs(backend="torchao", opt_level=level)
    accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[recipe],
                              dynamo_plugin=TorchDynamoPlugin(backend="inductor"))
    torch.manual_seed(0)
    model = build_model(PRESETS["small"])
    corpus = stdlib_corpus(max_bytes=8 * 2**20)
    loader = torch.utils.data.DataLoader(Windows(corpus.train, 1024, 30 * 8, seed=0), batch_size=8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, fused=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    plan = accelerator.precision_plan
    assert not plan.emulated
    losses = []
    for ids in loader:
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(map(lambda v: v == v, losses)), "NaN loss"
    assert sum(losses[-5:]) / 5 < losses[0] - 1.5, losses
    inner = accelerator.unwrap_model(model, keep_torch_compile=False)
    built = sorted(n for n, m in inner.named_modules() if type(m).__name__ == "Float8Linear")
    assert built == sorted(d.fqn for d in plan.converted)
    if level is not None:  # FP16 weights updated in place, FP8 gradients kept outside .grad
        weights = [m.weight for m in inner.modules() if type(m).__name__ == "Float8Linear"]
        assert all(w.dtype == torch.float16 and w.grad is None for w in weights)
        assert type(optimizer.optimizer).__name__ == "LowBitAdamW"


# ---- FSDP2's FP8 all-gather: each shard cast in one kernel (lowprec/backends/torchao_gather.py) ---------------------
@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(7168, 4096), (4096, 7168), (1000, 96)], ids=["w1", "w2", "odd"])
def test_one_kernel_gather_cast_gives_torchaos_bytes(fp8_dtype, dtype, shape):
    from torchao.float8.float8_training_tensor import LinearMMConfig
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from lowprec.backends.torchao_gather import _MARK, _replace_torchaos_method

    g = torch.Generator(device="cuda").manual_seed(0)
    data = (torch.randn(shape, device="cuda", generator=g) * torch.logspace(-3, 1, shape[1], device="cuda")).to(dtype)
    # twice the amax's scale: the largest values saturate, as after a step that grew the weights
    scale = (torch.finfo(fp8_dtype).max / data.abs().max().float() * 2).reshape(())

    def weight():
        w = WeightWithDynamicFloat8CastTensor(data, LinearMMConfig(), fp8_dtype)
        w._precomputed_scale = scale
        return w

    (expected,), _ = weight().fsdp_pre_all_gather(None)
    fused = weight()
    _replace_torchaos_method()
    setattr(fused, _MARK, True)
    (got,), (got_scale,) = fused.fsdp_pre_all_gather(None)
    assert got_scale is scale
    assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
    data.view(-1)[:3] = torch.tensor([float("inf"), float("-inf"), float("nan")], device="cuda", dtype=dtype)
    (got,), _ = fused.fsdp_pre_all_gather(None)
    assert got.view(-1)[:3].float().isnan().all() and got.view(-1)[3:].float().isfinite().all()


def test_fsdp2_world_of_one_trains_with_the_one_kernel_cast(tmp_path):
    # tests/distributed/gpu_engines.py under torchrun as a world of one: FSDP2's own all-gather path, the model
    # compiled block by block (as torchtitan runs FP8 under FSDP2)
    from conftest import world_of_one_cell

    # d=128: skip_slow_shapes would keep every Linear in BF16
    _, cell = world_of_one_cell(tmp_path, "--backend", "torchao", "--recipe", "tensorwise", "--engine", "fsdp2",
                                "--size", "tiny", "--steps", "8", "--compile-model",
                                ACCELERATE_FP8_SKIP_SLOW_SHAPES="0")
    summary = {k: cell.get(k) for k in ("fp8_modules", "fp8_all_gather_weights", "precomputed_scales",
                                        "fused_gather_casts", "all_forwards_in_fp8", "notes")}
    assert cell["fp8_modules"] > 0 and cell["all_forwards_in_fp8"] is True, summary
    assert cell["fp8_all_gather_weights"] == cell["precomputed_scales"] == cell["fp8_modules"], summary
    assert cell["fused_gather_casts"] == cell["fp8_modules"], summary
    assert any("each shard cast in one kernel" in note for note in cell["notes"]), summary
    assert cell["last_loss"] < cell["first_loss"]


def test_a_world_of_one_cell_reports_what_is_live_at_its_peak(tmp_path):
    # multi.sh's PEAK=1: one steady step under the allocator's recorder, its peak's live blocks by allocating line
    from conftest import world_of_one_cell

    peak = tmp_path / "cell.peak.txt"
    _, cell = world_of_one_cell(tmp_path, "--backend", "torchao", "--recipe", "tensorwise", "--engine", "fsdp2",
                                "--size", "tiny", "--steps", "8", "--peak", str(peak),
                                ACCELERATE_FP8_SKIP_SLOW_SHAPES="0")
    text = peak.read_text()
    head = text.splitlines()[0]
    total, before = float(head.split()[1]), float(head.split("= ")[1].split()[0])
    assert total > before > 0, text  # model state before the step, the step's own blocks on top
    assert "GiB" in text.splitlines()[1] and "largest blocks live at the peak:" in text, text
    assert cell["last_loss"] < cell["first_loss"]
