"""Fused multi-tensor Adam/AdamW step for low-precision states.

The math is `LowBitAdamW._reference_step`'s, for every parameter of a bucket (same dtypes, same
device) in one launch per pass, with no host synchronisation and no torch op between the passes.

A scaled state (FP16, E4M3, E5M2) needs its new scale before it can be written, and the scale
depends on the amax of the new state, so the update runs in two passes, as MS-AMP's `adamw.cu`
does. Pass 1 computes the new moments and writes one amax partial per chunk of `CHUNK` elements (a
single atomic target per tensor serialised the pass: 3.3x slower than torch's fused AdamW on the
d4096 proxy); a small reduction takes each tensor's max and copies its current scales aside,
because pass 2 overwrites them. Pass 2 turns each amax into its power-of-two scale (the rule of
`lowprec.kernels.scaling.compute_scale`, computed exactly from the float's bits), recomputes the moments,
and writes the parameter and the requantised moments. Pass 1 reads the parameter only for Adam's
L2 decay, where the moments depend on it. With unscaled states (FP32/BF16) pass 2 runs alone. The
gradient may itself be FP8 with a scale (the weight gradient of `FP8Linear`); it is dequantised in
registers, never materialised. An FP16 or BF16 parameter is written back with stochastic rounding
where the optimizer asks for it (`lowprec.kernels.rounding`), from a per-tensor seed of step and position.

Launching one kernel per tensor with the scale arithmetic in torch cost about twenty small ops per
tensor and left the FP8-state step 1.5x slower than torch's fused AdamW; this version is 0.96-0.97x
(results/gpu/2026-11-23-h100-optimizer-states-multitensor/).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

from .rounding import ROUNDED_DTYPES, rounding_seed, rounding_seeds
from .scaling import format_max

SCALED = (torch.float16, torch.float8_e4m3fn, torch.float8_e5m2)
# how the update kernel stores an infinite scaled moment (adam_triton.scaled_moment): as NaN (0), through the cast (1),
# as the format's inf bits (2)
INF_RULE = {torch.float8_e4m3fn: 0, torch.float16: 1, torch.float8_e5m2: 2}
BLOCK = 1024  # elements per loop iteration of a program (2048 measured 1.3-1.5x slower)
# elements per program: 8192 took msamp O2's step over the d4096 proxy's FP8 Linear weights from 8.4 to 6.6 ms
# (2048: each program's three dependent table loads before its first byte of data; scripts/gpu/adam_o2_step.py,
# results/gpu/2026-11-29-h200-adam-o2-step)
CHUNK = 8192
NUM_WARPS = 8
_kernels = None
_chunk_tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


@dataclass
class AdamItem:
    """One parameter's share of a fused step."""

    param: torch.Tensor
    grad: torch.Tensor
    grad_scale: torch.Tensor | None  # FP8 gradient: value = grad / grad_scale
    state: dict  # LowBitAdamW state, "step" already incremented
    # FP8 gradient store's presence flag (FP32 scalar on the device, > 0: the gradient arrived): where it
    # is 0, the kernels leave the parameter, its states and their scales as they were, and the step count
    # ("step", then a device tensor that `count_present_steps` advances) is not advanced either.
    valid: torch.Tensor | None = None
    ordinal: int = 0  # the parameter's position in its optimizer: with the step, its rounding seed


def _float_bits(value: float) -> tuple[int, int]:
    """(biased exponent, mantissa bits) of `value` as an FP32 number."""
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    return (bits >> 23) & 0xFF, bits & 0x7FFFFF


def _triton_dtype(dtype: torch.dtype):
    import triton.language as tl

    return {
        torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16,
        torch.float8_e4m3fn: tl.float8e4nv, torch.float8_e5m2: tl.float8e5,
    }[dtype]


def _get_kernels():
    global _kernels
    if _kernels is None:
        from . import adam_triton

        _kernels = adam_triton.amax_pass, adam_triton.reduce_pass, adam_triton.update_pass, adam_triton.scale_kernel
    return _kernels



