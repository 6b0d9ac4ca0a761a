"""LowBitAdamW writes FP16/BF16 parameters back with stochastic rounding by default (the levels' weights have no
FP32 master): updates below the format's resolution add up in expectation instead of being lost. The fused
kernel's form is tested on the GPU (tests/gpu/test_msamp_gpu.py)."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from lowprec.optim import LowBitAdam, LowBitAdamW
from lowprec.optim.low_bit_adam import plain_adam_state_dict

FP16, BF16 = torch.float16, torch.bfloat16


def descend(param_dtype, *, steps, lr, stochastic_rounding, n=8192, start=1.0, cls=LowBitAdamW):
    """`steps` AdamW steps of a constant gradient: each moves every weight by about -lr, below half a step of
    the format at `start` (FP16 at 1.0: 2**-11 = 4.9e-4; BF16: 2**-8)."""
    p = nn.Parameter(torch.full((n,), start, dtype=param_dtype))
    # FP32 moments: E4M3's would move each step's size by up to 6%, deterministically, on every element
    opt = cls([p], lr=lr, weight_decay=0.0, stochastic_rounding=stochastic_rounding)
    for _ in range(steps):
        p.grad = torch.ones_like(p)
        opt.step()
    return p.detach().double()


@pytest.mark.parametrize("cls", [LowBitAdamW, LowBitAdam])
@pytest.mark.parametrize("param_dtype,lr", [(FP16, 1e-4), (BF16, 5e-4)])
def test_updates_below_half_a_step_add_up_in_expectation(param_dtype, lr, cls):
    steps = 40
    nearest = descend(param_dtype, steps=steps, lr=lr, stochastic_rounding=False, cls=cls)
    stochastic = descend(param_dtype, steps=steps, lr=lr, stochastic_rounding=True, cls=cls)
    exact = 1.0 - steps * lr  # Adam's step with a constant gradient is lr (bias-corrected m / sqrt(v) = 1)
    assert torch.equal(nearest, torch.ones_like(nearest))  # every update lost
    # each element is a sum of `steps` independent roundings of variance <= step**2 / 4
    step = 2.0**-11 if param_dtype == FP16 else 2.0**-8
    sigma = (steps * step**2 / 4 / nearest.numel()) ** 0.5
    assert abs(stochastic.mean().item() - exact) < 6 * sigma
    assert stochastic.std().item() > 0  # elements went different ways


def test_stochastic_rounding_is_the_default_and_fp32_parameters_are_written_exactly():
    assert LowBitAdamW([nn.Parameter(torch.ones(2))]).defaults["stochastic_rounding"] is True
    assert LowBitAdam([nn.Parameter(torch.ones(2))]).defaults["stochastic_rounding"] is True
    runs = [descend(torch.float32, steps=5, lr=1e-3, stochastic_rounding=flag, n=64) for flag in (True, False)]
    assert torch.equal(*runs)


def test_replicas_round_alike_and_different_parameters_differently():
    """DDP: every rank updates its replica of a parameter, and they must stay equal; the seed is the step and the
    parameter's position, not the process's RNG (which a rank may have advanced differently)."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(4096, generator=gen).to(FP16)
    grads = [torch.randn(4096, generator=gen).to(FP16) for _ in range(3)]
    finals = []
    for rank in range(2):
        torch.manual_seed(rank)  # the ranks' RNGs differ
        a, b = nn.Parameter(w.clone()), nn.Parameter(w.clone())  # two parameters with the same values
        opt = LowBitAdamW([a, b], lr=3e-3, exp_avg_dtype="e4m3", exp_avg_sq_dtype="fp16")
        for g in grads:
            a.grad, b.grad = g.clone(), g.clone()
            opt.step()
        finals.append((a.detach().clone(), b.detach().clone()))
        torch.rand(7)  # nor does the optimizer's rounding depend on what else draws from it
    assert torch.equal(finals[0][0], finals[1][0]) and torch.equal(finals[0][1], finals[1][1])
    assert not torch.equal(finals[0][0], finals[0][1])  # independent roundings per parameter


def test_rounding_draws_nothing_from_the_global_rng():
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    descend(FP16, steps=2, lr=1e-4, stochastic_rounding=True, n=16)
    assert torch.equal(torch.rand(3), expected)


def _round_trip(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def test_the_choice_is_the_run_s_not_the_checkpoint_s():
    p = nn.Parameter(torch.ones(8, dtype=FP16))
    opt = LowBitAdamW([p], stochastic_rounding=True)
    p.grad = torch.ones_like(p)
    opt.step()
    saved = _round_trip(opt.state_dict())
    assert saved["param_groups"][0]["stochastic_rounding"] is True
    assert "stochastic_rounding" not in plain_adam_state_dict(saved)["param_groups"][0]  # torch's Adam has no such key
    q = nn.Parameter(torch.ones(8, dtype=FP16))
    other = LowBitAdamW([q], stochastic_rounding=False)
    other.load_state_dict(saved)
    assert other.param_groups[0]["stochastic_rounding"] is False
    # torch's AdamW checkpoint (no key): the run's default stays
    torch_opt = torch.optim.AdamW([nn.Parameter(torch.ones(8))])
    torch_opt.param_groups[0]["params"][0].grad = torch.ones(8)
    torch_opt.step()
    fresh = LowBitAdamW([nn.Parameter(torch.ones(8, dtype=FP16))])
    fresh.load_state_dict(_round_trip(torch_opt.state_dict()))
    assert fresh.param_groups[0]["stochastic_rounding"] is True


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_a_bad_value_is_refused_by_name(bad):
    with pytest.raises(ValueError, match=r"LowBitAdamW.stochastic_rounding=.*True or False"):
        LowBitAdamW([nn.Parameter(torch.ones(2))], stochastic_rounding=bad)


def test_non_finite_updates_stay_non_finite():
    p = nn.Parameter(torch.ones(4, dtype=FP16))
    opt = LowBitAdamW([p], lr=1e-3)
    p.grad = torch.tensor([float("nan"), 1.0, 1.0, 1.0], dtype=FP16)
    opt.step()
    assert p[0].isnan() and torch.isfinite(p[1:]).all()
