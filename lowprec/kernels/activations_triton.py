"""Triton kernels of the FP8 storage of saved activations (see `lowprec.kernels.activations`, which launches them
and holds their plain-torch definitions `_encode` / `_decode`).

Imported only on a CUDA host with Triton. Each program takes BLOCK_R rows of one group of `size` columns: the
group's amax, scale and cast stay in registers, so the encode reads the tensor once and writes its bytes and
exponents once (inductor's code for the same function, compiled with dynamic shapes, ran several times slower on
an H200: results/gpu, `benchmarks/activation_codec.py`).
"""

import triton
import triton.language as tl

from .adam_triton import pow2_scale_bits


@triton.jit
def encode_kernel(x_ptr, data_ptr, exp_ptr, R, L, G, size, stride_r, stride_c,
                  FP8_MAX: tl.constexpr, MAX_EXP: tl.constexpr, MAX_MANT: tl.constexpr, MIN_SCALE: tl.constexpr,
                  BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    g = tl.program_id(1)
    within = tl.arange(0, BLOCK_G)
    col = g * size + within
    rows64 = rows.to(tl.int64)
    in_group = (rows[:, None] < R) & (within[None, :] < size)
    # columns past the last one are the zero padding of the last group (stored as zero bytes)
    x = tl.load(x_ptr + rows64[:, None] * stride_r + col[None, :].to(tl.int64) * stride_c,
                mask=in_group & (col[None, :] < L), other=0.0).to(tl.float32)
    # the amax of the finite values only (NaN < inf is false): a non-finite element stays NaN below, and the rest of
    # its group keeps a scale fitted to them
    magnitude = tl.abs(x)
    amax = tl.max(tl.where(magnitude < float("inf"), magnitude, 0.0), axis=1)
    scale = pow2_scale_bits(amax, 1.0, MAX_EXP, MAX_MANT)  # an all-zero group: scale 1, as compute_scale
    # BF16/FP32 tensors: at least 2**MIN_EXPONENT, so that their decode needs no clamp (activations.MIN_EXPONENT)
    scale = tl.maximum(scale, MIN_SCALE)
    # scaling.quantize: saturate finite values (clamp keeps NaN), inf -> NaN
    y = tl.clamp(x * scale[:, None], -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    y = tl.where(magnitude == float("inf"), float("nan"), y)
    tl.store(data_ptr + rows64[:, None] * G * size + col[None, :], y.to(tl.float8e4nv), mask=in_group)
    exponent = ((scale.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    tl.store(exp_ptr + rows64 * G + g, exponent.to(tl.int8), mask=rows < R)


@triton.jit
def decode_kernel(data_ptr, exp_ptr, out_ptr, R, L, G, size, LIMIT: tl.constexpr,
                  BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    g = tl.program_id(1)
    within = tl.arange(0, BLOCK_G)
    col = g * size + within
    rows64 = rows.to(tl.int64)
    in_group = (rows[:, None] < R) & (within[None, :] < size)
    exponent = tl.load(exp_ptr + rows64 * G + g, mask=rows < R, other=0).to(tl.int32)
    # 2**-exponent from its bits, exactly (the exponent is in [-126, 126], so the result is a normal FP32 number)
    inverse = ((127 - exponent) << 23).to(tl.float32, bitcast=True)
    q = tl.load(data_ptr + rows64[:, None] * G * size + col[None, :], mask=in_group, other=0.0).to(tl.float32)
    # a finite value comes back finite in the output's dtype; NaN goes through the clamp unchanged
    v = tl.clamp(q * inverse[:, None], -LIMIT, LIMIT, propagate_nan=tl.PropagateNan.ALL)
    tl.store(out_ptr + rows64[:, None] * L + col[None, :], v.to(out_ptr.dtype.element_ty),
             mask=in_group & (col[None, :] < L))
