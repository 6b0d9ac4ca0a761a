"""`lowprec.kernels.scaling`: power-of-two scales, FP8 casts and the delayed-scaling amax window.

Expected values come from MS-AMP's rule (reference/msamp.md §1.2, ScalingMeta.compute_scaling_factor),
written out here in Python floats, not read back from the implementation:
`scale = 2 ** (floor(log2(fp_max / amax)) - margin)` with E4M3 max 448, E5M2 max 57344, FP16 max
65504; where amax is 0, inf or NaN the previous scale is kept. The MS-AMP test values
(tests/common/tensor/test_meta.py: amax 0 -> 1, 10 -> 32, 10000 -> 1/32) and its window test
(tests/optim/test_adamw.py: over 102 steps the history max is the max of the last 16 amaxes) are
ported below.
"""

from __future__ import annotations

import math

import pytest
import torch

from lowprec.kernels.scaling import (
    FP8_DTYPES,
    AmaxHistory,
    compute_scale,
    current_scale,
    dequantize,
    format_max,
    quantize,
)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# Largest finite values, from the format definitions (OCP FP8 "fn" E4M3, IEEE-like E5M2, IEEE half).
FORMAT_MAX = {E4M3: 448.0, E5M2: 57344.0, torch.float16: 65504.0}
SCALED = list(FORMAT_MAX)
NON_FINITE = [0.0, float("inf"), float("-inf"), float("nan")]


def pow2_scale(amax: float, fmt_max: float, margin: int = 0) -> float:
    """MS-AMP's scaling factor, computed independently in float64."""
    return 2.0 ** (math.floor(math.log2(fmt_max / amax)) - margin)


def sqnr(reference: torch.Tensor, value: torch.Tensor) -> float:
    """Signal-to-quantisation-noise ratio in dB (higher is closer)."""
    return (20 * torch.log10(reference.norm() / (reference - value).norm())).item()


# ---- format_max ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", SCALED)
def test_format_max_is_the_largest_finite_value(dtype):
    assert format_max(dtype) == FORMAT_MAX[dtype]
    # Cross-check against torch's own description of the format.
    assert format_max(dtype) == torch.finfo(dtype).max


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_format_max_of_wide_formats(dtype):
    assert format_max(dtype) == torch.finfo(dtype).max


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.float64])
def test_format_max_rejects_formats_it_does_not_scale(dtype):
    with pytest.raises(ValueError, match=str(dtype)):
        format_max(dtype)


# ---- compute_scale ------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "amax,dtype,expected",
    [
        # MS-AMP tests/common/tensor/test_meta.py (E4M3, margin 0)
        (10.0, E4M3, 32.0),
        (10000.0, E4M3, 1 / 32),
        (0.0, E4M3, 1.0),
        # exact boundaries: amax == fp_max keeps scale 1; just above halves it
        (448.0, E4M3, 1.0),
        (448.5, E4M3, 0.5),
        (224.0, E4M3, 2.0),
        (57344.0, E5M2, 1.0),
        (10.0, E5M2, 4096.0),
        (1.0, torch.float16, 32768.0),
    ],
)
def test_compute_scale_ms_amp_examples(amax, dtype, expected):
    if amax > 0:  # the table agrees with the rule
        assert expected == pow2_scale(amax, FORMAT_MAX[dtype])
    scale = compute_scale(amax, dtype)
    assert scale.dtype == torch.float32 and scale.shape == ()
    assert scale.item() == expected


