"""Scaled FP8 cast of a 2-D tensor, optionally with its transpose, recording the input's amax; and the
transpose of an FP8 tensor on its own (`fp8_transpose`).

One Triton kernel on CUDA reads the input (each tile twice, the second time mostly from L2) and
writes the FP8 tensor, its transpose (both row-major, as `torch._scaled_mm` needs them for the
three GEMMs of a linear layer) and the amax (atomic max into a float32 scalar the caller zeroed). The
torch function below is the definition it is tested against, and what CPUs run. NaN inputs record an
amax of +inf, so the scale rule keeps the previous scale (a NaN never becomes a scale).
"""

from __future__ import annotations

import torch

from . import triton_available
from .scaling import format_max, quantize


def cast_transpose_reference(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, amax_out: torch.Tensor,
                             transpose: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    absolute = x.detach().abs().float()
    absolute = torch.where(torch.isnan(absolute), torch.full_like(absolute, float("inf")), absolute)
    if absolute.numel():
        torch.maximum(amax_out, absolute.amax(), out=amax_out)
    q = quantize(x, scale, fp8_dtype)
    return q, (q.t().contiguous() if transpose else None)


_kernel = None
_transpose_kernel = None


def _build_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def cast_transpose_kernel(x_ptr, q_ptr, qt_ptr, amax_ptr, scale_ptr, M, N, stride_m, stride_n,
                              FP8_MAX: tl.constexpr, FP8_E4M3: tl.constexpr, WRITE_T: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        x = tl.load(x_ptr + rm[:, None] * stride_m + rn[None, :] * stride_n, mask=mask, other=0.0).to(tl.float32)
        absolute = tl.where(x == x, tl.abs(x), float("inf"))
        tl.atomic_max(amax_ptr, tl.max(tl.max(absolute, axis=1), axis=0))
        scale = tl.load(scale_ptr)
        # saturate like torch.clamp, which keeps a NaN (PTX min/max would turn it into the bound); an inf
        # input becomes NaN, as in scaling.quantize, so an overflow never comes out as a finite +-max
        y = tl.clamp(x * scale, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
        y = tl.where(tl.abs(x) == float("inf"), float("nan"), y)
        q_type = tl.float8e4nv if FP8_E4M3 else tl.float8e5
        tl.store(q_ptr + rm[:, None] * N + rn[None, :], y.to(q_type), mask=mask)
        if WRITE_T:
            # The transposed tile is loaded again (from L2) in transposed order rather than made with
            # tl.trans: on Triton 3.6 / sm_90, tl.trans of this tile gave wrong values for FP32 inputs.
            mask_t = (rn[:, None] < N) & (rm[None, :] < M)
            xt = tl.load(x_ptr + rm[None, :] * stride_m + rn[:, None] * stride_n, mask=mask_t, other=0.0)
            xt = xt.to(tl.float32)
            yt = tl.clamp(xt * scale, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
            yt = tl.where(tl.abs(xt) == float("inf"), float("nan"), yt)
            tl.store(qt_ptr + rn[:, None] * M + rm[None, :], yt.to(q_type), mask=mask_t)

    return cast_transpose_kernel


def cast_transpose(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, amax_out: torch.Tensor,
                   transpose: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(x * scale) as `fp8_dtype`, its transpose if asked, and `amax_out = max(amax_out, |x|.max())`.

    Args:
        x: 2-D tensor (any float dtype, any strides).
        scale: float32 scalar tensor on x's device.
        amax_out: float32 scalar tensor updated in place.
    """
    if x.dim() != 2:
        raise ValueError(f"cast_transpose expects a 2-D tensor, got shape {tuple(x.shape)}")
    if x.device.type != "cuda" or not triton_available() or fp8_dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        return cast_transpose_reference(x, scale, fp8_dtype, amax_out, transpose)
    global _kernel
    if _kernel is None:
        _kernel = _build_kernel()
    return launch_cast_transpose(_kernel, x, scale, fp8_dtype, amax_out, transpose)


def launch_cast_transpose(kernel, x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype,
                          amax_out: torch.Tensor, transpose: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`cast_transpose`'s launch of `kernel` (tests/kernels/sm90_compile.py records it on the CPU)."""
    m, n = x.shape
    q = torch.empty((m, n), dtype=fp8_dtype, device=x.device)
    qt = torch.empty((n, m), dtype=fp8_dtype, device=x.device) if transpose else q
    block_m, block_n = 64, 64
    grid = ((m + block_m - 1) // block_m, (n + block_n - 1) // block_n)
    if m and n:
        kernel[grid](x, q, qt, amax_out, scale, m, n, x.stride(0), x.stride(1),
                     FP8_MAX=format_max(fp8_dtype), FP8_E4M3=fp8_dtype == torch.float8_e4m3fn, WRITE_T=transpose,
                     BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4)
    return q, (qt if transpose else None)


def _build_transpose_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def transpose_kernel(x_ptr, y_ptr, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        # The tile is read in transposed order, as cast_transpose_kernel's second read, not made with tl.trans:
        # Triton coalesces the load and the store each in its own layout and converts between them in shared
        # memory. Offsets in int64: a weight of 2**31 bytes is within reach.
        mask = (rn[:, None] < N) & (rm[None, :] < M)
        tile = tl.load(x_ptr + rm[None, :].to(tl.int64) * N + rn[:, None], mask=mask)
        tl.store(y_ptr + rn[:, None].to(tl.int64) * M + rm[None, :], tile, mask=mask)

    return transpose_kernel


# CUDA's limit on a grid's second dimension: the kernel's column tiles
_MAX_COLUMN_TILES = 65535


def fp8_transpose(q: torch.Tensor) -> torch.Tensor:
    """`q.t().contiguous()` for a contiguous 2-D FP8 tensor: one tiled Triton kernel on CUDA, torch's copy elsewhere.
    torch's copy of a transposed 1-byte tensor moves ~300 GB/s on an H200, the kernel ~1.5-1.7 TB/s at the d4096
    proxy's larger weights (results/gpu/2026-11-27-h200x2-transpose-1b34f04/fp8_transpose.json): O3 under FSDP2
    transposes each gathered weight for the backward."""
    # under torch.compile Inductor writes the transpose itself (is_compiling first: dynamo would trace the
    # lru_cache of triton_available)
    if torch.compiler.is_compiling() or not (q.is_cuda and q.dim() == 2 and q.element_size() == 1
                                             and q.is_contiguous() and triton_available()
                                             and -(-q.shape[1] // 64) <= _MAX_COLUMN_TILES):
        return q.t().contiguous()
    global _transpose_kernel
    if _transpose_kernel is None:
        _transpose_kernel = _build_transpose_kernel()
    return launch_transpose(_transpose_kernel, q)


def launch_transpose(kernel, q: torch.Tensor) -> torch.Tensor:
    """`fp8_transpose`'s launch of `kernel` on a contiguous 2-D tensor of 1-byte elements (tests/kernels/sm90_compile.py
    records it on the CPU). Both FP8 formats go through one specialisation, as bytes."""
    m, n = q.shape
    out = torch.empty((n, m), dtype=q.dtype, device=q.device)
    block = 64
    if m and n:
        grid = ((m + block - 1) // block, (n + block - 1) // block)
        kernel[grid](q.view(torch.uint8), out.view(torch.uint8), m, n, BLOCK_M=block, BLOCK_N=block, num_warps=4)
    return out
