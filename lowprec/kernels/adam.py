"""Fused Adam/AdamW step for low-precision states (one parameter tensor per launch pair).

The math is `LowBitAdamW._reference_step`'s. A scaled state (FP16, E4M3, E5M2) needs its new scale
before it can be written, and the scale depends on the amax of the new state, so the update runs in
two passes, as MS-AMP's `adamw.cu` does: pass 1 computes the new moments and each block's amax
(one partial per block, reduced afterwards: a single atomic target for ~10^5 blocks serialised the
pass and made the step 3.3x slower than torch's fused AdamW on the d4096 proxy), pass 2 recomputes
them, writes the parameter and the requantised moments. Pass 1 reads the parameter only for Adam's
L2 decay, where the moments depend on it.
With unscaled states (FP32/BF16, level O1) pass 2 alone runs. The gradient may itself be FP8 with
a scale (the weight gradient of `FP8Linear`); it is dequantised in registers, never materialised.
"""

from __future__ import annotations

import torch

from ..scaling import compute_scale, format_max

_SCALED = (torch.float16, torch.float8_e4m3fn, torch.float8_e5m2)
_kernel = None
BLOCK = 2048


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def adam_kernel(p_ptr, g_ptr, m_ptr, v_ptr, g_inv_ptr, m_inv_ptr, v_inv_ptr, m_scale_ptr, v_scale_ptr, amax_ptr,
                    n, lr, beta1, beta2, eps, weight_decay, step_size, bias2_sqrt,
                    M_MAX: tl.constexpr, V_MAX: tl.constexpr, DECOUPLED: tl.constexpr, MAXIMIZE: tl.constexpr,
                    WRITE: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        if WRITE or not DECOUPLED:
            p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32) * tl.load(g_inv_ptr)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32) * tl.load(m_inv_ptr)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32) * tl.load(v_inv_ptr)
        if MAXIMIZE:
            g = -g
        if not DECOUPLED:
            g = g + weight_decay * p
        m = beta1 * m + (1.0 - beta1) * g
        v = beta2 * v + (1.0 - beta2) * g * g
        if WRITE:
            if DECOUPLED:
                p = p * (1.0 - lr * weight_decay)
            denom = tl.sqrt(v) / bias2_sqrt + eps
            p = p - step_size * (m / denom)
            tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask=mask)
            ms = m * tl.load(m_scale_ptr)
            vs = v * tl.load(v_scale_ptr)
            ms = tl.minimum(tl.maximum(ms, -M_MAX), M_MAX)
            vs = tl.minimum(tl.maximum(vs, -V_MAX), V_MAX)
            tl.store(m_ptr + offs, ms.to(m_ptr.dtype.element_ty), mask=mask)
            tl.store(v_ptr + offs, vs.to(v_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(amax_ptr + 2 * pid, tl.max(tl.where(mask, tl.abs(m), 0.0), axis=0))
            tl.store(amax_ptr + 2 * pid + 1, tl.max(tl.where(mask, tl.abs(v), 0.0), axis=0))

    return adam_kernel


def fused_low_bit_adam_step(p: torch.Tensor, state: dict, group: dict, *, decoupled: bool,
                            grad: torch.Tensor | None = None, grad_scale: torch.Tensor | None = None) -> None:
    """One Adam(W) update of `p` and its states in place (CUDA, contiguous tensors).

    Args:
        p: the parameter (FP32/FP16/BF16).
        state: LowBitAdamW state of `p` ("step" already incremented).
        group: its parameter group.
        grad: the gradient (default `p.grad`); may be FP8 with `grad_scale` (value = grad / grad_scale).
    """
    global _kernel
    if _kernel is None:
        _kernel = _build()
    grad = p.grad if grad is None else grad
    device = p.device
    one = torch.ones((), dtype=torch.float32, device=device)
    g_inv = one if grad_scale is None else grad_scale.reciprocal()
    beta1, beta2 = group["betas"]
    step = float(state["step"])
    lr = float(group["lr"])
    m, v = state["exp_avg"], state["exp_avg_sq"]
    m_scaled, v_scaled = m.dtype in _SCALED, v.dtype in _SCALED
    m_inv = state["exp_avg_scale"].reciprocal() if m_scaled else one
    v_inv = state["exp_avg_sq_scale"].reciprocal() if v_scaled else one
    n = p.numel()
    grid = (triton_cdiv(n, BLOCK),)
    args = dict(n=n, lr=lr, beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                step_size=lr / (1 - beta1**step), bias2_sqrt=(1 - beta2**step) ** 0.5,
                M_MAX=format_max(m.dtype) if m_scaled else float("inf"),
                V_MAX=format_max(v.dtype) if v_scaled else float("inf"),
                DECOUPLED=decoupled, MAXIMIZE=bool(group["maximize"]), BLOCK=BLOCK)
    m_scale, v_scale = one, one
    if m_scaled or v_scaled:
        partial = torch.empty(grid[0], 2, dtype=torch.float32, device=device)  # every block writes its row
        _kernel[grid](p, grad, m, v, g_inv, m_inv, v_inv, one, one, partial, WRITE=False, **args)
        # amax, not max: a NaN partial must reach compute_scale, which keeps the previous scale then
        amax = partial.amax(dim=0)
        if m_scaled:
            m_scale = compute_scale(amax[0], m.dtype, previous=state["exp_avg_scale"])
        if v_scaled:
            v_scale = compute_scale(amax[1], v.dtype, previous=state["exp_avg_sq_scale"])
    _kernel[grid](p, grad, m, v, g_inv, m_inv, v_inv, m_scale, v_scale, one, WRITE=True, **args)
    if m_scaled:
        state["exp_avg_scale"] = m_scale
    if v_scaled:
        state["exp_avg_sq_scale"] = v_scale


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b
