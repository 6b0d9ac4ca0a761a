"""`kernels.fused`: the rows a traced whole-tensor reduction runs over. Inductor decides how to split a
reduction over a whole tensor from the first length it compiles for, and reuses that choice for every length
(dynamic shapes): a reduction over rows has its parallelism in the shape instead. Here: the rows' reductions
equal the whole tensor's, for every norm order and for NaN, inf, empty and odd lengths, eager (one row) and
compiled (inductor's CPU code, padded rows), with one graph for every length; the unrolled sum over ranks is
`sum(0)`'s bytes. tests/gpu/test_fused_gpu.py and benchmarks/fused_reductions.py run the CUDA kernels.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import same_bytes

from lowprec.kernels.fused import REDUCTION_ROW, amax_by_rows, padded_rows, reduction_rows, sum_over_ranks
from lowprec.optim.grad_store import _stored_norm

E4M3 = torch.float8_e4m3fn
ORDERS = [2.0, 1.0, 3.5, math.inf, -math.inf, 0.0, -1.0]
LENGTHS = [0, 1, 777, REDUCTION_ROW, 3 * REDUCTION_ROW + 5]


def _values(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * torch.exp2(torch.randint(-6, 6, (n,), generator=g).float())


@pytest.mark.parametrize("n", LENGTHS)
def test_padded_rows_hold_the_tensor_then_the_fill_in_two_rows_or_more(n):
    x = _values(n)
    rows = padded_rows(x.view(1, -1) if n else x, fill=-3.0)
    assert rows.shape == (-(-n // REDUCTION_ROW) + 1, REDUCTION_ROW)  # one row more: never a single row, never 0 pad
    assert torch.equal(rows.reshape(-1)[:n], x) and bool((rows.reshape(-1)[n:] == -3.0).all())


def test_eager_rows_are_one_row_viewing_the_tensor():
    x = _values(777).view(7, 111)
    rows = reduction_rows(x, fill=-3.0)
    assert rows.shape == (1, 777) and rows.data_ptr() == x.data_ptr()


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
    # the same over padded rows, as a compiled graph computes it
    rows = padded_rows(data.float() / scale, math.inf if norm_type < 0 else 0.0)
    per_row = torch.linalg.vector_norm(rows, norm_type, dim=1)
    over_rows = per_row.sum() if norm_type == 0 else torch.linalg.vector_norm(per_row, norm_type)
    torch.testing.assert_close(over_rows, reference, rtol=1e-5, atol=0, equal_nan=True)
    # no gradient on this rank: 0 for every order, as the FP32 norm of zeros
    empty = _stored_norm(data, scale, torch.tensor(0.0), norm_type)
    torch.testing.assert_close(empty, torch.linalg.vector_norm(torch.zeros(n), norm_type))


@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_the_sum_over_ranks_is_sum_0s_bytes(n):
    # E4M3 values are multiples of 2**-9 below 2**9: their FP32 sums over a few ranks are exact in any order
    received = _stored(n * 777, seed=n, special=math.nan).view(n, 777)
    total = sum_over_ranks(received)
    assert total.dtype == torch.float32 and total.shape == (777,) and int(total.isnan().sum()) == 1
    expected = received.float().sum(0)
    assert torch.equal(total.isnan(), expected.isnan()) and torch.equal(total.nan_to_num(), expected.nan_to_num())


def test_compiled_norms_and_requantisation_hold_over_padded_rows_with_one_graph_for_every_length(fused_on_cpu):
    # compiled, the reductions run over padded rows (inductor's CPU code here): the FP32 norm for every order and
    # the definition's bytes, NaN included, from a short first length on, one graph per function and order
    from torch._dynamo.utils import counters

    from lowprec.backends.msamp.fsdp import _scaled_cast

    orders = [2.0, math.inf, -math.inf, 0.0, 1.0]
    graphs = counters["stats"]["unique_graphs"]
    for n in (5, 3 * REDUCTION_ROW + 5, 2 * REDUCTION_ROW, 40_000):
        data = _stored(n, seed=n, special=math.nan if n > 10_000 else None)
        scale, valid = torch.tensor(4.0), torch.tensor(1.0)
        for norm_type in orders:
            reference = torch.linalg.vector_norm(data.float() / scale, norm_type)
            torch.testing.assert_close(_stored_norm(data, scale, valid, norm_type), reference, rtol=1e-5, atol=0,
                                       equal_nan=True)
        value = _values(n, seed=n + 1).view(1, -1)
        value[0, n // 2] = math.nan if n > 10_000 else value[0, n // 2]
        (s1, d1), (s2, d2) = _scaled_cast(value, torch.tensor(2.0), 0), _scaled_cast.eager(value, torch.tensor(2.0), 0)
        assert torch.equal(s1, s2) and same_bytes(d1, d2)
    # a norm per order; the requantisation's one compiled function (rows' amaxes, theirs, the cast)
    assert counters["stats"]["unique_graphs"] - graphs == len(orders) + 1