@pytest.mark.parametrize("dtype", SCALED)
def test_compute_scale_follows_the_power_of_two_rule_over_40_decades(dtype):
    amax = torch.logspace(-20, 20, 2001, dtype=torch.float64).float()
    # plus amaxes that sit exactly on power-of-two boundaries, where floor() matters most
    # and one FP32 step either side of them, where log2 of the FP32 quotient rounds to the wrong side
    boundaries = FORMAT_MAX[dtype] / 2.0 ** torch.arange(-20, 40, dtype=torch.float32)
    amax = torch.cat([amax, boundaries, boundaries * (1 + 2**-23), boundaries * (1 - 2**-24)])
    scale = compute_scale(amax, dtype)
    expected = torch.tensor([pow2_scale(a, FORMAT_MAX[dtype]) for a in amax.double().tolist()], dtype=torch.float64)
    assert scale.shape == amax.shape
    torch.testing.assert_close(scale.double(), expected, rtol=0, atol=0)
    # The invariant the rule exists for: the scaled amax fills the upper octave of the format.
    scaled = amax.double() * scale.double()
    assert (scaled <= FORMAT_MAX[dtype]).all() and (scaled > FORMAT_MAX[dtype] / 2).all()


@pytest.mark.parametrize("margin", [0, 1, 3])
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_compute_scale_margin_adds_power_of_two_headroom(margin, dtype):
    for amax in (1e-3, 0.7, 10.0, 3000.0):
        assert compute_scale(amax, dtype, margin=margin).item() == pow2_scale(amax, FORMAT_MAX[dtype], margin)
    # each step of margin halves the scale
    assert compute_scale(10.0, dtype, margin=margin).item() * 2**margin == compute_scale(10.0, dtype).item()


@pytest.mark.parametrize("dtype", SCALED)
def test_compute_scale_never_underflows_to_zero_past_a_huge_margin(dtype):
    # margin 200 gave a scale of 0, which dequantises as 1/0: NaN outputs. Floored at 2**-126 (the cap's mirror).
    amax = torch.tensor([1e-3, 1.0, 3e38, 0.0])
    scale = compute_scale(amax, dtype, margin=200, previous=0.5)
    torch.testing.assert_close(scale, torch.tensor([2.0**-126] * 3 + [0.5]), rtol=0, atol=0)
    assert torch.isfinite(dequantize(quantize(torch.ones(4), scale, dtype), scale)).all()
    assert compute_scale(1.0, dtype, margin=-300).item() == 2.0**126


@pytest.mark.parametrize("bad", NON_FINITE)
def test_compute_scale_keeps_previous_where_amax_is_zero_or_non_finite(bad):
    # With a previous scale the bad amax never changes it (a tensor of zeros keeps the last good scale).
    assert compute_scale(bad, E4M3, previous=torch.tensor(0.25)).item() == 0.25
    assert compute_scale(bad, E4M3, previous=8.0).item() == 8.0
    # Documented: with no previous scale the result is 1, never NaN/inf/0.
    assert compute_scale(bad, E4M3).item() == 1.0


def test_compute_scale_is_elementwise_over_a_batch_of_amaxes():
    amax = torch.tensor([10.0, 0.0, float("nan"), float("inf"), 10000.0, 1e-3])
    previous = torch.tensor([2.0, 4.0, 8.0, 16.0, 32.0, 64.0])
    scale = compute_scale(amax, E4M3, previous=previous)
    expected = torch.tensor([32.0, 4.0, 8.0, 16.0, 1 / 32, pow2_scale(1e-3, 448.0)])
    torch.testing.assert_close(scale, expected, rtol=0, atol=0)
    # a scalar previous broadcasts; no previous gives 1 for the bad entries
    torch.testing.assert_close(compute_scale(amax, E4M3, previous=0.5)[1:4], torch.full((3,), 0.5))
    torch.testing.assert_close(compute_scale(amax, E4M3)[1:4], torch.ones(3))
    # a 2-D batch keeps its shape
    assert compute_scale(torch.rand(3, 5) + 0.1, E5M2).shape == (3, 5)


def test_a_nan_never_becomes_a_scale():
    amax = torch.tensor([float("nan")] * 3 + [1.0, 0.0])
    for previous in (None, torch.ones(5), torch.full((5,), 2.0**-20)):
        scale = compute_scale(amax, E4M3, previous=previous)
        assert torch.isfinite(scale).all() and (scale > 0).all()


