"""Amax and scale rules shared by the backends: current, delayed (amax history), power of two.

A scale multiplies a high-precision tensor before the cast, so `amax * scale <= fp8_max`; the
dequantisation factor is `1 / scale`. Every function works on tensors (one scale per tensor, or a
vector of them) without a host synchronisation, so it can run inside a training step.
"""

from __future__ import annotations

import torch

from .fused import amax_by_rows

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# The scaled storage formats, each read by its largest finite value (E4M3 448, E5M2 57344, FP16 65504, ...).
_FORMATS = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float16, torch.bfloat16, torch.float32)


# Largest power-of-two exponent of a scale, either sign: 2**126 and 2**-126 are normal FP32 numbers.
_MAX_EXPONENT = 126


def format_max(dtype: torch.dtype) -> float:
    """Largest finite value of a storage format (E4M3 448, E5M2 57344, FP16 65504, ...)."""
    if dtype not in _FORMATS:
        known = ", ".join(map(str, _FORMATS))
        raise ValueError(f"dtype={dtype} is not a scaled storage format; use one of {known}")
    # torch.finfo, not a table: dynamo folds it into a compiled graph as a constant, where a float read from a dict
    # became a 0-d float64 input made on every call (three in each compiled msamp FP8 Linear)
    return torch.finfo(dtype).max


