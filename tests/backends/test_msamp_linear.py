"""backend="msamp": the `FP8Linear` layer on its own (no Accelerator), against an FP32 `nn.Linear`.

What this covers: construction from an `nn.Linear` (storage dtypes, bias, flags), FP8 numerics of the
three GEMMs (SQNR against FP32), the FP8 weight gradient and its scale convention, MS-AMP's delayed
scaling (16-step amax window, power-of-two scales, non-finite amaxes), gradient accumulation,
torch.compile, activation checkpointing and state_dict round trips.

Expected values are computed here from MS-AMP's rules (reference/msamp.md §1.2, §2.1), not read
back from the implementation: a scale is `2 ** floor(log2(fp8_max / amax))`, E4M3 max 448, E5M2
max 57344, and a tensor is dequantised as `fp8 / scale`.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from lowprec.backends.msamp.linear import FP8Linear, update_delayed_scales

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
E4M3_MAX, E5M2_MAX = 448.0, 57344.0
WEIGHT_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def sqnr(reference: torch.Tensor, value: torch.Tensor) -> float:
    """Signal-to-quantisation-noise ratio in dB (higher is closer)."""
    reference, value = reference.detach().float(), value.detach().float()
    return (20 * torch.log10(reference.norm() / (reference - value).norm())).item()


def pow2_scale(amax: float, fp8_max: float) -> float:
    """MS-AMP's scaling factor (ScalingMeta.compute_scaling_factor, margin 0), written out independently."""
    return 2.0 ** math.floor(math.log2(fp8_max / amax))


def quantise(t: torch.Tensor, scale: float, dtype=E4M3) -> torch.Tensor:
    """`t` through FP8 with a given scale (saturating, as MS-AMP's casts), back in FP32."""
    limit = E4M3_MAX if dtype == E4M3 else E5M2_MAX
    return (t.detach().float() * scale).clamp(-limit, limit).to(dtype).float() / scale


def fp8(linear: nn.Linear, **options) -> FP8Linear:
    options.setdefault("emulate", True)  # CPU: FP8 numerics, FP32 matmuls
    return FP8Linear.from_float(linear, **options)


def reference_linear(in_features=128, out_features=64, bias=True, seed=0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, bias=bias)


def step(layer: FP8Linear, x: torch.Tensor, grad: torch.Tensor | None = None) -> torch.Tensor:
    """One training step of a lone layer: forward, backward, then what the optimizer step hook does."""
    y = layer(x)
    y.backward(torch.randn_like(y) if grad is None else grad)
    update_delayed_scales([layer])
    layer.reset_fp8_grad()
    return y.detach()


# ---- construction ----------------------------------------------------------------------------------