@pytest.mark.parametrize(
    "amax,dtype",
    [(1e-37, E4M3), (1e-40, E4M3), (1e-36, torch.float16), (0.5, torch.bfloat16), (0.5, torch.float32)],
)
def test_compute_scale_is_finite_for_every_finite_positive_amax(amax, dtype):
    scale = compute_scale(amax, dtype)
    assert torch.isfinite(scale) and scale > 0
    assert amax * scale.item() <= format_max(dtype)


# ---- quantize / dequantize ----------------------------------------------------------------------

# (format, min SQNR dB, max SQNR dB) for a Gaussian tensor with a current per-tensor scale.
# Round-to-nearest with m mantissa bits gives about 6.02 * m + 10.8 dB before range effects:
# E4M3 (3 bits) ~ 29-31 dB, E5M2 (2 bits) ~ 23-25 dB. The upper bound proves the cast happened.
ROUND_TRIP = [(E4M3, 28.0, 34.0), (E5M2, 22.0, 28.0)]


@pytest.mark.parametrize("dtype,lo,hi", ROUND_TRIP)
@pytest.mark.parametrize("magnitude", [1e-6, 1.0, 1e4])
def test_quantize_round_trip_error_against_fp32(dtype, lo, hi, magnitude):
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * magnitude
    scale, amax = current_scale(x, dtype)
    assert amax.item() == x.abs().max().item()
    assert scale.item() == pow2_scale(amax.item(), FORMAT_MAX[dtype])
    q = quantize(x, scale, dtype)
    assert q.dtype == dtype
    y = dequantize(q, scale)
    assert y.dtype == torch.float32
    # scaling makes the error independent of the tensor's magnitude
    assert lo < sqnr(x, y) < hi


def test_e4m3_round_trip_is_closer_than_e5m2():
    x = torch.randn(4096, generator=torch.Generator().manual_seed(1))
    errors = {}
    for dtype in FP8_DTYPES:
        scale, _ = current_scale(x, dtype)
        errors[dtype] = sqnr(x, dequantize(quantize(x, scale, dtype), scale))
    assert errors[E4M3] > errors[E5M2] + 3  # one more mantissa bit is ~6 dB


