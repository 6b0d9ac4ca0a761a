"""Eager code fused into one kernel per pass on CUDA (`lowprec.kernels.fused.cuda_fused`): FSDP2's FP8
all-gather and FP8 reduce-scatter passes give the bytes of their plain-torch definitions, inf and NaN
included. Run on a GPU host with `pytest -m gpu`; skipped elsewhere.
"""

from __future__ import annotations

import pytest
import torch

from lowprec.backends.msamp.fsdp import _group_bytes, _shard_bytes
from lowprec.optim.comm_hooks import _block_amax, _block_scales, _decode_sum, _encode_blocks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                       reason="needs a Hopper (sm_90) or newer GPU"),
]


def _values(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * torch.exp2(torch.randint(-20, 12, shape, generator=g).float())
    x = x.to(dtype)
    x.view(-1)[7] = float("nan")
    x.view(-1)[11] = float("inf")
    x.view(-1)[13] = -float("inf")
    return x.cuda()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype in (torch.uint8, torch.float8_e4m3fn):
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    same_nans = torch.equal(a.isnan(), b.isnan())
    return same_nans and torch.equal(torch.nan_to_num(a, nan=-7.0), torch.nan_to_num(b, nan=-7.0))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows, padded", [(64, 64), (33, 40), (0, 8)])
def test_the_all_gathers_shard_bytes_equal_the_definition(dtype, rows, padded):
    shard = _values((max(rows, 1), 96), dtype)[:rows]
    scale = torch.tensor(2.0**-3, device="cuda")
    fused, eager = _shard_bytes(shard, scale, padded), _shard_bytes.eager(shard, scale, padded)
    assert fused.shape == (padded, 96) and _same(fused, eager)


def test_a_blocks_group_cast_gives_each_shard_its_own_bytes():
    # one compiled call for the seven weights of a block (inductor may make it one kernel): each shard padded to its
    # own length and cast with its own scale, as `_shard_bytes` eager gives it
    shards = [_values((rows, cols), torch.float16, seed=i) for i, (rows, cols) in
              enumerate([(64, 96), (33, 96), (16, 48), (1, 200)])]
    rows = [64, 40, 16, 8]
    scales = torch.tensor([2.0**-3, 1.0, 2.0**4, 2.0**-10], device="cuda")
    fused = _group_bytes(scales, shards, rows)
    for shard, scale, count, got in zip(shards, scales, rows, fused):
        assert got.shape == (count, shard.shape[1])
        assert _same(got, _shard_bytes(shard, scale, count))  # the bytes weight by weight gave
        decoded = got.view(torch.float8_e4m3fn).float()  # a NaN's byte may differ from eager's: compare values
        assert _same(decoded, _shard_bytes.eager(shard, scale, count).view(torch.float8_e4m3fn).float())


@pytest.mark.parametrize("numel, n, block", [(4096, 2, 1024), (5000, 2, 1024), (3 * 777, 3, 256)])
def test_the_reduce_scatters_three_passes_equal_the_definition(numel, n, block):
    flat = _values((numel,), torch.float32)
    amax = _block_amax(flat, n, block)
    assert _same(amax, _block_amax.eager(flat, n, block))
    scale = _block_scales(amax)
    assert torch.equal(scale, _block_scales.eager(amax))
    sent = _encode_blocks(flat, scale, n, block)
    assert _same(sent, _encode_blocks.eager(flat, scale, n, block))
    assert _same(_decode_sum(sent, scale[0], float(n)), _decode_sum.eager(sent, scale[0], float(n)))


@pytest.mark.parametrize("valid", [1.0, 0.0])
@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_the_stored_gradient_norm_equals_the_definition(valid, norm_type):
    from lowprec.optim.grad_store import _stored_norm

    data = _values((96, 80), torch.float32).nan_to_num(nan=1.0, posinf=2.0, neginf=-2.0)
    data = data.clamp(-448, 448).to(torch.float8_e4m3fn)
    scale, flag = torch.tensor(2.0**5, device="cuda"), torch.tensor(valid, device="cuda")
    fused, eager = _stored_norm(data, scale, flag, norm_type), _stored_norm.eager(data, scale, flag, norm_type)
    torch.testing.assert_close(fused, eager, rtol=1e-6, atol=0)  # a sum's order may differ, not its value
    assert (fused == 0) == (valid == 0)


@pytest.mark.parametrize("keep", [True, False])
def test_requantising_a_stored_fp8_weight_equals_the_definition(keep):
    from lowprec.backends.msamp.fsdp import _scaled_cast

    value = _values((64, 48), torch.float16).nan_to_num(nan=0.5, posinf=3.0, neginf=-3.0)
    previous = torch.tensor(4.0, device="cuda") if keep else None
    (s1, d1), (s2, d2) = _scaled_cast(value, previous, 0), _scaled_cast.eager(value, previous, 0)
    assert torch.equal(s1, s2) and _same(d1, d2)
    nan = value.clone()
    nan[0, 0] = float("nan")  # a non-finite amax keeps the previous scale (1 without one), never a NaN scale
    scale, _ = _scaled_cast(nan, previous, 0)
    assert float(scale) == (4.0 if keep else 1.0)


@pytest.mark.parametrize("valid", [1.0, 0.0])
def test_the_fp8_gradient_reducers_two_passes_equal_the_definition(valid):
    # DDP's and ZeRO's once-per-step FP8 gradient averaging (lowprec.optim.grad_reduce): the requantisation to
    # the shared scale and the mean of the received shards, each one kernel, the definition's bytes
    from lowprec.optim.grad_reduce import mean_over_ranks, requantize

    ratios = torch.tensor([1.0, 0.5, 2.0**-7], device="cuda")
    for length in (4096 * 3, 777, 5000):
        data = _values((length,), torch.float32).clamp(-448, 448).to(torch.float8_e4m3fn)  # NaN included
        flag = torch.tensor(valid, device="cuda")
        for k in range(3):
            assert _same(requantize(data, ratios[k], flag), requantize.eager(data, ratios[k], flag)), (length, k)
    for n in (2, 3):  # 3: a sum that 1/3 does not divide exactly (the kernel must multiply as torch does)
        received = torch.stack([_values((4097,), torch.float32, seed).clamp(-448, 448) for seed in range(n)])
        received = received.to(torch.float8_e4m3fn).view(torch.uint8)
        assert _same(mean_over_ranks(received, 1.0 / n), mean_over_ranks.eager(received, 1.0 / n)), n


def test_whole_tensor_reductions_keep_the_definition_from_a_short_first_length():
    # compiled once for every length, split or not from the first: a short first call, then weight-sized ones
    from lowprec.backends.msamp.fsdp import _scaled_cast
    from lowprec.optim.grad_store import _stored_norm

    torch._dynamo.reset()  # the short call below is then the first these functions compile for
    for shape in [(3, 5), (4096 * 3 + 5,), (4096, 1408), (1408, 4096)]:
        value = _values(shape, torch.float32, seed=len(shape)).nan_to_num(nan=1.0, posinf=2.0, neginf=-2.0)
        data, scale, one = value.clamp(-448, 448).to(torch.float8_e4m3fn), torch.tensor(8.0, device="cuda"), \
            torch.ones((), device="cuda")
        for norm_type in (2.0, float("inf")):
            torch.testing.assert_close(_stored_norm(data, scale, one, norm_type),
                                       _stored_norm.eager(data, scale, one, norm_type), rtol=1e-6, atol=0)
        (s1, d1), (s2, d2) = _scaled_cast(value, scale, 0), _scaled_cast.eager(value, scale, 0)
        assert torch.equal(s1, s2) and _same(d1, d2)


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("store_dtype", [torch.float8_e4m3fn, torch.bfloat16], ids=["e4m3", "bf16"])
@pytest.mark.parametrize("valid", [1.0, 0.0])
def test_a_stores_accumulation_equals_the_definition(store_dtype, valid, grad_dtype):
    # torchao's and te's weight gradients under O1/O2 (lowprec.optim.grad_store): the dequantise-add-requantise of
    # a store's hook as two kernels (the amax, then the cast), the definition's values, scale and amax (values, not
    # bytes: a NaN's sign bit is not the definition's to fix)
    from lowprec.kernels.fused import fuses
    from lowprec.optim.grad_store import accumulated

    flag = torch.tensor(valid, device="cuda")
    for i, shape in enumerate([(64, 48), (4096, 1408), (33, 4097)]):
        grad = _values(shape, grad_dtype, seed=i)
        finite = grad.nan_to_num(nan=1.0, posinf=2.0, neginf=-2.0)
        data = (finite.float() * 2.0**3).clamp(-448, 448).to(store_dtype)
        assert fuses(data)  # the compiled form runs, not the definition twice
        for scale in (torch.tensor(2.0**3, device="cuda"), torch.tensor(1.0, device="cuda")):
            for g in (finite, grad):  # a finite gradient, then one with inf and NaN
                got, want = accumulated(data, scale, flag, g), accumulated.eager(data, scale, flag, g)
                assert _same(got[0].float(), want[0].float()), (shape, i)
                assert torch.equal(got[1], want[1]) and _same(got[2], want[2]), (shape, i)
        clipped = torch.tensor(2.0**3 / 1.7, device="cuda")  # clipping divides a scale: a quotient now rounds
        got, want = accumulated(data, clipped, flag, finite), accumulated.eager(data, clipped, flag, finite)
        torch.testing.assert_close(got[0].float() / got[1], want[0].float() / want[1], rtol=2**-3, atol=0)