@pytest.mark.parametrize("weight_dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("bias", [True, False])
def test_from_float_stores_weight_in_weight_dtype_and_keeps_bias(weight_dtype, bias):
    linear = reference_linear(bias=bias)
    layer = fp8(linear, weight_dtype=WEIGHT_DTYPES[weight_dtype])
    assert (layer.in_features, layer.out_features) == (128, 64)
    # MS-AMP O1/O2: the weight lives in 16 bits (no master copy); the value is the rounded original.
    assert layer.weight.dtype == WEIGHT_DTYPES[weight_dtype]
    assert torch.equal(layer.weight.detach(), linear.weight.detach().to(WEIGHT_DTYPES[weight_dtype]))
    assert layer.weight is not linear.weight  # a new Parameter: the optimizer has to be remapped
    if bias:
        # Bias is not an FP8 tensor: kept in its own dtype and value, with an ordinary .grad.
        assert layer.bias.dtype == linear.bias.dtype == torch.float32
        assert torch.equal(layer.bias.detach(), linear.bias.detach())
        assert layer.bias.requires_grad
    else:
        assert layer.bias is None
    assert layer.weight.requires_grad
    names = {name for name, _ in layer.named_buffers()}
    assert {"fp8_meta_amax_history", "fp8_meta_scale_input", "fp8_meta_scale_grad", "fp8_meta_scale_weight",
            "fp8_meta_steps", "fp8_grad_data"} <= names
    # one storage per scale (cuBLASLt needs 16-byte aligned scale pointers; views of one buffer are not)
    assert all(b.storage_offset() == 0 and b.untyped_storage().nbytes() == 4 for b in layer.scale_buffers())
    assert layer.fp8_grad_data.dtype == E4M3 and layer.fp8_grad_data.shape == linear.weight.shape


def test_from_float_keeps_frozen_parameters_frozen():
    linear = reference_linear()
    linear.weight.requires_grad_(False)
    linear.bias.requires_grad_(False)
    layer = fp8(linear)
    assert not layer.weight.requires_grad
    assert not layer.bias.requires_grad


@pytest.mark.parametrize("kwargs,match", [
    (dict(weight_dtype=torch.float64), "weight_dtype"),
    (dict(fp8_format="E5M2"), "fp8_format"),
    (dict(amax_compute_algo="mean"), "amax_compute_algo"),
    (dict(amax_history_len=0), "amax_history_len"),
])
def test_constructor_rejects_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FP8Linear(32, 32, **kwargs)


# ---- numerics ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("weight_dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("seed", [0, 1])
def test_numerics_against_fp32_linear(weight_dtype, seed):
    linear = reference_linear(seed=seed)
    layer = fp8(linear, weight_dtype=WEIGHT_DTYPES[weight_dtype])
    x = torch.randn(4, 16, 128, generator=torch.Generator().manual_seed(seed))  # 3-D: (batch, seq, features)
    x_ref, x_fp8 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref, y_fp8 = linear(x_ref), layer(x_fp8)
    grad = torch.randn_like(y_ref)
    y_ref.backward(grad)
    y_fp8.backward(grad)

    assert y_fp8.shape == y_ref.shape and y_fp8.dtype == torch.float32
    # Lower bounds: E4M3/E5M2 with per-tensor scales give ~28 dB forward, ~24 dB on the gradients.
    # Upper bounds: FP8 really ran (a 16-bit GEMM would be above 40 dB).
    assert 25 < sqnr(y_ref, y_fp8) < 40
    assert 20 < sqnr(x_ref.grad, x_fp8.grad) < 40
    assert x_fp8.grad.dtype == x.dtype

    # The weight gradient never becomes a .grad: it stays on the layer in E4M3 with a per-tensor
    # power-of-two scale, and true value = fp8 / scale.
    assert layer.weight.grad is None
    data, scale = layer.fp8_grad_data, layer.fp8_grad_scale.item()
    assert data.dtype == E4M3
    assert math.log2(scale) == round(math.log2(scale))
    dequantised = data.float() / scale
    assert torch.equal(layer.weight_grad(), dequantised)
    # "current" scaling of the accumulated gradient: its amax lands in the upper half of E4M3's range
    assert E4M3_MAX / 2 < dequantised.abs().max().item() * scale <= E4M3_MAX
    assert 20 < sqnr(linear.weight.grad, dequantised) < 40

    # Bias gradient goes through plain autograd: the same sum as nn.Linear's.
    torch.testing.assert_close(layer.bias.grad, linear.bias.grad, rtol=1e-6, atol=1e-6)


def test_first_forward_equals_explicit_power_of_two_fp8_quantisation():
    """During warm-up both operands are scaled from their own amax; the GEMM is exact on dequantised values."""
    linear = reference_linear()
    layer = fp8(linear)
    x = torch.randn(32, 128)
    w = layer.weight.detach().float()
    s_x = pow2_scale(x.abs().max().item(), E4M3_MAX)
    s_w = pow2_scale(w.abs().max().item(), E4M3_MAX)
    expected = quantise(x, s_x) @ quantise(w, s_w).T + linear.bias.detach()
    torch.testing.assert_close(layer(x).detach(), expected, rtol=1e-6, atol=1e-6)
    assert layer.scales[2].item() == s_w  # the weight's scale is recorded for inspection


def test_scaled_mm_path_matches_emulation():
    """emulate=False runs torch._scaled_mm with reciprocal scales (the GPU path); same FP8 operands, same math."""
    linear = reference_linear()
    emulated, native = fp8(linear, emulate=True), fp8(linear, emulate=False)
    x = torch.randn(4, 16, 128)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    try:
        y2 = native(x2)
    except (RuntimeError, NotImplementedError) as exc:  # a CPU build without FP8 _scaled_mm
        pytest.skip(f"torch._scaled_mm unavailable here: {exc}")
    y1 = emulated(x1)
    grad = torch.randn_like(y1)
    y1.backward(grad)
    y2.backward(grad)
    torch.testing.assert_close(y2, y1, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x2.grad, x1.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(native.weight_grad(), emulated.weight_grad(), rtol=1e-5, atol=1e-5)


def test_hybrid_quantises_output_gradients_in_e5m2():
    """HYBRID (MS-AMP's only mode) casts output gradients to E5M2: one mantissa bit less than E4M3."""
    linear = reference_linear()
    x = torch.randn(64, 128)
    grad = torch.randn(64, 64)
    x_ref = x.clone().requires_grad_()
    linear(x_ref).backward(grad)
    results = {}
    for fmt in ("HYBRID", "E4M3"):
        layer = fp8(linear, fp8_format=fmt)
        assert layer.fp8_dtypes == (E4M3, E5M2 if fmt == "HYBRID" else E4M3)
        x_fp8 = x.clone().requires_grad_()
        layer(x_fp8).backward(grad)
        results[fmt] = sqnr(x_ref.grad, x_fp8.grad)
    assert results["HYBRID"] < results["E4M3"] - 2.0, results


def test_output_dtype_follows_autocast():
    layer = fp8(reference_linear())
    x = torch.randn(8, 128, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32
    assert layer.weight_grad() is not None


def test_eval_without_fp8_is_a_high_precision_linear_and_records_nothing():
    linear = reference_linear()
    layer = fp8(linear, fp8_eval=False)
    x = torch.randn(8, 128)
    layer.eval()
    with torch.no_grad():
        y = layer(x)
    torch.testing.assert_close(y, F.linear(x, layer.weight.float(), linear.bias), rtol=1e-6, atol=1e-6)
    assert not layer.amax_history.any()

    fp8_eval = fp8(linear, fp8_eval=True)  # MS-AMP's default: eval in FP8 too, but no amax is recorded
    fp8_eval.eval()
    with torch.no_grad():
        y8 = fp8_eval(x)
    assert 25 < sqnr(y, y8) < 40
    assert not fp8_eval.amax_history.any()


# ---- delayed scaling ---------------------------------------------------------------------------------


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_delayed_scales_follow_the_amax_window(algo):
    """MS-AMP tests/optim/test_adamw.py: after each step the input (and output-gradient) scale comes
    from the max amax of the last 16 steps; warm-up (in-time scaling) lasts exactly 16 steps."""
    window = 16  # MS-AMP's DEFAULT_WINDOW_SIZE, and FP8Linear's default
    layer = fp8(reference_linear(), amax_compute_algo=algo)
    assert layer.amax_history_len == window
    gen = torch.Generator().manual_seed(0)
    x_amaxes, g_amaxes = [], []
    for t in range(2 * window + 8):
        assert layer.in_time() == (t < window), t
        # magnitudes spread over 2^-6 .. 2^6 so the window max changes often
        x = torch.randn(16, 128, generator=gen) * 2.0 ** (torch.randint(-6, 7, (), generator=gen).item())
        g = torch.randn(16, 64, generator=gen) * 2.0 ** (torch.randint(-6, 7, (), generator=gen).item())
        x_amaxes.append(x.abs().max().item())
        g_amaxes.append(g.abs().max().item())
        y = layer(x)
        y.backward(g)
        if algo == "max":
            # what MS-AMP's test checks after every forward: the window holds the last 16 amaxes
            assert layer.amax_history[0].max().item() == max(x_amaxes[-window:])
            assert layer.amax_history[1].max().item() == max(g_amaxes[-window:])
        update_delayed_scales([layer])
        layer.reset_fp8_grad()
        pick = max if algo == "max" else (lambda values: values[-1])
        assert layer.scales[0].item() == pow2_scale(pick(x_amaxes[-window:]), E4M3_MAX), t
        assert layer.scales[1].item() == pow2_scale(pick(g_amaxes[-window:]), E5M2_MAX), t
    assert int(layer.fp8_meta_steps) == 2 * window + 8


def test_delayed_scale_is_used_after_warm_up():
    """After warm-up the input is cast with the window's scale, so an outlier above the window max
    saturates at 448 / scale (MS-AMP's delayed scaling); during warm-up it is cast with its own amax."""
    linear = reference_linear()
    window = 4
    x = torch.rand(16, 128) * 2 - 1
    x[0, 0] = 1.0  # amax exactly 1 -> scale 256
    spike = x.clone()
    spike[3, 5] = 100.0

    warm = fp8(linear, amax_history_len=window)
    for _ in range(window):
        step(warm, x)
    assert not warm.in_time()
    assert warm.scales[0].item() == pow2_scale(1.0, E4M3_MAX) == 256.0
    w = warm.weight.detach().float()
    s_w = pow2_scale(w.abs().max().item(), E4M3_MAX)
    expected = quantise(spike, 256.0) @ quantise(w, s_w).T + linear.bias.detach()  # 100 -> 1.75
    y = warm(spike).detach()
    torch.testing.assert_close(y, expected, rtol=1e-6, atol=1e-6)

    fresh = fp8(linear, amax_history_len=window)  # in time: the spike sets its own scale
    y_fresh = fresh(spike).detach()
    assert sqnr(linear(spike).detach()[3], y_fresh[3]) > 20
    assert sqnr(linear(spike).detach()[3], y[3]) < 10  # the clipped row is far off


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_amax_never_becomes_a_scale(bad):
    window = 4
    layer = fp8(reference_linear(), amax_history_len=window)
    gen = torch.Generator().manual_seed(0)
    finite_x = []
    for t in range(3 * window):
        x = torch.randn(16, 128, generator=gen)
        g = torch.randn(16, 64, generator=gen)
        if t in (1, window + 1):  # once during warm-up, once with delayed scales
            x[2, 3] = bad
            g[1, 1] = bad
            finite_x.append(0.0)  # dropped from the window
        else:
            finite_x.append(x.abs().max().item())
        y = layer(x)
        y.backward(g)
        for s in (layer.scales, layer.fp8_grad_scale):
            assert torch.isfinite(s).all() and (s > 0).all(), (t, s)
        update_delayed_scales([layer])
        layer.reset_fp8_grad()
        assert torch.isfinite(layer.scales).all() and (layer.scales > 0).all(), t
        assert torch.isfinite(layer.amax_history).all(), t
        # the scale comes from the finite amaxes of the window only
        assert layer.scales[0].item() == pow2_scale(max(finite_x[-window:]), E4M3_MAX), t
    y = layer(torch.randn(16, 128, generator=gen))
    assert torch.isfinite(y).all()


def test_non_finite_step_keeps_the_delayed_scale():
    # Deliberate difference from MS-AMP (docs/backends/msamp.md): MS-AMP restarts the warm-up after a
    # non-finite amax; lowprec drops the value and keeps the last finite window's scale, because
    # knowing on the host that an amax was non-finite would cost a device sync every step.
    window = 4
    layer = fp8(reference_linear(), amax_history_len=window)
    for _ in range(window + 1):
        step(layer, torch.randn(16, 128))
    before = layer.scales.clone()
    x = torch.randn(16, 128)
    x[0, 0] = float("nan")
    step(layer, x)
    assert not layer.in_time()
    assert torch.isfinite(layer.scales).all()
    torch.testing.assert_close(layer.scales[0], before[0])


# ---- gradient accumulation ---------------------------------------------------------------------------


@pytest.mark.parametrize("weight_dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("rows", [1, 16])  # 1 row: MS-AMP's test; the token dim is padded to 16 for the GEMM
def test_gradient_accumulation_equals_full_batch(weight_dtype, rows):
    """4 micro-batches accumulated (dequantise + add + requantise) = the gradient of the full batch.

    Accumulation is a sum, like autograd's: the caller scales its loss (Accelerate divides by the
    number of accumulation steps)."""
    linear = reference_linear()
    x = torch.randn(4 * rows, 128)
    grad = torch.randn(4 * rows, 64)
    x_ref = x.clone().requires_grad_()
    linear(x_ref).backward(grad)

    full = fp8(linear, weight_dtype=WEIGHT_DTYPES[weight_dtype])
    full(x).backward(grad)

    micro = fp8(linear, weight_dtype=WEIGHT_DTYPES[weight_dtype])
    for k in range(4):
        chunk = slice(k * rows, (k + 1) * rows)
        micro(x[chunk]).backward(grad[chunk])
    accumulated = micro.weight_grad()
    # Each micro-batch adds one more E4M3 rounding of the running sum: a few dB below one cast.
    assert sqnr(linear.weight.grad, accumulated) > 18
    assert sqnr(full.weight_grad(), accumulated) > 18
    ratio = (accumulated.norm() / linear.weight.grad.norm()).item()
    assert 0.95 < ratio < 1.05  # a sum, not a mean of the micro-batches
    torch.testing.assert_close(micro.bias.grad, linear.bias.grad, rtol=1e-5, atol=1e-5)

    micro.reset_fp8_grad()  # what optimizer.zero_grad() does
    assert micro.weight_grad() is None
    micro(x[:rows]).backward(grad[:rows])  # starts again from zero
    single = fp8(linear, weight_dtype=WEIGHT_DTYPES[weight_dtype])
    single(x[:rows]).backward(grad[:rows])
    assert sqnr(single.weight_grad(), micro.weight_grad()) > 18


def test_module_zero_grad_clears_the_fp8_weight_gradient():
    layer = fp8(reference_linear())
    x = torch.randn(16, 128)
    layer(x).sum().backward()
    layer.zero_grad()
    assert layer.weight_grad() is None


def test_a_batch_with_no_tokens_gives_empty_output_and_keeps_scales():
    # an MoE expert that received no tokens: shapes as nn.Linear, zero weight gradient, scales untouched
    layer = fp8(reference_linear())
    step(layer, torch.randn(16, 128))
    scales = layer.scales
    x = torch.randn(0, 128, requires_grad=True)
    y = layer(x)
    assert y.shape == (0, 64)
    y.sum().backward()
    assert x.grad.shape == (0, 128)
    assert torch.count_nonzero(layer.weight_grad()) == 0
    update_delayed_scales([layer])
    assert torch.isfinite(layer.scales).all() and torch.equal(layer.scales[:2], scales[:2])


# ---- compile, checkpointing, state_dict ----------------------------------------------------------------


def _fp8_mlp(window: int = 16) -> nn.Sequential:
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 32))
    return nn.Sequential(*[fp8(m, amax_history_len=window) if isinstance(m, nn.Linear) else m for m in ref])


def _layers(model: nn.Module) -> list[FP8Linear]:
    return [m for m in model.modules() if isinstance(m, FP8Linear)]


def test_torch_compile_matches_eager():
    """fullgraph=False, aot_eager (fast on CPU); window 2 so both graphs (warm-up and delayed) run."""
    torch.compiler.reset()
    eager, compiled_model = _fp8_mlp(window=2), _fp8_mlp(window=2)
    compiled = torch.compile(compiled_model, backend="aot_eager", fullgraph=False)
    gen = torch.Generator().manual_seed(0)
    try:
        for t in range(4):
            x = torch.randn(16, 64, generator=gen) * (t + 1)
            x_e, x_c = x.clone().requires_grad_(), x.clone().requires_grad_()
            y_e, y_c = eager(x_e), compiled(x_c)
            grad = torch.randn_like(y_e)
            y_e.backward(grad)
            y_c.backward(grad)
            torch.testing.assert_close(y_c, y_e, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(x_c.grad, x_e.grad, rtol=1e-5, atol=1e-5)
            for a, b in zip(_layers(eager), _layers(compiled_model)):
                torch.testing.assert_close(b.weight_grad(), a.weight_grad(), rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(b.bias.grad, a.bias.grad, rtol=1e-5, atol=1e-6)
                # in-place state updates inside the compiled autograd function must happen as in eager
                assert torch.equal(b.amax_history, a.amax_history), t
                assert torch.equal(b.scales, a.scales), t
            for model in (eager, compiled_model):
                update_delayed_scales(_layers(model))
                for layer in _layers(model):
                    layer.reset_fp8_grad()
                    layer.bias.grad = None
        assert not _layers(compiled_model)[0].in_time()
    finally:
        torch.compiler.reset()


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpointing_matches_plain_backward(use_reentrant):
    """The recompute runs the FP8 forward again; with the same scales it must give the same gradients."""
    plain, ckpt = _fp8_mlp(window=2), _fp8_mlp(window=2)
    gen = torch.Generator().manual_seed(0)
    for t in range(3):  # warm-up steps, then a delayed-scaling step
        x = torch.randn(16, 64, generator=gen) * (t + 1)
        x_p, x_c = x.clone().requires_grad_(), x.clone().requires_grad_()
        y_p = plain(x_p)
        y_c = checkpoint(ckpt, x_c, use_reentrant=use_reentrant)
        grad = torch.randn_like(y_p)
        y_p.backward(grad)
        y_c.backward(grad)
        assert torch.equal(y_c, y_p) and torch.equal(x_c.grad, x_p.grad), t
        for a, b in zip(_layers(plain), _layers(ckpt)):
            assert torch.equal(b.weight_grad(), a.weight_grad()), t
            assert torch.equal(b.amax_history, a.amax_history), t  # recompute does not distort the window
        for model in (plain, ckpt):
            update_delayed_scales(_layers(model))
            for layer in _layers(model):
                layer.reset_fp8_grad()
    assert not _layers(ckpt)[0].in_time()


def test_state_dict_round_trip_restores_delayed_scaling():
    window = 4
    linear = reference_linear()
    layer = fp8(linear, amax_history_len=window)
    gen = torch.Generator().manual_seed(0)
    for t in range(window + 2):
        step(layer, torch.randn(16, 128, generator=gen) * (t + 1))
    state = layer.state_dict()
    assert {"fp8_meta_amax_history", "fp8_meta_scale_input", "fp8_meta_scale_grad", "fp8_meta_steps"} <= set(state)
    assert not any(k.startswith("fp8_grad") for k in state)  # gradients are not checkpointed (like .grad)
    assert int(state["fp8_meta_steps"]) == window + 2

    restored = fp8(reference_linear(seed=7), amax_history_len=window)
    restored.load_state_dict(state, strict=True)
    assert not restored.in_time()  # the Python-side warm-up flag follows the loaded step count
    for name in ("fp8_meta_amax_history", "fp8_meta_scale_input", "fp8_meta_scale_grad", "fp8_meta_steps", "weight",
                 "bias"):
        assert torch.equal(restored.state_dict()[name], state[name]), name

    # An input well below the window's amax: delayed and in-time scales differ, so outputs tell them apart.
    x = torch.randn(16, 128, generator=gen) * 0.01
    torch.testing.assert_close(restored(x), layer(x), rtol=0, atol=0)
    unrestored = fp8(reference_linear(), amax_history_len=window)  # same weights, fresh (in-time) state
    assert not torch.equal(unrestored(x), layer(x))


@pytest.mark.parametrize("where", ["input", "grad"])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("warm", [False, True], ids=["own-amax", "delayed-scale"])
def test_non_finite_values_come_out_non_finite(where, bad, warm):
    # issue 27: the saturating cast clamped an inf to +-448/scale, so the output, the input gradient and the
    # stored weight gradient stayed finite and the overflow trained as a large step
    window = 4
    layer = fp8(reference_linear(), amax_history_len=window)
    for _ in range(window + 1 if warm else 0):
        step(layer, torch.randn(16, 128))
    assert layer.in_time() is not warm
    x = torch.randn(16, 128, requires_grad=True)
    g = torch.randn(16, 64)
    (x.data if where == "input" else g)[3, 5] = bad
    y = layer(x)
    y.backward(g)
    # as in high precision: y = x W^T sees the input, dx = g W the gradient, dW = g^T x both
    assert torch.isfinite(y).all().item() is (where == "grad")
    assert torch.isfinite(x.grad).all().item() is (where == "input")
    assert not torch.isfinite(layer.weight_grad()).all()
    assert torch.isfinite(layer.scales).all() and torch.isfinite(layer.fp8_grad_scale).all()


def test_cast_reference_turns_inf_into_nan():
    from lowprec.kernels.cast import cast_transpose_reference

    x = torch.randn(8, 16)
    x[1, 2], x[3, 4] = float("inf"), float("-inf")
    amax = torch.zeros(())
    q, qt = cast_transpose_reference(x, torch.tensor(1.0), E4M3, amax)
    assert torch.isnan(q.float()[1, 2]) and torch.isnan(q.float()[3, 4]) and torch.isnan(qt.float()[2, 1])
    assert torch.isfinite(q.float()).sum() == x.numel() - 2 and amax.item() == float("inf")


def _window_layers() -> list[FP8Linear]:
    layers = [FP8Linear(16, 16, bias=False, amax_history_len=3) for _ in range(2)]
    layers[0].amax_history.copy_(torch.tensor([[float("nan"), 2.0, 1.0], [3.0, 0.5, 0.25]]))
    layers[1].amax_history.copy_(torch.tensor([[0.75, 0.0, 4.0], [float("inf"), 1.0, 8.0]]))
    return layers


def test_all_reduce_amaxes_is_a_no_op_on_one_process():
    """Without a process group, and on a group of one rank, the windows stay bitwise as they are (NaN and inf
    included), and the scale update after it gives what it gives without the reduction."""
    import torch.distributed as dist

    from lowprec.backends.msamp.communication import all_reduce_amaxes

    def unchanged(layers, before):  # bitwise, NaN where NaN was
        return all(torch.equal(a.amax_history.isnan(), b.isnan()) and torch.equal(a.amax_history.nan_to_num(),
                                                                                  b.nan_to_num())
                   for a, b in zip(layers, before))

    assert not dist.is_initialized()
    layers = _window_layers()
    before = [layer.amax_history.clone() for layer in layers]
    all_reduce_amaxes(layers)
    assert unchanged(layers, before)
    reduced, plain = _window_layers(), _window_layers()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        all_reduce_amaxes(layers)
        assert unchanged(layers, before)
        all_reduce_amaxes(reduced)
        update_delayed_scales(reduced)
    finally:
        dist.destroy_process_group()
    update_delayed_scales(plain)
    for a, b in zip(reduced, plain):
        assert torch.equal(a.amax_history, b.amax_history) and torch.equal(a.scales, b.scales)
        assert torch.isfinite(a.scales).all()


def test_a_delayed_scale_changed_between_forward_and_backward_leaves_the_backward_on_the_forwards_scale():
    # after the warm-up the forward reads the stored delayed scale itself, not a copy (one launch less per call): the
    # backward dequantises the saved input with the factor the forward derived from it, whatever happens to it after
    def weight_grad(change: bool) -> torch.Tensor:
        layer = fp8(reference_linear())
        layer._count_step(layer.amax_history_len)
        torch.manual_seed(1)
        out = layer(torch.randn(8, 128))
        if change:
            with torch.no_grad():
                layer.scale_buffers()[0].mul_(2.0)
        out.sum().backward()
        return layer.weight_grad()

    assert torch.equal(weight_grad(change=True), weight_grad(change=False))


@pytest.mark.parametrize(("dtype", "gemm_dtype"), [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)])
def test_an_fsdp2_gathered_weights_gradient_comes_out_in_its_dtype_at_fp8_accuracy(dtype, gemm_dtype, monkeypatch):
    # O3 under FSDP2 hands the weight gradient to autograd, which would cast an FP32 one to the weight's dtype in a
    # launch of its own: the GEMM writes BF16 itself; FP16 (a range below FP32's) still goes through FP32, whose cast
    # turns an overflow into inf where a GEMM's FP16 output might saturate
    import lowprec.backends.msamp.linear as linear_module
    from lowprec.backends.msamp.fsdp import FP8GatheredWeight
    from lowprec.kernels.scaling import compute_scale, quantize

    asked = []
    real = linear_module.scaled_gemm
    monkeypatch.setattr(linear_module, "scaled_gemm", lambda *a, **k: asked.append(a[4]) or real(*a, **k))

    linear = reference_linear(bias=False)
    layer = FP8Linear(128, 64, bias=False, emulate=True, sharded_master=True)
    w = linear.weight.detach()
    scale = compute_scale(w.abs().amax(), E4M3)
    layer.weight = nn.Parameter(FP8GatheredWeight(quantize(w, scale, E4M3), scale, dtype))  # as FSDP2 leaves it
    x, g = torch.randn(32, 128), torch.randn(32, 64)
    layer(x).backward(g)
    reference = g.t() @ x
    assert asked[-1] == gemm_dtype  # the backward's last GEMM: the weight gradient
    assert layer.weight.grad.dtype == dtype
    assert 20 < sqnr(reference, layer.weight.grad) < 40


@pytest.mark.parametrize("act_dtype, gemm_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32),
                                                   (torch.float32, torch.float32)], ids=["bf16", "fp16", "fp32"])
def test_a_stored_weight_gradient_is_computed_in_the_output_gradients_dtype_where_it_has_fp32s_range(
        act_dtype, gemm_dtype, monkeypatch):
    # O1/O2 keep the weight gradient in E4M3: the GEMM writes it in the output gradient's dtype, as MS-AMP does, where
    # that dtype has FP32's range (BF16: half the bytes of an FP32 one live in the backward); FP16, whose overflow
    # would be a finite max, goes through FP32
    import lowprec.backends.msamp.linear as linear_module

    asked = []
    real = linear_module.scaled_gemm
    monkeypatch.setattr(linear_module, "scaled_gemm", lambda *a, **k: asked.append(a[4]) or real(*a, **k))
    linear = reference_linear(bias=False)
    layer = fp8(linear, weight_dtype=torch.float32)
    x, g = torch.randn(32, 128).to(act_dtype), torch.randn(32, 64).to(act_dtype)
    layer(x).backward(g)
    assert asked[-1] == gemm_dtype  # the backward's last GEMM: the weight gradient
    reference = g.float().t() @ x.float()
    assert sqnr(reference, layer.weight_grad()) > 20  # one E4M3 rounding of the inputs and of the stored gradient


@pytest.mark.parametrize("weight_dtype", ["fp16", "bf16"])
def test_current_scales_fused_give_the_definitions_training_step(weight_dtype, fused_on_cpu, monkeypatch):
    # an eager layer on CUDA computes each current scale (warm-up inputs and gradients, an O2 weight's every forward)
    # in one compiled call: inductor's CPU code standing in, a warm-up step equals the definition's bit for bit
    import lowprec.backends.msamp.linear as linear_module

    def run(fused: bool):
        if not fused:
            monkeypatch.setattr(linear_module, "_current_scale", linear_module._current_scale.eager)
        layer = fp8(reference_linear(), weight_dtype=WEIGHT_DTYPES[weight_dtype])
        x = torch.randn(16, 128, generator=torch.Generator().manual_seed(2), requires_grad=True)
        y = layer(x)
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(3)))
        return y, x.grad, layer.weight_grad(), layer.scales, layer.amax_history

    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    fused = run(True)
    assert counters["stats"]["unique_graphs"] > graphs  # the fused form ran
    definition = run(False)
    assert all(torch.equal(a, b) for a, b in zip(fused, definition))
