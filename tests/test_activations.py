"""`lowprec.kernels.activations`: FP8 E4M3 storage of saved tensors with a power-of-2 scale per 1x128 group.

The bound tested is the one the module derives: with s the group's scale (stored as its exponent),
|decode(x) - x| <= 2**-4 * |x| + 2**-10 / s, and 2**-10 / s < amax_group * 2**-10 / 224; a BF16 or FP32 value above
448 * 2**119 (2.98e38) comes back as 2.98e38.
"""

from __future__ import annotations

import pytest
import torch
from conftest import same_bytes

from lowprec.kernels.activations import GROUP, MIN_EXPONENT, floors_scale, pack_fp8, unpack_fp8


def bound(x: torch.Tensor, packed) -> torch.Tensor:
    """Per-element error bound, FP32, in the shape of `x`, from each element's group scale."""
    inverse = torch.exp2(-packed.exponent.float()).unsqueeze(-1).expand(packed.data.shape)
    inverse = inverse.reshape(packed.data.shape[0], -1)[:, :packed.last].reshape(x.shape)
    return 2**-4 * x.float().abs() + 2**-10 * inverse


def group_amax(x: torch.Tensor) -> torch.Tensor:
    """Each element's group amax (finite values), in the shape of `x`."""
    last = x.shape[-1]
    size = min(GROUP, last)
    rows = x.float().reshape(-1, last)
    rows = torch.nn.functional.pad(rows, (0, -last % size))
    groups = rows.reshape(rows.shape[0], -1, size)
    amax = torch.where(torch.isfinite(groups), groups, 0).abs().amax(-1, keepdim=True).expand(groups.shape)
    return amax.reshape(rows.shape[0], -1)[:, :last].reshape(x.shape)


SHAPES = [(4, 256), (3, 5, 384), (2, 300), (64, 100), (7, 1), (1000,), (2, 3, 4, 129)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_round_trip_within_the_derived_bound(shape, dtype):
    g = torch.Generator().manual_seed(0)
    # values over many binades within a group, so both the normal and the subnormal part of the bound are hit
    x = (torch.randn(shape, generator=g) * torch.exp2(torch.randint(-12, 8, shape, generator=g).float())).to(dtype)
    packed = pack_fp8(x)
    y = unpack_fp8(packed)
    assert y.dtype == dtype and y.shape == x.shape
    error = (y.float() - x.float()).abs()
    assert (error <= bound(x, packed)).all()
    assert (error <= 2**-4 * x.float().abs() + group_amax(x) * 2**-10 / 224).all()
    # most of it is far tighter than the bound: values near the group amax are normal E4M3
    near = x.float().abs() >= group_amax(x) / 16
    assert (error[near] <= 2**-4 * x.float().abs()[near]).all()


def test_layout_is_one_byte_per_element_and_one_per_group():
    x = torch.randn(6, 300)
    packed = pack_fp8(x)
    assert packed.data.dtype == torch.float8_e4m3fn and packed.data.shape == (6, 3, 128)  # 300 padded to 384
    assert packed.exponent.dtype == torch.int8 and packed.exponent.shape == (6, 3)
    assert packed.nbytes() == 6 * 384 + 18
    short = pack_fp8(torch.randn(5, 40))
    assert short.data.shape == (5, 1, 40) and short.exponent.shape == (5, 1)  # one scale per row


def test_scales_are_powers_of_two_fitting_each_group():
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(0)).clamp(-2, 2)
    x[0, 5] = x[0, 260] = 3.0  # groups 0 and 2 share their amax (random ones could fall in two binades)
    x[0, 130] = 1000.0  # an outlier costs precision to its own group only
    packed = pack_fp8(x)
    scale = torch.exp2(packed.exponent.float())
    amax = x.abs().reshape(2, 4, 128).amax(-1)
    assert ((amax * scale <= 448) & (amax * scale > 224)).all()
    assert scale[0, 1] < scale[0, 0] and scale[0, 0] == scale[0, 2]


