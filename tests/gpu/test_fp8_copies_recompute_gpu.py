"""`LOWPREC_RECOMPUTE_FP8_COPIES=1` on a CUDA GPU: inductor's GPU partition of a compiled msamp O2 block with FP8
activations keeps fewer FP8 copies of activations for backward, none of the down projections', and the gradients stay
within one more E4M3 rounding of those with the copies kept (the CPU test's check,
tests/runtime/test_fp8_copies_recompute.py). Not every copy, as on CPU: on the GPU host (torch 2.11, aabeb3e) the
second block's gate/up input copies were kept, their way back reaching the first block's down-projection GEMM through
the residual add and the norm (the pass's DEBUG log, results/gpu/2026-11-28-h200x2-verify-aabeb3e). Run with
`pytest -m gpu` on a GPU host; skipped elsewhere."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "runtime"))
from test_fp8_copies_recompute import check_recompute  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
        reason="needs a Hopper (sm_90) or newer GPU",
    ),
]


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_a_compiled_block_on_the_gpu_recomputes_its_fp8_copies(monkeypatch, caplog):
    check_recompute(monkeypatch, caplog, every_copy=False)
