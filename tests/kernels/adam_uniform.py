"""The fused Adam step's random numbers (`lowprec.kernels.adam_triton.uniform`), drawn by the kernels' own code: run
by Triton's interpreter on the CPU as a script (tests/kernels/test_adam_kernels.py), or on a GPU.

`check(device)` returns, for N offsets under keys from several (step, position) seeds: each stream's mean and
variance (uniform on [0, 1): 1/2 and 1/12), its lag-1 correlation, the largest correlation between two streams
(other steps or other positions), whether every value lies in [0, 1), and how many distinct values a stream has.
"""

from __future__ import annotations

import json

import torch
import triton
import triton.language as tl

from lowprec.kernels.adam_triton import tensor_key, uniform

N = 1 << 14
SEEDS = [(1, 0), (2, 0), (3, 0), (1, 1), (1, 2), (1000, 17)]  # (step, position): neighbours in both


@triton.jit
def _draw(seeds, out, N: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.arange(0, N)
    tl.store(out + t * N + offs, uniform(tensor_key(tl.load(seeds + t)), offs))


def check(device: str) -> dict:
    from lowprec.kernels.rounding import rounding_seed

    seeds = torch.tensor([rounding_seed(step, pos) for step, pos in SEEDS], dtype=torch.int64, device=device)
    out = torch.empty(len(SEEDS), N, device=device)
    _draw[(len(SEEDS),)](seeds, out, N=N)
    u = out.double().cpu()
    centred = u - u.mean(dim=1, keepdim=True)
    corr = (centred @ centred.T) / (centred.norm(dim=1)[:, None] * centred.norm(dim=1)[None, :])
    lag1 = [float(torch.corrcoef(torch.stack([row[:-1], row[1:]]))[0, 1]) for row in u]
    return {
        "means": u.mean(dim=1).tolist(), "variances": u.var(dim=1).tolist(), "lag1": lag1,
        "max_cross_correlation": float((corr - torch.eye(len(SEEDS), dtype=corr.dtype)).abs().max()),
        "in_range": bool(((u >= 0) & (u < 1)).all()), "distinct": [len(row.unique()) for row in u], "n": N,
        # the numbers themselves, to compare a GPU's with the interpreter's (the same integer arithmetic)
        "head": u[:, :64].tolist(), "sums": u.sum(dim=1).tolist(),
    }


if __name__ == "__main__":
    print(json.dumps(check("cpu")))