@pytest.mark.parametrize("dtype", FP8_DTYPES)
def test_round_trip_is_exact_for_representable_values(dtype):
    # A power-of-two scale adds no rounding of its own: every FP8 value divided by the scale survives.
    values = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    values = values[torch.isfinite(values)]
    for scale in (2.0**-7, 1.0, 2.0**12):
        s = torch.tensor(scale)
        torch.testing.assert_close(dequantize(quantize(values / scale, s, dtype), s), values / scale, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", FP8_DTYPES)
def test_quantize_saturates_instead_of_overflowing(dtype):
    fmt_max = FORMAT_MAX[dtype]
    x = torch.tensor([-1e9, -3 * fmt_max, -fmt_max, 0.0, fmt_max, 3 * fmt_max, 1e9])
    q = quantize(x, torch.tensor(1.0), dtype).float()
    # A plain cast would give NaN (E4M3fn) or inf (E5M2) for the out-of-range entries.
    assert torch.isfinite(q).all()
    torch.testing.assert_close(q, x.clamp(-fmt_max, fmt_max), rtol=0, atol=0)
    # saturation also applies after scaling
    q2 = quantize(torch.tensor([10.0]), torch.tensor(1e6), dtype).float()
    assert q2.item() == fmt_max


def test_dequantize_output_dtype():
    x = torch.randn(64)
    scale, _ = current_scale(x, E4M3)
    q = quantize(x, scale, E4M3)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert dequantize(q, scale, dtype).dtype == dtype


def test_quantize_a_tensor_of_zeros_stays_zero():
    x = torch.zeros(16)
    scale, amax = current_scale(x, E4M3, previous=torch.tensor(4.0))
    assert amax.item() == 0 and scale.item() == 4.0  # zeros keep the last good scale
    assert (dequantize(quantize(x, scale, E4M3), scale) == 0).all()


# ---- AmaxHistory (delayed scaling) --------------------------------------------------------------

def test_amax_history_rejects_bad_arguments():
    with pytest.raises(ValueError, match="amax_history_len"):
        AmaxHistory(0, "max", E4M3)
    with pytest.raises(ValueError, match="amax_compute_algo"):
        AmaxHistory(4, "mean", E4M3)


@pytest.mark.parametrize("length", [1, 4, 16])
def test_amax_history_max_is_max_of_last_window_amaxes(length):
    # MS-AMP tests/optim/test_adamw.py: over 102 steps the window max is the max of the last 16 inputs.
    gen = torch.Generator().manual_seed(length)
    history = AmaxHistory(length, "max", E4M3)
    seen: list[float] = []
    for _ in range(102):
        amax = float(torch.rand((), generator=gen) * 100 + 1e-3)
        history.record(torch.tensor(amax))
        seen.append(amax)
        window = seen[-length:]
        assert history.history.max().item() == pytest.approx(max(window), rel=1e-6)
        assert history.scale.item() == pow2_scale(torch.tensor(max(window)).item(), 448.0)


def test_amax_history_most_recent_uses_only_the_last_amax():
    history = AmaxHistory(8, "most_recent", E4M3)
    for amax in (1000.0, 1.0, 10.0):
        history.record(torch.tensor(amax))
        assert history.scale.item() == pow2_scale(amax, 448.0)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_amax_history_drops_non_finite_amaxes(bad):
    history = AmaxHistory(4, "max", E4M3)
    for amax in (3.0, 5.0):
        history.record(torch.tensor(amax))
    good_scale = history.scale.item()
    history.record(torch.tensor(bad))
    assert torch.isfinite(history.history).all()
    assert history.history.max().item() == 5.0  # the bad step is not in the window
    assert history.scale.item() == good_scale
    # ... and warm-up restarts: the next casts are "in time" again (MS-AMP resets amax_counter)
    assert bool(history.in_time())


def test_amax_history_warm_up_then_delayed():
    length = 4
    history = AmaxHistory(length, "max", E4M3)
    # During warm-up the scale comes from the tensor being cast.
    for i in range(length):
        assert bool(history.in_time())
        x = torch.full((8,), 10.0 ** (i - 1))
        assert history.scale_for(x).item() == pow2_scale(10.0 ** (i - 1), 448.0)
    assert not bool(history.in_time())
    # After it, from the window (max of the last 4 amaxes = 100), not from this tensor (1000).
    assert history.scale_for(torch.full((8,), 1000.0)).item() == pow2_scale(100.0, 448.0)
    # The tensor's amax was recorded: the next delayed scale sees it.
    assert history.scale_for(torch.full((8,), 1.0)).item() == pow2_scale(1000.0, 448.0)


def test_amax_history_length_one_is_current_scaling():
    history = AmaxHistory(1, "max", E5M2)
    for amax in (1.0, 1e4, 3.0, 1e-3):
        assert bool(history.in_time())
        assert history.scale_for(torch.tensor([amax, -amax / 2])).item() == pow2_scale(amax, 57344.0)


def test_amax_history_scale_for_never_returns_nan():
    history = AmaxHistory(2, "max", E4M3)
    history.scale_for(torch.full((4,), 10.0))
    for bad in (float("nan"), float("inf")):
        scale = history.scale_for(torch.tensor([1.0, bad]))
        assert torch.isfinite(scale) and scale.item() == pow2_scale(10.0, 448.0)


def test_amax_history_state_dict_round_trip():
    a = AmaxHistory(4, "max", E4M3)
    for amax in (3.0, 70.0, 0.5, 9.0, 2.0):
        a.record(torch.tensor(amax))
    b = AmaxHistory(4, "max", E4M3)
    b.load_state_dict(a.state_dict())
    for h in (a, b):
        h.record(torch.tensor(1.0))
    assert torch.equal(a.history, b.history) and torch.equal(a.scale, b.scale) and torch.equal(a.seen, b.seen)
    # the state dict is a copy, not a view of the live buffers
    state = a.state_dict()
    a.record(torch.tensor(400.0))
    assert state["history"].max().item() != 400.0


def test_empty_tensors_keep_the_previous_scale():
    scale, amax = current_scale(torch.empty(0, 4), E4M3, previous=torch.tensor(4.0))
    assert scale.item() == 4.0 and amax.item() == 0.0
    history = AmaxHistory(2, "max", E4M3)
    assert history.scale_for(torch.empty(0)).item() == 1.0


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_quantize_saturates_finite_values_and_keeps_non_finite_ones_visible(dtype):
    # issue 27: a saturating cast turned inf into a finite +-max, so an overflow trained as a large step
    limit = format_max(dtype)
    x = torch.tensor([1.0, -2.0, 1e6, -1e6, float("inf"), float("-inf"), float("nan")])
    q = quantize(x, torch.tensor(1.0), dtype).float()
    assert q[:4].tolist() == [1.0, -2.0, limit, -limit]  # finite overflow saturates, as MS-AMP's cast
    assert torch.isnan(q[4:]).all()


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inf_to_nan_leaves_finite_values_exact(compiled, dtype):
    # eager and compiled take different code (one lerp kernel; a where that inductor fuses): same result
    from lowprec.kernels.scaling import inf_to_nan

    fn = torch.compile(inf_to_nan, backend="aot_eager") if compiled else inf_to_nan
    x = torch.tensor([1.5, -0.0, 0.0, 1e-40, -3e38, float("inf"), float("-inf"), float("nan")]).to(dtype)
    y = fn(x)
    assert y.dtype == dtype and torch.equal(y[:5], x[:5]) and torch.signbit(y[1]) and torch.isnan(y[5:]).all()


def test_cuda_fused_runs_the_definition_on_cpu_without_compiling(monkeypatch):
    # the fused kernels are a CUDA matter: a CPU run must not pay inductor's compile time
    from lowprec.kernels.fused import cuda_fused

    monkeypatch.setattr(torch, "compile", lambda *a, **k: pytest.fail("compiled on CPU"))
    calls = []

    @cuda_fused
    def scaled(x, s):
        calls.append(1)
        return x * s

    x = torch.arange(4.0)
    assert torch.equal(scaled(x, 2.0), x * 2) and scaled.eager is not scaled and calls == [1]


@pytest.mark.parametrize("own_rows", [False, True])
@pytest.mark.parametrize("special", [None, float("nan"), float("inf")])
@pytest.mark.parametrize("shape", [(37, 129), (0, 64), (5,)])
def test_a_compiled_tensor_amax_is_the_amax_over_either_row_form(monkeypatch, own_rows, special, shape):
    # scaling.AMAX_OVER_OWN_ROWS: in a graph, over the matrix's own rows or over fixed-length ones; the same value,
    # NaN kept, 0 for an empty matrix, a vector over the fixed rows either way
    from lowprec.kernels import scaling

    monkeypatch.setattr(scaling, "AMAX_OVER_OWN_ROWS", own_rows)
    torch._dynamo.reset()
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    if special is not None and x.numel():
        x.view(-1)[x.numel() // 2] = special
    got = torch.compile(scaling.tensor_amax, backend="inductor", fullgraph=True)(x)
    expected = x.abs().amax().float() if x.numel() else torch.tensor(0.0)
    torch.testing.assert_close(got, expected, equal_nan=True, rtol=0, atol=0)
