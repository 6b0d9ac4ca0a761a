"""Stochastic rounding of an FP32 update into an FP16 or BF16 parameter.

MS-AMP's levels keep no FP32 master weight: the optimizer updates the FP16 weight itself. Rounded to
nearest, an update below half an FP16 step of the weight is lost, and late in training, when the learning
rate has decayed, most of them are (FP16's step at |w| = 0.02 is 1.5e-5; AdamW's update at lr 1.5e-5 is
about that or less). Rounded stochastically, up to the next value away from zero with probability
(x - down) / (up - down), the stored weight is the FP32 one in expectation, and small updates add up.

`stochastic_round` is the definition; `lowprec.kernels.adam_triton.stochastic_round` is the fused step's
form of it (a different random stream, the same distribution). The random numbers come from a seed that
`rounding_seed` derives from the step count and the parameter's position in the optimizer, never from
the process's RNG: replicas of a parameter (DDP) round identically on every rank, a resumed run rounds as
the uninterrupted one did, and no other random stream of the program moves.
"""

from __future__ import annotations

import torch

ROUNDED_DTYPES = (torch.float16, torch.bfloat16)


def rounding_seed(step: int, ordinal: int) -> int:
    """The seed of one parameter's rounding at one step: step and position, each in 32 bits of an int64."""
    return ((int(step) & 0x7FFFFFFF) << 32) | (int(ordinal) & 0xFFFFFFFF)


def rounding_seeds(steps: torch.Tensor, ordinals: torch.Tensor) -> torch.Tensor:
    """`rounding_seed` of step counts kept on the device (FP32, exact to 2**24), with no host sync."""
    return ((steps.to(torch.int64) & 0x7FFFFFFF) << 32) | (ordinals.to(torch.int64) & 0xFFFFFFFF)


def rounding_generator(seed: int, device: torch.device | str | None = None) -> torch.Generator:
    """A torch generator for a rounding seed. The CPU's Mersenne twister keeps 32 bits of its seed, where the step
    and the position would collide: the seed is mixed first (splitmix64's finaliser)."""
    mask = 2**64 - 1
    z = (seed + 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return torch.Generator(device=device).manual_seed(z ^ (z >> 31))


def stochastic_round(x: torch.Tensor, dtype: torch.dtype, generator: torch.Generator | None = None) -> torch.Tensor:
    """`x` (FP32) in `dtype` (FP16 or BF16), rounded down or up at random so that the result's expectation is `x`.

    Values beyond `dtype`'s largest finite one, inf and NaN are rounded to nearest as a cast would: a
    non-finite value stays non-finite, and no finite value is rounded up to inf at random.
    """
    if dtype not in ROUNDED_DTYPES:
        raise ValueError(f"stochastic_round: dtype={dtype} is not one of torch.float16, torch.bfloat16")
    x = x.float()
    nearest = x.to(dtype)
    # toward zero: the nearest value, or its neighbour toward zero where rounding went away from it
    overshot = nearest.float().abs() > x.abs()
    down = torch.where(overshot, torch.nextafter(nearest, torch.zeros_like(nearest)), nearest)
    up = torch.nextafter(down, torch.where(x < 0, -torch.inf, torch.inf).to(dtype))
    frac = (x - down.float()) / (up.float() - down.float())
    u = torch.rand(x.shape, generator=generator, device=x.device)
    rounded = torch.where(u < frac, up, down)
    return torch.where(x.abs() <= torch.finfo(dtype).max, rounded, nearest)