def test_zeros_and_exact_values_are_exact():
    x = torch.zeros(3, 256)
    assert torch.equal(unpack_fp8(pack_fp8(x)), x)
    x[1, :4] = torch.tensor([1.0, -0.5, 448.0, 2.0**-3])  # E4M3 values times a power of two come back exactly
    assert torch.equal(unpack_fp8(pack_fp8(x)), x)
    mixed = torch.randn(2, 256)
    mixed[:, 7] = 0.0
    assert (unpack_fp8(pack_fp8(mixed))[:, 7] == 0).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_non_finite_value_never_decodes_finite(bad, dtype):
    x = torch.randn(4, 256).to(dtype)
    x[2, 200] = bad
    packed = pack_fp8(x)
    y = unpack_fp8(packed)
    assert not torch.isfinite(y[2, 200])
    # the rest of its group keeps a scale fitted to its finite values, not scale 1
    others = torch.ones_like(x, dtype=torch.bool)
    others[2, 200] = False
    assert torch.isfinite(y[others]).all()
    error = (y.float() - x.float()).abs()
    assert (error[others] <= bound(x, packed)[others]).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_a_finite_value_at_the_top_of_its_dtype_comes_back_finite(dtype):
    # FP16: E4M3's rounding steps a group's largest value up (64000 at scale 2**-8 is 250 -> 256, 65536 in FP16:
    # inf); the decode keeps it at the dtype's largest finite value, within the bound. BF16 and FP32: no scale under
    # 2**MIN_EXPONENT, so a value above 448 * 2**119 saturates there (their decode has no clamp)
    top = torch.finfo(dtype).max
    fp16 = dtype == torch.float16
    x = torch.tensor([[top, -top, 0.93 * top, 64000.0 if fp16 else 0.97 * top, 1.0, 1000.0 if fp16 else 2.5e38]],
                     dtype=dtype)
    packed = pack_fp8(x)
    y = unpack_fp8(packed)
    assert torch.isfinite(y).all(), y
    assert floors_scale(dtype) is not fp16
    saturated = x.float().abs() > 448 * 2.0**-MIN_EXPONENT if floors_scale(dtype) else torch.zeros_like(y, dtype=bool)
    assert saturated.sum() == (0 if fp16 else 4)  # 2.5e38 is below 2.98e38: within the bound
    assert torch.equal(y.float()[saturated], 448 * 2.0**-MIN_EXPONENT * x.float()[saturated].sign())
    assert packed.exponent.min() >= (MIN_EXPONENT if floors_scale(dtype) else -127)
    assert ((y.float() - x.float()).abs() <= bound(x, packed))[~saturated].all()


def test_a_group_of_only_non_finite_values_stays_non_finite():
    x = torch.full((2, 128), float("inf"))
    assert not torch.isfinite(unpack_fp8(pack_fp8(x))).any()


def test_tiny_and_large_magnitudes_keep_their_bound():
    for magnitude in (2.0**-100, 2.0**-60, 1e30):
        x = torch.randn(3, 256) * magnitude
        packed = pack_fp8(x)
        error = (unpack_fp8(packed) - x).abs()
        assert (error <= bound(x, packed)).all(), magnitude


def test_non_contiguous_input_is_restored_in_its_shape():
    x = torch.randn(256, 64).t()
    y = unpack_fp8(pack_fp8(x))
    assert y.shape == x.shape
    assert ((y - x).abs() <= 2**-4 * x.abs() + group_amax(x) * 2**-10 / 224).all()


@pytest.mark.parametrize("bad", [torch.zeros(3, dtype=torch.int64), torch.tensor(1.0), torch.zeros(0, 4)])
def test_what_cannot_be_packed_is_refused(bad):
    with pytest.raises(ValueError, match="pack_fp8"):
        pack_fp8(bad)


def test_the_fused_form_gives_the_definitions_bytes(monkeypatch):
    # On CUDA the encode and decode run compiled (one kernel each); inductor's CPU code stands in for it here,
    # inside a forward's saved-tensor hooks as in training, for every dtype and both group layouts.
    from torch._dynamo.utils import counters

    import lowprec.kernels.fused as fused
    from lowprec.kernels.activations import _decode, _encode

    monkeypatch.setattr(fused, "FUSED_DEVICE_TYPES", ("cuda", "cpu"))
    graphs = counters["stats"]["unique_graphs"]
    g = torch.Generator().manual_seed(1)
    # within dynamo's recompile limit (8 per function), past which a call would run the definition itself
    for shape in [(4, 256), (3, 300), (5, 40)]:
        for dtype in (torch.float32, torch.bfloat16):
            x = (torch.randn(shape, generator=g) * torch.exp2(torch.randint(-12, 8, shape, generator=g).float()))
            x = x.to(dtype)
            x[1, 3], x[2, 5] = float("nan"), float("inf")
            w = torch.randn(shape[-1], 8, requires_grad=True)
            with torch.autograd.graph.saved_tensors_hooks(pack_fp8, unpack_fp8):
                (x.float() @ w).sum().backward()  # the hooks pack x for w's gradient: compiled inside a hook
            rows = x.reshape(-1, shape[-1])
            size = min(GROUP, shape[-1])
            data, exponent = _encode(rows, size)
            want_data, want_exponent = _encode.eager(rows, size)
            assert same_bytes(data, want_data) and torch.equal(exponent, want_exponent), (shape, dtype)
            decoded = _decode(data, exponent, shape[-1], dtype)
            assert same_bytes(decoded, _decode.eager(data, exponent, shape[-1], dtype)), (shape, dtype)
            assert decoded.dtype == dtype and torch.isnan(decoded[1, 3]) and torch.isnan(decoded[2, 5])
    assert counters["stats"]["unique_graphs"] > graphs  # the compiled form ran, not the definition again


