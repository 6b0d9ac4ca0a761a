"""FP8 storage of a tensor autograd saves for backward: E4M3 with one power-of-2 scale per 1x128 group.

COAT and DeepSeek-V3 keep saved activations in FP8 with fine-grained scales: one scale per group of 128
consecutive elements along the last dimension (the hidden dimension of a transformer activation), so an
outlier only costs precision to the 127 values beside it, not to the whole tensor. A last dimension
shorter than 128 gets one scale per row; one that is not a multiple of 128 is zero-padded.

Each scale is a power of two (`scaling.compute_scale`): decoding multiplies by it exactly, and it is stored
as its int8 exponent (1 byte per group, as MX's E8M0 does), so the packed tensor is 1 + 1/128 bytes per
element. `quantize` turns inf into NaN and keeps NaN, so a non-finite value decodes as NaN: an overflow in
the forward pass stays visible to the backward pass. The scales come from the finite values of each group
only, so one NaN does not take the precision of its neighbours with it.

Error bound per element (round to nearest in E4M3; the decode multiplies by a power of two, exact):
with s = 2**k the group's scale (the largest power of two with amax * s <= 448, so nothing saturates)
and y = x * s,
  |y| >= 2**-6 (E4M3 normal): 3 mantissa bits, half an ulp is <= 2**-4 * |y|;
  |y| <  2**-6 (subnormal):   steps of 2**-9, error <= 2**-10;
so |decode(x) - x| <= 2**-4 * |x| + 2**-10 / s, and since amax * s > 224 (the next power of two would pass
448) unless the scale is capped at 2**126, 2**-10 / s < amax_group * 2**-10 / 224. Decoding to BF16 or FP32
adds nothing (an E4M3 value times a power of two has 4 significant bits); FP16 may round once more below its
normal range (2**-14).

A finite value comes back finite. For BF16, FP32 and FP64 tensors the encode keeps each scale at least 2**-119
(`MIN_EXPONENT`): no decoded value can pass 448 * 2**119 = 2.98e38, within their range, so the decode needs no
clamp; an element above 2.98e38 (the top 12% of BF16's range) saturates there, an error of at most 12%. Inside a
compiled backward the decode is inlined into every kernel that reads the tensor, and a clamp there is four more
ops for each: with it, SiLU's backward over both halves of a fused gate/up output passed inductor's limit of 30 ops
and was stored as an FP32 block of the step's peak (0.44 GiB at d4096, results/gpu/2026-11-28-h200-act8-peak-
05e9f2d; inductor's GPU rules on CPU show it gone without the clamp). FP16, whose top 12% is 57344..65504, keeps
every scale and clamps on decode (E4M3's rounding steps 65504 at scale 2**-8 up to 65536).
"""

from __future__ import annotations

import struct
import weakref
from typing import NamedTuple

import torch

from . import triton_available
from .fused import cuda_fused, fp8_codegen
from .scaling import compute_scale, format_max, quantize

GROUP = 128
FP8_DTYPE = torch.float8_e4m3fn
# the smallest scale exponent of a tensor whose largest finite value is at least 448 * 2**119 (module docstring)
MIN_EXPONENT = -119


def floors_scale(dtype: torch.dtype) -> bool:
    """Whether `dtype`'s tensors are encoded with scales of at least 2**MIN_EXPONENT (and decoded without a clamp):
    BF16, FP32, FP64; not FP16."""
    return torch.finfo(dtype).max >= format_max(FP8_DTYPE) * 2.0 ** -MIN_EXPONENT


class SpanKey:
    """Names one storage whose strided views a forward saved (the q, k and v slices of a fused QKV output, the
    two halves of a fused gate/up output): decoded, those views share one buffer of the storage's length,
    each at its own offset, as they shared memory when saved. Without it each view would get a buffer spanning
    its strides: three times the slice for q, k or v."""

    __slots__ = ("__weakref__",)


# key -> the buffer its views are decoded into, while any of them is alive (a view holds its base)
_SPANS: weakref.WeakValueDictionary[SpanKey, torch.Tensor] = weakref.WeakValueDictionary()


class PackedFP8(NamedTuple):
    """A tensor stored as E4M3 groups: `data` (rows, groups, group) FP8, `exponent` (rows, groups) int8
    with scale = 2**exponent, and what restores it (shape, dtype, the last dimension before padding)."""

    data: torch.Tensor
    exponent: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    last: int
    # the strides of a tensor that was not contiguous (a slice of a fused projection's output, a transpose),
    # restored on decode: a compiled backward checks the strides of what it saved
    stride: tuple[int, ...] | None = None
    # where such a view sat in its memory, for views of one storage to come back in one buffer: (the key
    # shared by the views of that storage, the view's storage offset, the storage's length), or None
    span: tuple[SpanKey, int, int] | None = None

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.exponent.numel()


def group_size(last: int) -> int:
    """128, or the whole row where the last dimension is shorter."""
    return min(GROUP, last)


