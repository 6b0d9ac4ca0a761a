"""The FP8 gradient reducer's two passes over every byte (`requantize`, `mean_over_ranks`): on CUDA each runs
compiled as one kernel (`kernels.fused.cuda_fused`); here inductor's CPU code stands in for it and must give
the definition's bytes, inf and NaN included, over layers of many lengths with one graph for all of them.
The reducer's semantics across ranks are tested on two processes in test_grad_store_ddp.py and
tests/backends/test_msamp_comm.py; tests/gpu/test_fused_gpu.py checks the CUDA kernels.
"""

from __future__ import annotations

import pytest
import torch
from conftest import same_bytes

E4M3 = torch.float8_e4m3fn


def _e4m3(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, generator=g) * torch.exp2(torch.randint(-8, 8, (n,), generator=g).float())).clamp(-448, 448)
    q = x.to(E4M3)
    if n > 13:
        q.view(torch.uint8)[7] = 0x7F  # NaN (E4M3 has no inf: an overflow arrives as NaN)
        q[11] = 448.0
        q[13] = -448.0
    return q


def test_requantize_gives_the_definitions_bytes_for_every_layer_length_with_one_graph(fused_on_cpu):
    from torch._dynamo.utils import counters

    from lowprec.optim.grad_reduce import requantize

    graphs = counters["stats"]["unique_graphs"]
    ratios = torch.tensor([1.0, 0.25, 2.0**-9])  # the shared scale never exceeds the local one
    for i, n in enumerate([4096, 33, 1, 5000, 777, 128 * 96, 0, 4096]):
        data = _e4m3(n, i)
        for k in range(len(ratios)):
            for valid in (1.0, 0.0):
                args = (data, ratios[k], torch.tensor(valid))  # views of one tensor, as the reducer passes them
                got, want = requantize(*args), requantize.eager(*args)
                assert got.dtype == E4M3 and got.shape == (n,)
                assert same_bytes(got, want), (n, k, valid)
                if valid == 0.0:
                    assert not got.float().any()  # an absent gradient sends zeros, not stale bytes
    # compiled, and not once per length (dynamo specialises the lengths 0 and 1)
    assert 1 <= counters["stats"]["unique_graphs"] - graphs <= 3


@pytest.mark.parametrize("n", [2, 3, 4])
def test_the_mean_over_ranks_gives_the_definitions_bytes(fused_on_cpu, n):
    from lowprec.optim.grad_reduce import mean_over_ranks

    received = torch.stack([_e4m3(999, seed) for seed in range(n)]).view(torch.uint8)
    got, want = mean_over_ranks(received, 1.0 / n), mean_over_ranks.eager(received, 1.0 / n)
    assert got.dtype == E4M3 and got.shape == (999,)
    assert same_bytes(got, want)
    exact = received.view(E4M3).float().mean(0)
    finite = exact.isfinite()
    assert got.isnan()[7] and torch.equal(finite, ~got.isnan())  # a NaN from any rank stays NaN
    # one rounding of the FP32 mean: within half an E4M3 step (3 mantissa bits: 2**-4 relative)
    assert torch.all((got.float()[finite] - exact[finite]).abs() <= exact[finite].abs() * 2**-4 + 2**-10)
