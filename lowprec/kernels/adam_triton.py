"""Triton kernels of the fused low-bit Adam step (see `lowprec.kernels.adam`, which launches them).

Imported only on a CUDA host with Triton.
"""

import triton
import triton.language as tl


@triton.jit
def pow2_scale_bits(amax, previous, MAX_EXP: tl.constexpr, MAX_MANT: tl.constexpr):
    # floor(log2(fp_max / amax)) from the exponents and mantissas of both numbers: exact, with
    # no division (Triton's FP32 division is approximate). A zero, subnormal, inf or NaN amax
    # keeps `previous`, as compute_scale does (a subnormal amax would be capped anyway).
    bits = amax.to(tl.int32, bitcast=True)
    exp = (bits >> 23) & 0xFF
    mant = bits & 0x7FFFFF
    e = MAX_EXP - exp - (mant > MAX_MANT).to(tl.int32)
    e = tl.minimum(tl.maximum(e, -126), 126)
    scale = ((e + 127) << 23).to(tl.float32, bitcast=True)
    return tl.where((bits > 0) & (exp < 255), scale, previous)

@triton.jit
def inverse(scale):
    # 1 / a power-of-two scale, exactly, from its bits (Triton's FP32 division is approximate);
    # anything else (no lowprec scale is) is divided.
    bits = scale.to(tl.int32, bitcast=True)
    exp = (bits >> 23) & 0xFF
    exact = ((bits & 0x7FFFFF) == 0) & (exp > 0) & (exp < 254)
    return tl.where(exact, ((254 - exp) << 23).to(tl.float32, bitcast=True), 1.0 / scale)

@triton.jit
def _load_item(ptrs, sizes, chunks, valid, P_TY: tl.constexpr, G_TY: tl.constexpr, M_TY: tl.constexpr,
               V_TY: tl.constexpr, CHUNK: tl.constexpr, ALIGNED: tl.constexpr, WIDE: tl.constexpr,
               G_VALID: tl.constexpr):
    c = tl.program_id(0)
    t = tl.load(chunks + 2 * c)
    k = tl.load(chunks + 2 * c + 1)
    n = tl.load(sizes + t)
    base = ptrs + t * 7
    p_ptr = tl.load(base).to(tl.pointer_type(P_TY))
    g_ptr = tl.load(base + 1).to(tl.pointer_type(G_TY))
    m_ptr = tl.load(base + 2).to(tl.pointer_type(M_TY))
    v_ptr = tl.load(base + 3).to(tl.pointer_type(V_TY))
    if ALIGNED:
        # A pointer read from memory has unknown alignment, and Triton would then load element by
        # element; the launcher checked that every tensor starts on 16 bytes, so vector loads are safe.
        p_ptr = tl.multiple_of(p_ptr, 16)
        g_ptr = tl.multiple_of(g_ptr, 16)
        m_ptr = tl.multiple_of(m_ptr, 16)
        v_ptr = tl.multiple_of(v_ptr, 16)
    if WIDE:  # a tensor of 2**31 elements or more
        start = k.to(tl.int64) * CHUNK
    else:  # 32-bit offsets: 64-bit ones cost registers, and this kernel is memory-bound
        n = n.to(tl.int32)
        start = k * CHUNK
    end = tl.minimum(start + CHUNK, n)
    present = True
    if G_VALID:
        # The gradient's presence flag (> 0: it arrived this step), read here rather than on the host, which
        # would wait for the whole backward: with none, the range is empty and nothing is read or written.
        present = tl.load(tl.load(valid + t).to(tl.pointer_type(tl.float32))) > 0
        end = tl.where(present, end, start)
    return t, k, base, p_ptr, g_ptr, m_ptr, v_ptr, start, end, present