def pow2_scale(amax: torch.Tensor, dtype: torch.dtype, previous: torch.Tensor) -> torch.Tensor:
    """The fused step's scale rule run as a kernel on a vector of amaxes (margin 0): tested against
    `lowprec.kernels.scaling.compute_scale`, which is its definition."""
    amax, previous = amax.float().contiguous(), previous.float().contiguous()
    out = torch.empty_like(amax)
    exp, mant = _float_bits(format_max(dtype))
    _get_kernels()[3][(triton_cdiv(amax.numel(), 1024),)](amax, previous, out, amax.numel(), MAX_EXP=exp,
                                                           MAX_MANT=mant, BLOCK=1024)
    return out


def _chunks(sizes: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(tensor index, chunk index) for every program, and where each tensor's chunks start; cached
    per bucket shape (shapes rarely change)."""
    key = (sizes, CHUNK, device)
    tables = _chunk_tables.get(key)
    if tables is None:
        counts = [triton_cdiv(n, CHUNK) for n in sizes]
        rows = [(t, k) for t, count in enumerate(counts) for k in range(count)]
        starts = [sum(counts[:t]) for t in range(len(counts) + 1)]
        tables = (_to_device(rows, torch.int32, device).reshape(-1, 2), _to_device(starts, torch.int32, device))
        if len(_chunk_tables) > 64:  # a process building many different models
            _chunk_tables.clear()
        _chunk_tables[key] = tables
    return tables


def _to_device(rows: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    host = torch.tensor(rows, dtype=dtype)
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)


def count_present_steps(items: list[AdamItem]) -> None:
    """Advance the device step count of every item whose gradient arrived (`valid` > 0), with no host
    sync: two launches for all of them."""
    flags = (torch.stack([item.valid for item in items]) > 0).to(torch.float32)
    torch._foreach_add_([item.state["step"] for item in items], list(flags.unbind(0)))


def _hyper_on_device(steps: torch.Tensor, lr: float, beta1: float, beta2: float) -> torch.Tensor:
    """The bias corrections of items whose step counts (`steps`) live on the device, computed there in FP64 as the
    host computes them for the others (a step count of 0, an item no gradient reached yet, is never used)."""
    steps = steps.double().clamp_(min=1)
    return torch.stack([lr / (1 - torch.pow(beta1, steps)), (1 - torch.pow(beta2, steps)).sqrt()], dim=1).float()


def fused_low_bit_adam_step(items: list[AdamItem], group: dict, *, decoupled: bool,
                            stochastic_rounding: bool = False) -> None:
    """One Adam(W) update, in place, of every parameter in `items` and of its states.

    All items share a device and the dtypes of parameter, gradient, gradient scale and states, and
    either all have a presence flag (`valid`, then a device step count) or none (`LowBitAdamW` buckets
    them); tensors are contiguous. Scales are updated in place. `stochastic_rounding` (FP16/BF16 parameters)
    writes each parameter rounded at random up or down, unbiased, instead of to nearest.
    """
    if not items:
        return
    amax_pass, reduce_pass, update_pass, _ = _get_kernels()
    first = items[0]
    device = first.param.device
    m_dtype, v_dtype = first.state["exp_avg"].dtype, first.state["exp_avg_sq"].dtype
    m_scaled, v_scaled = m_dtype in SCALED, v_dtype in SCALED
    g_scaled = first.grad_scale is not None
    g_valid = first.valid is not None
    beta1, beta2 = group["betas"]
    lr = float(group["lr"])
    rounds = stochastic_rounding and first.param.dtype in ROUNDED_DTYPES
    ptrs, sizes, hyper, seeds = [], [], [], []  # the kernels read 7 pointers per tensor in this order
    for item in items:
        state = item.state
        ptrs.append([
            item.param.data_ptr(), item.grad.data_ptr(), state["exp_avg"].data_ptr(), state["exp_avg_sq"].data_ptr(),
            item.grad_scale.data_ptr() if g_scaled else 0,
            state["exp_avg_scale"].data_ptr() if m_scaled else 0,
            state["exp_avg_sq_scale"].data_ptr() if v_scaled else 0,
        ])
        sizes.append(item.param.numel())
        if not g_valid:
            step = float(state["step"])
            hyper.append([lr / (1 - beta1**step), (1 - beta2**step) ** 0.5])
            seeds.append(rounding_seed(step, item.ordinal))
    aligned = all(ptr % 16 == 0 for row in ptrs for ptr in row[:4])  # views into flat buffers may not be
    ptr_table = _to_device(ptrs, torch.int64, device)
    size_table = _to_device(sizes, torch.int64, device)
    if g_valid:
        flags = [item.valid if item.valid.dtype == torch.float32 else item.valid.float() for item in items]
        valid_table = _to_device([flag.data_ptr() for flag in flags], torch.int64, device)
        steps = torch.stack([item.state["step"] for item in items])  # on the device: read there, no sync
        hyper_table = _hyper_on_device(steps, lr, beta1, beta2)
    else:
        valid_table = size_table  # not read (G_VALID=False)
        hyper_table = _to_device(hyper, torch.float32, device)
    seed_table = size_table  # not read without P_SR
    if rounds and g_valid:  # the step counts live on the device: the seeds are computed there, with no sync
        seed_table = rounding_seeds(steps, _to_device([item.ordinal for item in items], torch.int64, device))
    elif rounds:
        seed_table = _to_device(seeds, torch.int64, device)
    chunks, starts = _chunks(tuple(sizes), device)
    grid = (chunks.shape[0],)
    if not grid[0]:  # every tensor empty
        return
    types = dict(P_TY=_triton_dtype(first.param.dtype), G_TY=_triton_dtype(first.grad.dtype),
                 M_TY=_triton_dtype(m_dtype), V_TY=_triton_dtype(v_dtype),
                 G_SCALED=g_scaled, M_SCALED=m_scaled, V_SCALED=v_scaled,
                 DECOUPLED=decoupled, MAXIMIZE=bool(group["maximize"]), CHUNK=CHUNK, BLOCK=BLOCK,
                 ALIGNED=aligned, WIDE=max(sizes) + CHUNK + BLOCK >= 2**31, G_VALID=g_valid, num_warps=NUM_WARPS,
                 # No a*b+c contracted into an FMA: which product LLVM fuses depends on the specialisation (an FP8
                 # gradient's scaled value has more uses than a loaded FP32 one), and even on the vector lane, so
                 # a .grad and an FP8 store of the same gradient would round differently, as would the amax pass
                 # and the update pass that must agree on the moments. Memory-bound: the extra instructions are free.
                 enable_fp_fusion=False)
    scratch = torch.empty(len(items), 4, dtype=torch.float32, device=device)  # every row is written
    if m_scaled or v_scaled:
        partials = torch.empty(grid[0], 2, dtype=torch.float32, device=device)
        amax_pass[grid](ptr_table, size_table, chunks, valid_table, partials, beta1, beta2, group["weight_decay"],
                        **types)
        reduce_pass[(len(items),)](ptr_table, starts, partials, scratch, M_SCALED=m_scaled, V_SCALED=v_scaled,
                                   BLOCK=1024)
    m_exp, m_mant = _float_bits(format_max(m_dtype)) if m_scaled else (0, 0)
    v_exp, v_mant = _float_bits(format_max(v_dtype)) if v_scaled else (0, 0)
    update_pass[grid](ptr_table, size_table, chunks, valid_table, scratch, hyper_table, seed_table, lr, beta1, beta2,
                      group["eps"], group["weight_decay"], P_SR=rounds,
                      P_MAX=format_max(first.param.dtype) if rounds else 0.0,
                      M_MAX=format_max(m_dtype) if m_scaled else 0.0, M_MAX_EXP=m_exp, M_MAX_MANT=m_mant,
                      M_INF=INF_RULE.get(m_dtype, 1),
                      V_MAX=format_max(v_dtype) if v_scaled else 0.0, V_MAX_EXP=v_exp, V_MAX_MANT=v_mant,
                      V_INF=INF_RULE.get(v_dtype, 1),
                      **types)


def bucket_key(item: AdamItem) -> tuple:
    """Items with the same key can share one fused launch."""
    return (item.param.device, item.param.dtype, item.grad.dtype, item.grad_scale is not None,
            item.valid is not None, item.state["exp_avg"].dtype, item.state["exp_avg_sq"].dtype)


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b