def compute_scale(
    amax: torch.Tensor | float,
    fp8_dtype: torch.dtype,
    margin: int = 0,
    previous: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Power-of-two scale `2 ** (floor(log2(fp8_max / amax)) - margin)`.

    Powers of two make the cast exact apart from rounding the mantissa (no scale rounding error),
    and are MS-AMP's rule. Where `amax` is 0, inf or NaN the result is `previous` (1 if None): a
    NaN never becomes a scale, and a tensor of zeros keeps the last good scale. The exponent is
    capped at 126 so that a tiny amax (or a wide target such as FP32) still gives a finite scale;
    the capped scale only leaves more headroom. After `margin` it is also floored at -126, so the
    scale is never 0 (FP8RecipeKwargs bounds margin at 8; this guards other callers).

    Args:
        amax: absolute maximum, a scalar or one per tensor.
        fp8_dtype: the target format (any format `format_max` knows).
        margin: extra power-of-two headroom.
        previous: the scale in use, same shape as `amax`.

    Returns:
        float32 tensor of the shape of `amax`.
    """
    amax = torch.as_tensor(amax, dtype=torch.float32)
    if previous is None:
        previous = torch.ones_like(amax)
    previous = torch.as_tensor(previous, dtype=torch.float32, device=amax.device)
    valid = torch.isfinite(amax) & (amax > 0)
    safe = torch.where(valid, amax, torch.ones_like(amax))
    fp_max = format_max(fp8_dtype)
    # log2 of the FP32 quotient is only an estimate: just above fp_max / 2**k it rounds up to k, and
    # the scale would then push amax past fp_max. Multiplying by a power of two is exact, so the
    # estimate is corrected by one either way to the true floor. The clamp keeps 2**e finite (the
    # quotient is inf for a tiny amax); the cap after it is the one that matters.
    exponent = torch.floor(torch.log2(fp_max / safe)).clamp(-_MAX_EXPONENT, _MAX_EXPONENT + 1)
    exponent = exponent - (safe * torch.exp2(exponent) > fp_max).float()
    exponent = exponent + (safe * torch.exp2(exponent + 1) <= fp_max).float()
    # Floored as well as capped: past ~150 a margin would underflow the FP32 scale to 0, and 1 / 0 dequantises
    # every value to inf or NaN; 2**-126 still flushes the cast to zeros, but they dequantise as zeros.
    exponent = (exponent - margin).clamp(-_MAX_EXPONENT, _MAX_EXPONENT)
    return torch.where(valid, torch.exp2(exponent), previous)


# How a graph being compiled reduces a matrix's amax. False: over `reduction_rows` (rows of a fixed length, whatever
# the matrix's, so that the parallelism does not depend on the length inductor first compiled for). True: over the
# matrix's own rows, then theirs, a reduction inductor may fuse into the kernel that computes the matrix: over fixed
# rows it could not, and msamp O2's compiled backward stored the BF16 gradient of gate/up's output (0.44 GiB at
# d4096) for its amax alone (results/gpu/2026-11-28-h200-act8-steady-2a04d10). Not yet measured on a GPU
# (benchmarks/headline.py's "own rows" configurations set it): off until it is.
AMAX_OVER_OWN_ROWS = False


def tensor_amax(tensor: torch.Tensor) -> torch.Tensor:
    """`max(|tensor|)` as a float32 scalar; 0 for an empty tensor (an MoE expert with no tokens), which
    `compute_scale` treats as "keep the previous scale"."""
    if torch.compiler.is_compiling():
        # In a graph (a compiled layer, a fused pass; dynamic shapes): over rows first (AMAX_OVER_OWN_ROWS)
        if AMAX_OVER_OWN_ROWS and tensor.dim() == 2 and tensor.numel() > 0:
            return tensor.detach().abs().amax(dim=-1).amax().float()
        return amax_by_rows(tensor)
    if tensor.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=tensor.device)
    return tensor.detach().abs().amax().float()


def current_scale(tensor: torch.Tensor, fp8_dtype: torch.dtype, margin: int = 0,
                  previous: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, amax) from the tensor itself ("current" or "just-in-time" scaling)."""
    amax = tensor_amax(tensor)
    return compute_scale(amax, fp8_dtype, margin, previous), amax


def quantize(tensor: torch.Tensor, scale: torch.Tensor | float, fp8_dtype: torch.dtype) -> torch.Tensor:
    """`tensor * scale` cast to `fp8_dtype`, saturating finite values at the format's max (casts of
    out-of-range values to float8_e4m3fn would otherwise give NaN). Every FP8 cast of lowprec's own goes
    through here (or the Triton kernel that matches it). An inf or NaN element becomes NaN: saturated, an
    inf would come out as a finite ±max, and an overflow upstream would train as a large finite step that
    no non-finite check (a skipping loop, DDP's bucket fallback, the norm) ever sees."""
    limit = format_max(fp8_dtype)
    return (inf_to_nan(tensor.float()) * scale).clamp(-limit, limit).to(fp8_dtype)


def inf_to_nan(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` with every inf replaced by NaN, for a tensor about to be cast to FP8 (`quantize`).

    E4M3 has no infinity: the saturating cast would turn an overflow into a finite ±448, and the
    overflow would be applied as a large step. As NaN it stays visible to the loss, the norm, the
    clipping and the reduction, which skip or report it."""
    if torch.compiler.is_compiling():
        # inductor fuses this into the cast that follows (a lerp kept the d4096 msamp O2 peak 1.4 GiB
        # higher under torch 2.11: results/gpu/2026-11-24-h100-verify-4930ef2)
        return torch.where(torch.isinf(tensor), float("nan"), tensor)
    # Eager: one elementwise kernel, not isinf + where: lerp(x, x, w) is x + w * (x - x), where x - x is 0
    # for every finite x (the result is x exactly, signed zeros and subnormals included) and NaN for ±inf.
    return torch.lerp(tensor, tensor, 0.5)


def nan_to_inf(amax: torch.Tensor) -> torch.Tensor:
    """`amax` with NaN replaced by +inf, before a MAX all-reduce (MAX over NaN depends on operand order
    on some backends). Not `torch.nan_to_num`: it would also turn +inf into the largest finite float, and
    an overflowed gradient would then be cast as if it were finite."""
    return torch.where(torch.isnan(amax), torch.full_like(amax, float("inf")), amax)


def dequantize(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (data.float() / scale).to(dtype)


class AmaxHistory:
    """Delayed scaling: scales from the amax of earlier steps (TE DelayedScaling, MS-AMP windows).

    The scale used at step t comes from the history before t, so the cast needs no reduction over
    the tensor first. While fewer than `length` amaxes have been seen (warm-up) and after a step
    whose amax was inf/NaN, the current amax is used instead ("in time"), as MS-AMP does.

    Args:
        length: history length (1 = current scaling).
        algo: "max" over the history, or "most_recent".
        fp8_dtype, margin: as for `compute_scale`.
    """

    def __init__(self, length: int, algo: str, fp8_dtype: torch.dtype, margin: int = 0,
                 device: torch.device | str | None = None):
        if length < 1:
            raise ValueError(f"amax_history_len={length} must be >= 1")
        if algo not in ("max", "most_recent"):
            raise ValueError(f"amax_compute_algo={algo!r} is not one of 'max', 'most_recent'")
        self.length, self.algo, self.fp8_dtype, self.margin = length, algo, fp8_dtype, margin
        self.history = torch.zeros(length, device=device)
        self.scale = torch.ones((), device=device)
        self.seen = torch.zeros((), dtype=torch.int64, device=device)

    def in_time(self) -> torch.Tensor:
        """True while the history cannot be trusted yet (as a 0-d bool tensor)."""
        return (self.seen < self.length) | (self.length == 1)

    def scale_for(self, tensor: torch.Tensor) -> torch.Tensor:
        """The scale to cast `tensor` with now; records its amax."""
        amax = tensor_amax(tensor)
        now = compute_scale(amax, self.fp8_dtype, self.margin, self.scale)
        scale = torch.where(self.in_time(), now, self.scale)
        self.record(amax)
        return scale

    def record(self, amax: torch.Tensor) -> None:
        finite = torch.isfinite(amax)
        self.history = torch.roll(self.history, 1)
        self.history[0] = torch.where(finite, amax, torch.zeros_like(amax))
        # A non-finite step restarts the warm-up so the next casts use their own amax.
        self.seen = torch.where(finite, self.seen + 1, torch.zeros_like(self.seen))
        reference = self.history.max() if self.algo == "max" else self.history[0]
        self.scale = compute_scale(reference, self.fp8_dtype, self.margin, self.scale)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"history": self.history.clone(), "scale": self.scale.clone(), "seen": self.seen.clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.history.copy_(state["history"])
        self.scale.copy_(state["scale"])
        self.seen.copy_(state["seen"])