def pack_fp8(tensor: torch.Tensor, span: SpanKey | None = None) -> PackedFP8:
    """`tensor` (floating point, at least 1-D, not empty) as E4M3 with a power-of-2 scale per group. `span`:
    the key of the tensor's storage where the caller packs several strided views of it (see `SpanKey`)."""
    if not tensor.is_floating_point() or tensor.dim() == 0 or tensor.numel() == 0:
        raise ValueError(f"pack_fp8 takes a non-empty floating tensor of at least 1 dimension, got "
                         f"{tensor.dtype} of shape {tuple(tensor.shape)}")
    if overlapping(tensor):
        raise ValueError(f"pack_fp8 takes a tensor whose elements have memory of their own, got strides "
                         f"{tensor.stride()} for shape {tuple(tensor.shape)} (an expanded view)")
    x = tensor.detach()
    last = x.shape[-1]
    data, exponent = encode_rows(x.reshape(-1, last), group_size(last))
    if x.is_contiguous():
        return PackedFP8(data, exponent, x.shape, x.dtype, last)
    where = None
    if span is not None:
        where = (span, x.storage_offset(), x.untyped_storage().nbytes() // x.element_size())
    return PackedFP8(data, exponent, x.shape, x.dtype, last, x.stride(), where)


def unpack_fp8(packed: PackedFP8) -> torch.Tensor:
    """The tensor `pack_fp8` stored, in its dtype, shape and strides (within the bound in the module
    docstring)."""
    values = decode_rows(packed.data, packed.exponent, packed.last, packed.dtype).reshape(packed.shape)
    if packed.stride is None:
        return values
    if packed.span is None:
        out = torch.empty_strided(packed.shape, packed.stride, dtype=packed.dtype, device=values.device)
    else:
        key, offset, length = packed.span
        buffer = _SPANS.get(key)
        if buffer is None:
            buffer = _SPANS[key] = torch.empty(length, dtype=packed.dtype, device=values.device)
        out = buffer.as_strided(packed.shape, packed.stride, offset)
    return out.copy_(values)


def groups_fit(tensor: torch.Tensor) -> bool:
    """Whether the last dimension splits into whole groups (a multiple of 128, or a single group of at most 128):
    `pack_traced_fp8` takes no other. Padding a group inside a compiled graph gave wrong values on CPU: inductor's
    code for the decode wrote only the first 128 columns of a row of 200 (torch 2.13)."""
    last = tensor.shape[-1]
    return bool(last <= GROUP or last % GROUP == 0)


def pack_traced_fp8(tensor: torch.Tensor) -> tuple:
    """`pack_fp8` for a graph being compiled (the saved-tensor hooks torch inlines into a compiled forward), the
    same groups along the last dimension; a strided view is read as it lies (the gather fuses into the encode).
    Returns tensors and constants only: (data, exponent, shape, dtype), for `unpack_traced_fp8`. The definitions
    are `pack_fp8`'s, traced into the graph; the caller checks `groups_fit` first."""
    last = tensor.shape[-1]
    data, exponent = _encode.eager(tensor.reshape(-1, last), group_size(last))
    return data, exponent, tuple(tensor.shape), tensor.dtype


def unpack_traced_fp8(packed: tuple) -> torch.Tensor:
    """The tensor `pack_traced_fp8` stored, in its dtype and shape (not its strides: a compiled backward takes the
    layout its graph computes)."""
    data, exponent, shape, dtype = packed
    return _decode.eager(data, exponent, shape[-1], dtype).reshape(shape)


def overlapping(tensor: torch.Tensor) -> bool:
    """Whether two elements of `tensor` may share memory (an expanded or otherwise overlapping view):
    sorted by stride, each dimension of more than one element must step past the whole of the ones
    below it (a sufficient test: views it calls overlapping are left unpacked)."""
    dims = sorted((st, size) for st, size in zip(tensor.stride(), tensor.shape) if size > 1)
    extent = 1
    for st, size in dims:
        if st < extent:
            return True
        extent = st * (size - 1) + extent
    return False


# The definitions of the encode and the decode. On CUDA an eager call runs the Triton kernels below
# (`encode_rows`, `decode_rows`), or where they do not apply one inductor kernel each way (`cuda_fused`): as eager
# torch the encode is ten kernels over FP32 temporaries for every tensor a forward saves.
@cuda_fused
def _encode(rows: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, last) -> E4M3 groups (rows, groups, size) and their scales' int8 exponents (rows, groups)."""
    floor = floors_scale(rows.dtype)
    rows = rows.float()
    pad = -rows.shape[-1] % size
    if pad:
        rows = torch.nn.functional.pad(rows, (0, pad))
    groups = rows.reshape(rows.shape[0], -1, size)
    # amax of the finite values only: a NaN or inf element is kept non-finite by `quantize` anyway, and the
    # rest of its group keeps a scale fitted to them (a non-finite amax would fall back to scale 1)
    finite = torch.where(torch.isfinite(groups), groups, torch.zeros((), dtype=groups.dtype, device=groups.device))
    amax = finite.abs().amax(dim=-1)
    scale = compute_scale(amax, FP8_DTYPE)
    if floor:
        scale = torch.clamp_min(scale, 2.0**MIN_EXPONENT)
    data = quantize(groups, scale.unsqueeze(-1), FP8_DTYPE)
    # the scale is an exact power of two in [2**-127, 2**126]: its exponent fits int8
    exponent = torch.log2(scale).round().to(torch.int8)
    return data, exponent


@cuda_fused
def _decode(data: torch.Tensor, exponent: torch.Tensor, last: int, dtype: torch.dtype) -> torch.Tensor:
    """E4M3 groups and exponents -> (rows, last) in `dtype`."""
    inverse = torch.exp2(-exponent.float()).unsqueeze(-1)
    rows = (data.float() * inverse).reshape(data.shape[0], -1)[:, :last]
    if floors_scale(dtype):  # its scales keep every decoded value in range (module docstring): no clamp
        return rows.to(dtype)
    # E4M3's rounding can step a group's largest value up past FP16's maximum (64000 -> 65536): a finite value must
    # come back finite. NaN (E4M3 holds inf as NaN) goes through a clamp unchanged.
    limit = torch.finfo(dtype).max
    return rows.clamp(-limit, limit).to(dtype)


# The dtypes the Triton kernels read and write (others go to `_encode` / `_decode`), and CUDA's limit on a grid's
# second dimension (the groups of a row)
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MAX_GROUPS = 65535
_BLOCK_R = 32
_kernels = None


def _triton_kernels():
    global _kernels
    if _kernels is None:
        from . import activations_triton

        _kernels = activations_triton.encode_kernel, activations_triton.decode_kernel
    return _kernels


def _kernel_applies(tensor: torch.Tensor, groups: int, dtype: torch.dtype) -> bool:
    # is_compiling first: a graph being traced writes its own kernels (and dynamo would trace the caches below)
    return (not torch.compiler.is_compiling() and tensor.is_cuda and dtype in _KERNEL_DTYPES and groups <= _MAX_GROUPS
            and triton_available() and fp8_codegen(tensor.device.index or 0))


def encode_rows(rows: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`_encode(rows, size)` (byte for byte): one Triton kernel on a GPU with FP8 code generation."""
    groups = -(-rows.shape[-1] // size)
    if not _kernel_applies(rows, groups, rows.dtype):
        return _encode(rows, size)
    return launch_encode(_triton_kernels()[0], rows, size)


def decode_rows(data: torch.Tensor, exponent: torch.Tensor, last: int, dtype: torch.dtype) -> torch.Tensor:
    """`_decode(data, exponent, last, dtype)` (bit for bit): one Triton kernel on a GPU with FP8 code generation."""
    if not _kernel_applies(data, data.shape[1], dtype):
        return _decode(data, exponent, last, dtype)
    return launch_decode(_triton_kernels()[1], data, exponent, last, dtype)


def launch_encode(kernel, rows: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`encode_rows`' launch of `kernel` on a 2-D tensor (any strides; tests/kernels/sm90_compile.py records it on the
    CPU). A row of 0 elements is refused by `pack_fp8` before it comes here."""
    count, last = rows.shape
    groups = -(-last // size)
    data = torch.empty((count, groups, size), dtype=FP8_DTYPE, device=rows.device)
    exponent = torch.empty((count, groups), dtype=torch.int8, device=rows.device)
    if count:
        bits = struct.unpack("<I", struct.pack("<f", format_max(FP8_DTYPE)))[0]
        kernel[(-(-count // _BLOCK_R), groups)](
            rows, data, exponent, count, last, groups, size, rows.stride(0), rows.stride(1),
            FP8_MAX=format_max(FP8_DTYPE), MAX_EXP=(bits >> 23) & 0xFF, MAX_MANT=bits & 0x7FFFFF,
            MIN_SCALE=2.0**MIN_EXPONENT if floors_scale(rows.dtype) else 0.0,
            BLOCK_R=_BLOCK_R, BLOCK_G=_block(size), num_warps=4)
    return data, exponent


def launch_decode(kernel, data: torch.Tensor, exponent: torch.Tensor, last: int, dtype: torch.dtype) -> torch.Tensor:
    """`decode_rows`' launch of `kernel` (tests/kernels/sm90_compile.py records it on the CPU)."""
    count, groups, size = data.shape
    out = torch.empty((count, last), dtype=dtype, device=data.device)
    if count:
        kernel[(-(-count // _BLOCK_R), groups)](
            data, exponent, out, count, last, groups, size, LIMIT=torch.finfo(dtype).max,
            BLOCK_R=_BLOCK_R, BLOCK_G=_block(size), num_warps=4)
    return out


def _block(size: int) -> int:
    """The power of two a group of `size` columns (at most 128) is loaded as."""
    return 1 << max(size - 1, 0).bit_length()
