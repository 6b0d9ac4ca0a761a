"""`lowprec.kernels.cast.fp8_transpose`: an FP8 tensor's transpose, byte for byte `q.t().contiguous()`.

The Triton kernel runs here through Triton's interpreter (TRITON_INTERPRET=1, in a process of its own since the
variable is read when the kernel is defined); tests/kernels/test_kernels_compile.py compiles it for sm_90 and
tests/gpu/test_msamp_gpu.py runs it on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from lowprec.kernels.cast import _MAX_COLUMN_TILES, fp8_transpose

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]

INTERPRETED = """
import json, torch
from lowprec.kernels import cast
kernel = cast._build_transpose_kernel()
out = {}
for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
    for m, n in [(0, 5), (5, 0), (1, 1), (1, 70), (63, 65), (130, 70), (64, 128), (200, 3)]:
        q = torch.arange(m * n, dtype=torch.int64).remainder(256).to(torch.uint8).view(m, n).view(dtype)
        t = cast.launch_transpose(kernel, q)
        same = t.dtype == dtype and t.shape == (n, m) and torch.equal(t.view(torch.uint8), q.view(torch.uint8).t())
        out[f"{dtype}-{m}x{n}"] = bool(same)
print(json.dumps(out))
"""


def _every_byte(m: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """An m x n FP8 tensor cycling through all 256 bit patterns (NaNs and infinities included)."""
    return torch.arange(m * n).remainder(256).to(torch.uint8).view(m, n).view(dtype)


@pytest.mark.parametrize("dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("shape", [(0, 5), (1, 1), (37, 300), (300, 37)])
def test_off_the_gpu_it_is_torchs_transpose_byte_for_byte(dtype, shape):
    # the CPU path (what CPUs and emulation run): the kernel's own run is the interpreted test below
    q = _every_byte(*shape, dtype)
    t = fp8_transpose(q)
    assert t.dtype == dtype and t.shape == shape[::-1] and t.is_contiguous()
    assert torch.equal(t.view(torch.uint8), q.view(torch.uint8).t())


def test_a_strided_input_is_transposed_by_torch():
    q = _every_byte(40, 24, torch.float8_e4m3fn).t()  # not contiguous: the kernel reads row-major tensors only
    assert torch.equal(fp8_transpose(q).view(torch.uint8), q.view(torch.uint8).t())


def test_the_kernel_interpreted_moves_every_byte_to_its_transposed_place():
    pytest.importorskip("triton")
    from conftest import run_interpreted

    results = run_interpreted("-c", INTERPRETED)
    assert len(results) == 16 and all(results.values()), results


def test_a_tensor_wider_than_the_kernels_grid_goes_to_torch(monkeypatch):
    # CUDA caps a grid's second dimension (the column tiles) at 65535: wider tensors are torch's to transpose
    from lowprec.kernels import cast

    launched = []
    monkeypatch.setattr(cast, "launch_transpose", lambda kernel, q: launched.append(q.shape))
    monkeypatch.setattr(cast, "_transpose_kernel", object())
    monkeypatch.setattr(cast, "triton_available", lambda: True)

    class Wide:  # what the dispatch reads of a CUDA tensor, without one
        is_cuda, dtype = True, torch.float8_e4m3fn

        def __init__(self, n):
            self.shape = (2, n)

        def dim(self):
            return 2

        def element_size(self):
            return 1

        def is_contiguous(self):
            return True

        def t(self):
            return self

        def contiguous(self):
            return "torch"

    assert fp8_transpose(Wide(64 * _MAX_COLUMN_TILES)) is None and launched == [(2, 64 * _MAX_COLUMN_TILES)]
    assert fp8_transpose(Wide(64 * _MAX_COLUMN_TILES + 1)) == "torch" and len(launched) == 1
