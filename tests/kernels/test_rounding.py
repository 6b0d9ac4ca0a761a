"""Stochastic rounding (lowprec/kernels/rounding.py): the definition the fused Adam kernel's rounding is tested
against on the GPU (tests/gpu/test_msamp_gpu.py). Neighbours are checked against every finite value of the
format, enumerated from its 65536 bit patterns, not against nextafter, which the implementation uses."""

from __future__ import annotations

import pytest
import torch

from lowprec.kernels.rounding import rounding_generator, rounding_seed, rounding_seeds, stochastic_round

DTYPES = [torch.float16, torch.bfloat16]


def finite_values(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of a 16-bit format, ascending, in FP64 (one zero)."""
    values = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(dtype).double()
    return torch.unique(values[torch.isfinite(values)])


def neighbours(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The largest representable value <= x and the smallest >= x."""
    grid = finite_values(dtype)
    x = x.double()
    above = torch.searchsorted(grid, x, right=False).clamp(max=grid.numel() - 1)
    below = (torch.searchsorted(grid, x, right=True) - 1).clamp(min=0)
    return grid[below], grid[above]


def sample(dtype: torch.dtype, n: int, gen: torch.Generator) -> torch.Tensor:
    """Values over the whole range: normal, subnormal, zeros, both signs, exact values of the format."""
    tiny = torch.finfo(dtype).tiny
    exps = torch.randint(-30, 16, (n,), generator=gen).float() if dtype == torch.float16 else \
        torch.randint(-130, 120, (n,), generator=gen).float()
    x = torch.randn(n, generator=gen) * torch.exp2(exps)
    x[:8] = torch.tensor([0.0, -0.0, tiny, -tiny, tiny / 3, 1.0, -1.0, 2.0**-20])
    x[8:64] = torch.randn(56, generator=gen).to(dtype).float()  # already representable
    return x


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_the_result_is_one_of_the_two_neighbours(dtype):
    gen = torch.Generator().manual_seed(0)
    x = sample(dtype, 200_000, gen)
    x = x[x.abs() <= torch.finfo(dtype).max]
    out = stochastic_round(x, dtype, torch.Generator().manual_seed(1))
    assert out.dtype == dtype
    below, above = neighbours(x, dtype)
    value = out.double()
    assert ((value == below) | (value == above)).all()
    exact = below == above
    assert exact.sum() >= 56 and torch.equal(value[exact], x.double()[exact])  # nothing to round: x itself
    # both directions really occur among the inexact values
    inexact = ~exact
    assert (value[inexact] == below[inexact]).float().mean() > 0.2
    assert (value[inexact] == above[inexact]).float().mean() > 0.2


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("where", [1.0, -0.02, 3e-6, 1e4])  # 3e-6 is FP16-subnormal
@pytest.mark.parametrize("fraction", [0.03, 0.5, 0.9])
def test_rounding_up_has_the_probability_of_the_distance_so_the_mean_is_unbiased(dtype, where, fraction):
    grid = finite_values(dtype)
    at = torch.searchsorted(grid, torch.tensor([where], dtype=torch.float64), right=True) - 1
    low, high = grid[at], grid[at + 1]  # where, or the value below it, and the next value up
    x = (low + fraction * (high - low)).float()
    fraction = ((x.double() - low) / (high - low)).item()  # after x's own FP32 rounding
    n = 400_000
    out = stochastic_round(x.expand(n), dtype, torch.Generator().manual_seed(3)).double()
    p_up = (out == high).double().mean().item()
    sigma = (fraction * (1 - fraction) / n) ** 0.5
    assert abs(p_up - fraction) < 5 * sigma
    # the mean is x within 5 sigma: rounding to nearest would be off by min(fraction, 1 - fraction) of a step
    step = (high - low).item()
    assert abs(out.mean().item() - x.item()) < 5 * sigma * step
    assert abs(x.to(dtype).double().item() - x.item()) > 20 * sigma * step


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_non_finite_and_out_of_range_values_round_to_nearest(dtype):
    top = torch.finfo(dtype).max
    beyond = torch.finfo(torch.float32).max
    x = torch.tensor([float("inf"), -float("inf"), float("nan"), top, -top, top * (1 + 2**-12), beyond, -beyond])
    out = stochastic_round(x, dtype, torch.Generator().manual_seed(0))
    assert torch.equal(out[:2], x[:2].to(dtype)) and out[2].isnan()
    assert torch.equal(out[3:], x[3:].to(dtype))
    # the largest finite value is never rounded up to inf at random
    below_top = torch.full((100_000,), top, dtype=torch.float32)
    assert torch.isfinite(stochastic_round(below_top, dtype)).all()


def test_the_same_seed_rounds_the_same_and_another_seed_differently():
    # the CPU generator keeps 32 bits of a seed: steps (the high half of rounding_seed) must still differ
    x = torch.randn(10_000) * 1e-2
    a = stochastic_round(x, torch.float16, rounding_generator(rounding_seed(5, 2)))
    b = stochastic_round(x, torch.float16, rounding_generator(rounding_seed(5, 2)))
    others = [stochastic_round(x, torch.float16, rounding_generator(rounding_seed(s, o))) for s, o in [(6, 2), (5, 3)]]
    assert torch.equal(a, b) and not any(torch.equal(a, c) for c in others)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_other_dtypes_are_refused_by_name(dtype):
    with pytest.raises(ValueError, match=r"dtype=.*torch.float16, torch.bfloat16"):
        stochastic_round(torch.ones(2), dtype)


def test_seeds_on_the_device_are_the_host_seeds():
    steps, ordinals = [1, 2, 300, 2**24], [0, 7, 2**31 + 5, 3]
    host = [rounding_seed(s, o) for s, o in zip(steps, ordinals)]
    device = rounding_seeds(torch.tensor(steps, dtype=torch.float32), torch.tensor(ordinals, dtype=torch.int64))
    assert device.tolist() == host
    assert len({rounding_seed(s, o) for s in range(50) for o in range(50)}) == 2500
