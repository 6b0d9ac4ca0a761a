"""`kernels.fused`: the rows a `cuda_fused` function's whole-tensor reductions run over. Inductor decides how
to split a reduction over a whole tensor from the first length it compiles for, and reuses that choice for
every length (dynamic shapes): a reduction over rows has its parallelism in the shape instead. Here: the
rows' reductions equal the whole tensor's, for every norm order and for NaN, inf, empty and odd lengths, and
the compiled form (inductor's CPU code) keeps the definition across lengths; tests/gpu/test_fused_gpu.py and
benchmarks/fused_reductions.py run the CUDA kernels.
"""

from __future__ import annotations

import math

import pytest
import torch

from lowprec.kernels.fused import REDUCTION_ROW, amax_by_rows, reduction_rows, sum_over_ranks
from lowprec.optim.grad_store import _stored_norm

E4M3 = torch.float8_e4m3fn
ORDERS = [2.0, 1.0, 3.5, math.inf, -math.inf, 0.0, -1.0]
LENGTHS = [0, 1, 777, REDUCTION_ROW, 3 * REDUCTION_ROW + 5]


def _values(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * torch.exp2(torch.randint(-6, 6, (n,), generator=g).float())


@pytest.mark.parametrize("n", LENGTHS)
def test_rows_hold_the_tensor_then_the_fill(n):
    x = _values(n)
    rows = reduction_rows(x.view(1, -1) if n else x, fill=-3.0)
    assert rows.shape[1] == REDUCTION_ROW and rows.shape[0] == max(1, -(-n // REDUCTION_ROW))
    assert torch.equal(rows.reshape(-1)[:n], x) and bool((rows.reshape(-1)[n:] == -3.0).all())


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("special", [None, math.nan, math.inf, -math.inf])
def test_amax_by_rows_is_the_tensors_amax(n, special):
    x = _values(n, seed=n).to(torch.bfloat16)
    if special is not None and n:
        x[n // 2] = special
    expected = x.abs().amax().float() if n else torch.tensor(0.0)
    torch.testing.assert_close(amax_by_rows(x), expected, equal_nan=True, rtol=0, atol=0)


def _stored(n: int, seed: int, special=None) -> torch.Tensor:
    data = (_values(n, seed) * 16).clamp(-448, 448)
    if special is not None and n:
        data[n // 3] = special
    return data.to(E4M3)


@pytest.mark.parametrize("norm_type", ORDERS)
@pytest.mark.parametrize("n", [1, 777, 3 * REDUCTION_ROW + 5])
@pytest.mark.parametrize("special", [None, math.nan])
def test_the_stored_norm_over_rows_is_the_fp32_norm(norm_type, n, special):
    data, scale = _stored(n, seed=n, special=special), torch.tensor(2.0**3)
    reference = torch.linalg.vector_norm(data.float() / scale, norm_type)
    norm = _stored_norm(data, scale, torch.tensor(1.0), norm_type)
    torch.testing.assert_close(norm, reference, rtol=1e-5, atol=0, equal_nan=True)
    # no gradient on this rank: 0 for every order, as the FP32 norm of zeros
    empty = _stored_norm(data, scale, torch.tensor(0.0), norm_type)
    torch.testing.assert_close(empty, torch.linalg.vector_norm(torch.zeros(n), norm_type))


@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_the_sum_over_ranks_is_the_fp32_sum_in_rank_order(n):
    received = _stored(n * 777, seed=n, special=math.nan).view(n, 777)
    total = sum_over_ranks(received)
    assert total.dtype == torch.float32 and total.shape == (777,)
    expected = received[0].float()
    for row in received[1:]:
        expected = expected + row.float()
    assert torch.equal(total.isnan(), expected.isnan()) and int(total.isnan().sum()) == 1
    assert torch.equal(total.nan_to_num(), expected.nan_to_num())
    torch.testing.assert_close(total, received.float().sum(0), equal_nan=True, rtol=1e-6, atol=0)


@pytest.fixture
def fused_on_cpu(monkeypatch):
    import lowprec.kernels.fused as fused

    monkeypatch.setattr(fused, "FUSED_DEVICE_TYPES", ("cuda", "cpu"))
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_the_compiled_norm_and_requantisation_keep_the_definition_from_a_short_first_length(fused_on_cpu):
    # the GPU's failure mode began with a short first call; compiled, every later length must still match
    from lowprec.backends.msamp.fsdp import _scaled_cast

    for n in (5, 3 * REDUCTION_ROW + 5, 2 * REDUCTION_ROW, 40_000):
        data = _stored(n, seed=n, special=math.nan if n > 10_000 else None)
        scale, valid = torch.tensor(4.0), torch.tensor(1.0)
        for norm_type in (2.0, math.inf):
            torch.testing.assert_close(_stored_norm(data, scale, valid, norm_type),
                                       _stored_norm.eager(data, scale, valid, norm_type), rtol=1e-6, atol=0,
                                       equal_nan=True)
        value = _values(n, seed=n + 1).view(1, -1)
        (s1, d1), (s2, d2) = _scaled_cast(value, torch.tensor(2.0), 0), _scaled_cast.eager(value, torch.tensor(2.0), 0)
        assert torch.equal(s1, s2) and torch.equal(d1.view(torch.uint8), d2.view(torch.uint8))