@triton.jit
def _moments(p_ptr, g_ptr, m_ptr, v_ptr, offs, mask, g_inv, m_inv, v_inv, beta1, beta2, weight_decay,
             DECOUPLED: tl.constexpr, MAXIMIZE: tl.constexpr, UPDATE: tl.constexpr):
    p = tl.zeros_like(offs).to(tl.float32)
    if UPDATE or not DECOUPLED:
        p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32) * g_inv
    m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32) * m_inv
    v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32) * v_inv
    if MAXIMIZE:
        g = -g
    if not DECOUPLED:
        g = g + weight_decay * p
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    return p, m, v

@triton.jit
def _mix32(x):
    # lowbias32 (Wellons' hash prospector): a bijection of 32-bit words whose every output bit depends on every
    # input bit, in 7 integer ops
    x = x ^ (x >> 16)
    x = x * 0x21F0AAAD
    x = x ^ (x >> 15)
    x = x * 0x735A2D97
    return x ^ (x >> 15)

@triton.jit
def tensor_key(seed):
    # one tensor's 32-bit key from its 64-bit rounding seed (step, position), both halves mixed in
    lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    return _mix32(lo ^ _mix32(hi ^ 0x2545F491))

@triton.jit
def uniform(key, offs):
    # a uniform number in [0, 1) per element, 24 bits, counter-based: the hash of the element's offset under the
    # tensor's key (every constant below 2**31: a larger literal would be an int64 in Triton). Philox (tl.rand)
    # is ~10x the integer work per element. Offsets are taken modulo 2**32: a tensor of more elements repeats
    # its random numbers past there, each rounding still unbiased.
    h = _mix32(offs.to(tl.uint32) * 0x7FEB352D + key)
    return (h >> 8).to(tl.float32) * 5.9604644775390625e-08

@triton.jit
def stochastic_round(x, key, offs, P_TY: tl.constexpr, P_MAX: tl.constexpr):
    # lowprec.kernels.rounding.stochastic_round: down is x rounded toward zero, up the next value away from
    # zero (its bits + 1: sign and magnitude), up with probability (x - down) / (up - down). Beyond the largest
    # finite value, inf and NaN: to nearest, as the cast is.
    down = x.to(P_TY, fp_downcast_rounding="rtz")
    up = (down.to(tl.int16, bitcast=True) + 1).to(P_TY, bitcast=True)
    low = down.to(tl.float32)
    frac = (x - low) / (up.to(tl.float32) - low)
    rounded = tl.where(uniform(key, offs) < frac, up, down)
    return tl.where(tl.abs(x) <= P_MAX, rounded, x.to(P_TY))

@triton.jit
def amax_pass(ptrs, sizes, chunks, valid, partials, beta1, beta2, weight_decay,
              P_TY: tl.constexpr, G_TY: tl.constexpr, M_TY: tl.constexpr, V_TY: tl.constexpr,
              G_SCALED: tl.constexpr, M_SCALED: tl.constexpr, V_SCALED: tl.constexpr,
              DECOUPLED: tl.constexpr, MAXIMIZE: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
              ALIGNED: tl.constexpr, WIDE: tl.constexpr, G_VALID: tl.constexpr):
    # (no `_` for the unused values: Triton's compiler would carry a name bound before the loop into it)
    t, k, base, p_ptr, g_ptr, m_ptr, v_ptr, start, end, present = _load_item(
        ptrs, sizes, chunks, valid, P_TY, G_TY, M_TY, V_TY, CHUNK, ALIGNED, WIDE, G_VALID)
    g_inv = 1.0
    m_inv = 1.0
    v_inv = 1.0
    if G_SCALED:
        g_inv = inverse(tl.load(tl.load(base + 4).to(tl.pointer_type(tl.float32))))
    if M_SCALED:
        m_inv = inverse(tl.load(tl.load(base + 5).to(tl.pointer_type(tl.float32))))
    if V_SCALED:
        v_inv = inverse(tl.load(tl.load(base + 6).to(tl.pointer_type(tl.float32))))
    m_amax = tl.zeros([BLOCK], dtype=tl.float32)
    v_amax = tl.zeros([BLOCK], dtype=tl.float32)
    for off in range(start, end, BLOCK):
        offs = off + tl.arange(0, BLOCK)
        mask = offs < end
        p_unused, m, v = _moments(p_ptr, g_ptr, m_ptr, v_ptr, offs, mask, g_inv, m_inv, v_inv,
                                  beta1, beta2, weight_decay, DECOUPLED, MAXIMIZE, False)
        # NaN -> inf before the max: an amax must never hide a NaN (pow2_scale keeps the old scale)
        m_amax = tl.maximum(m_amax, tl.where(mask, tl.where(m == m, tl.abs(m), float("inf")), 0.0))
        v_amax = tl.maximum(v_amax, tl.where(mask, tl.where(v == v, tl.abs(v), float("inf")), 0.0))
    c = tl.program_id(0)
    tl.store(partials + 2 * c, tl.max(m_amax, axis=0))
    tl.store(partials + 2 * c + 1, tl.max(v_amax, axis=0))