@pytest.mark.parametrize("view", ["transpose", "slice of a fused projection", "permuted heads"])
def test_a_strided_view_comes_back_with_its_strides(view):
    # a compiled backward asserts the strides of the tensors it saved (inductor's assert_size_stride)
    base = torch.randn(4, 64, 3 * 256)
    x = {"transpose": base[0].t(), "slice of a fused projection": base[..., 256:512],
         "permuted heads": base[..., :256].reshape(4, 64, 2, 128).permute(0, 2, 1, 3)}[view]
    packed = pack_fp8(x)
    y = unpack_fp8(packed)
    assert y.shape == x.shape and y.stride() == x.stride()
    assert ((y - x).abs() <= 2**-4 * x.abs() + group_amax(x) * 2**-10 / 224).all()
    # the view's elements only (one byte each, one per group), not its base's
    assert packed.nbytes() <= x.numel() * (1 + 1 / min(GROUP, x.shape[-1]))


def test_views_of_one_storage_decode_into_one_buffer_at_their_offsets():
    # q, k, v of a fused QKV output: decoded one by one each would get a buffer spanning its strides (three times
    # the slice); with one key they share one buffer of the storage's length, as they shared memory when saved
    from lowprec.kernels.activations import SpanKey

    base = torch.randn(64, 3 * 256, generator=torch.Generator().manual_seed(0))
    views = [base[:, i * 256:(i + 1) * 256] for i in range(3)]
    key = SpanKey()
    packed = [pack_fp8(v, key) for v in views]
    out = [unpack_fp8(p) for p in packed]
    storages = {o.untyped_storage().data_ptr() for o in out}
    assert len(storages) == 1 and out[0].untyped_storage().nbytes() == base.untyped_storage().nbytes()
    for o, v in zip(out, views):
        assert o.stride() == v.stride() and o.storage_offset() == v.storage_offset()
        assert ((o - v).abs() <= 2**-4 * v.abs() + group_amax(v) * 2**-10 / 224).all()
    # once every view is gone the buffer goes too, and a later decode gets a fresh one
    del out
    again = unpack_fp8(packed[1])
    assert again.stride() == views[1].stride()
    # without a key each view spans its strides on its own
    alone = unpack_fp8(pack_fp8(views[0]))
    assert alone.untyped_storage().nbytes() > 2 * views[0].numel() * views[0].element_size()


def test_an_expanded_view_is_refused():
    from lowprec.kernels.activations import overlapping

    x = torch.randn(1, 256).expand(8, 256)
    assert overlapping(x) and not overlapping(torch.randn(8, 256)[:, :128]) and not overlapping(torch.randn(3, 5).t())
    with pytest.raises(ValueError, match="expanded view"):
        pack_fp8(x)


def test_the_fused_form_compiles_once_inside_and_outside_autocast(monkeypatch):
    # The pack hook runs inside the model's autocast and outside it (a norm's FP32 input): one graph for both,
    # or every dtype would cost two of dynamo's 8 recompiles, past which the encode runs as ten eager kernels
    from torch._dynamo.utils import counters

    import lowprec.kernels.fused as fused

    monkeypatch.setattr(fused, "FUSED_DEVICE_TYPES", ("cuda", "cpu"))
    encode = fused.cuda_fused(lambda rows, size: (rows.float() * 2).to(torch.bfloat16))  # a function of its own
    rows = torch.randn(8, 128)
    encode(rows, 128)
    graphs = counters["stats"]["unique_graphs"]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = encode(rows, 128)
    assert counters["stats"]["unique_graphs"] == graphs and torch.equal(out, (rows * 2).to(torch.bfloat16))
