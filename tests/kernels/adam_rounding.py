"""The fused Adam step's stochastic rounding of FP16/BF16 parameters (the kernels' own code, run by Triton's
interpreter on the CPU as a script, or on a GPU by tests/gpu/test_msamp_gpu.py).

`check(device)` returns, per parameter dtype:
- `neighbours`: after one step, every element is one of the two values of its format around the FP32 result of
  the same kernels on an FP32 copy of the parameter (FP32 states: both runs compute the same update);
- `mean_error` / `sigma`: after `STEPS` steps of a constant gradient, each below half a step of the format at
  1.0 (so rounding to nearest loses them all), the mean of the parameter against 1 - STEPS * lr, and the
  standard deviation of that mean under unbiased rounding;
- `nearest_moved`: whether the same steps rounded to nearest moved any element (they must not).
"""

from __future__ import annotations

import json

import torch

STEPS = 12
LR = {torch.float16: 1e-4, torch.bfloat16: 1e-3}
STEP_AT_ONE = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}  # the format's spacing just below 1.0


def _optimizer(params, lr, stochastic_rounding, device):
    from lowprec.optim import LowBitAdamW

    opt = LowBitAdamW(params, lr=lr, weight_decay=0.0, fused=True, stochastic_rounding=stochastic_rounding)
    if device == "cpu":  # the kernels run on the CPU only under TRITON_INTERPRET=1
        opt._use_fused = lambda p, grad, group: True
    return opt


def _neighbours(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    nearest = x.to(dtype)
    down = torch.where(nearest.float().abs() > x.abs(), torch.nextafter(nearest, torch.zeros_like(nearest)), nearest)
    return down, torch.nextafter(down, torch.where(x < 0, -torch.inf, torch.inf).to(dtype))


def check(device: str, n: int = 4096) -> dict:
    out = {}
    for dtype in (torch.float16, torch.bfloat16):
        torch.manual_seed(0)
        w = (torch.randn(n, device=device) * 0.05).to(dtype)
        g = torch.randn(n, device=device)
        low, wide = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.float())
        for p in (low, wide):
            opt = _optimizer([p], 1e-3, True, device)
            p.grad = g.to(p.dtype)
            opt.step()
        down, up = _neighbours(wide.detach(), dtype)
        neighbours = bool(((low == down) | (low == up)).all())
        both = bool((low == down).any() and (low == up).any() and (down != up).all())
        means = {}
        for flag in (True, False):
            p = torch.nn.Parameter(torch.ones(n, dtype=dtype, device=device))
            opt = _optimizer([p], LR[dtype], flag, device)
            for _ in range(STEPS):
                p.grad = torch.ones_like(p)
                opt.step()
            means[flag] = p.detach().double()
        exact = 1.0 - STEPS * LR[dtype]
        out[str(dtype).split(".")[-1]] = {
            "neighbours": neighbours, "both_ways": both,
            "mean_error": means[True].mean().item() - exact,
            "sigma": (STEPS * STEP_AT_ONE[dtype] ** 2 / 4 / n) ** 0.5,
            "nearest_moved": bool((means[False] != 1.0).any()),
        }
    return out


if __name__ == "__main__":
    print(json.dumps(check("cpu")))