@triton.jit
def reduce_pass(ptrs, starts, partials, scratch, M_SCALED: tl.constexpr, V_SCALED: tl.constexpr,
                BLOCK: tl.constexpr):
    # One program per tensor: the max of its chunks' partial amaxes, and its current scales copied
    # aside (the update pass reads them after the first of its programs has overwritten them).
    t = tl.program_id(0)
    first = tl.load(starts + t)
    last = tl.load(starts + t + 1)
    m_amax = tl.zeros([BLOCK], dtype=tl.float32)
    v_amax = tl.zeros([BLOCK], dtype=tl.float32)
    for off in range(first, last, BLOCK):
        offs = off + tl.arange(0, BLOCK)
        mask = offs < last
        m_amax = tl.maximum(m_amax, tl.load(partials + 2 * offs, mask=mask, other=0.0))
        v_amax = tl.maximum(v_amax, tl.load(partials + 2 * offs + 1, mask=mask, other=0.0))
    row = scratch + 4 * t
    base = ptrs + t * 7
    tl.store(row, tl.max(m_amax, axis=0))
    tl.store(row + 1, tl.max(v_amax, axis=0))
    if M_SCALED:
        tl.store(row + 2, tl.load(tl.load(base + 5).to(tl.pointer_type(tl.float32))))
    if V_SCALED:
        tl.store(row + 3, tl.load(tl.load(base + 6).to(tl.pointer_type(tl.float32))))

@triton.jit
def scaled_moment(x, TY: tl.constexpr, MAX: tl.constexpr, INF: tl.constexpr):
    # x (a moment times its scale) in TY as LowBitAdamW's plain-torch step stores it (low_bit_adam._encode): a finite
    # value past the max saturates, like torch.clamp, which keeps a NaN (PTX min/max would replace it by the bound);
    # an inf is an overflow, not a large value, and stays non-finite: the format's inf in FP16 (INF == 1, through the
    # cast) and E5M2 (2), NaN in E4M3 (0), which has none. An FP8 format's non-finite values are written as bits:
    # the compiled cast (cvt.satfinite) saturates an inf, Triton's interpreter makes a NaN 384.
    inf = (x == float("inf")) | (x == -float("inf"))
    clamped = tl.clamp(x, -MAX, MAX, propagate_nan=tl.PropagateNan.ALL)
    # (no early return: the compiler would still build what follows it for FP16, and fail at the bitcast)
    if INF == 1:
        out = tl.where(inf, x, clamped).to(TY)
    else:
        bits = clamped.to(TY).to(tl.uint8, bitcast=True)
        special = tl.full(x.shape, 0x7F, tl.uint8)  # NaN in both formats
        if INF == 2:
            special = tl.where(inf, tl.where(x < 0, 0xFC, 0x7C), special).to(tl.uint8)  # sign, all-ones exponent
        out = tl.where(inf | (x != x), special, bits).to(tl.uint8).to(TY, bitcast=True)
    return out

@triton.jit
def update_pass(ptrs, sizes, chunks, valid, scratch, hyper, seeds, lr, beta1, beta2, eps, weight_decay,
                P_SR: tl.constexpr, P_MAX: tl.constexpr,
                P_TY: tl.constexpr, G_TY: tl.constexpr, M_TY: tl.constexpr, V_TY: tl.constexpr,
                G_SCALED: tl.constexpr, M_SCALED: tl.constexpr, V_SCALED: tl.constexpr,
                M_MAX: tl.constexpr, M_MAX_EXP: tl.constexpr, M_MAX_MANT: tl.constexpr, M_INF: tl.constexpr,
                V_MAX: tl.constexpr, V_MAX_EXP: tl.constexpr, V_MAX_MANT: tl.constexpr, V_INF: tl.constexpr,
                DECOUPLED: tl.constexpr, MAXIMIZE: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                ALIGNED: tl.constexpr, WIDE: tl.constexpr, G_VALID: tl.constexpr):
    t, k, base, p_ptr, g_ptr, m_ptr, v_ptr, start, end, present = _load_item(
        ptrs, sizes, chunks, valid, P_TY, G_TY, M_TY, V_TY, CHUNK, ALIGNED, WIDE, G_VALID)
    step_size = tl.load(hyper + 2 * t)
    bias2_sqrt = tl.load(hyper + 2 * t + 1)
    row = scratch + 4 * t
    first = (k == 0) & present  # an absent gradient leaves the scales as they were too
    key = 0
    if P_SR:
        key = tensor_key(tl.load(seeds + t))
    g_inv = 1.0
    m_inv = 1.0
    v_inv = 1.0
    m_new = 1.0
    v_new = 1.0
    if G_SCALED:
        g_inv = inverse(tl.load(tl.load(base + 4).to(tl.pointer_type(tl.float32))))
    if M_SCALED:
        m_old = tl.load(row + 2)
        m_inv = inverse(m_old)
        m_new = pow2_scale_bits(tl.load(row), m_old, M_MAX_EXP, M_MAX_MANT)
        tl.store(tl.load(base + 5).to(tl.pointer_type(tl.float32)), m_new, mask=first)
    if V_SCALED:
        v_old = tl.load(row + 3)
        v_inv = inverse(v_old)
        v_new = pow2_scale_bits(tl.load(row + 1), v_old, V_MAX_EXP, V_MAX_MANT)
        tl.store(tl.load(base + 6).to(tl.pointer_type(tl.float32)), v_new, mask=first)
    for off in range(start, end, BLOCK):
        offs = off + tl.arange(0, BLOCK)
        mask = offs < end
        p, m, v = _moments(p_ptr, g_ptr, m_ptr, v_ptr, offs, mask, g_inv, m_inv, v_inv,
                           beta1, beta2, weight_decay, DECOUPLED, MAXIMIZE, True)
        if DECOUPLED:
            p = p * (1.0 - lr * weight_decay)
        denom = tl.sqrt(v) / bias2_sqrt + eps
        p = p - step_size * (m / denom)
        if P_SR:
            tl.store(p_ptr + offs, stochastic_round(p, key, offs, P_TY, P_MAX), mask=mask)
        else:
            tl.store(p_ptr + offs, p.to(P_TY), mask=mask)
        if M_SCALED:
            tl.store(m_ptr + offs, scaled_moment(m * m_new, M_TY, M_MAX, M_INF), mask=mask)
        else:
            tl.store(m_ptr + offs, m.to(M_TY), mask=mask)
        if V_SCALED:
            tl.store(v_ptr + offs, scaled_moment(v * v_new, V_TY, V_MAX, V_INF), mask=mask)
        else:
            tl.store(v_ptr + offs, v.to(V_TY), mask=mask)

@triton.jit
def scale_kernel(amax_ptr, previous_ptr, out_ptr, n, MAX_EXP: tl.constexpr, MAX_MANT: tl.constexpr,
                 BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    amax = tl.load(amax_ptr + offs, mask=mask, other=0.0)
    previous = tl.load(previous_ptr + offs, mask=mask, other=1.0)
    tl.store(out_ptr + offs, pow2_scale_bits(amax, previous, MAX_EXP, MAX_MANT), mask=mask)
