"""`FP8Linear`: MS-AMP's FP8 linear layer (levels O1/O2) on plain PyTorch.

Per tensor, as MS-AMP's `nn/functional.py` does it:

| tensor           | format                  | scale                                                |
|------------------|-------------------------|------------------------------------------------------|
| weight (stored)  | FP16 (or BF16)          | the true value; no master copy                       |
| weight (GEMM)    | E4M3                    | current: from the weight's amax at each forward      |
| input            | E4M3                    | delayed: max amax of the last `window` steps (in     |
|                  |                         | time while warming up)                               |
| output gradient  | E5M2 (HYBRID) / E4M3    | delayed, as the input; both windows' amaxes all-     |
|                  |                         | reduced across ranks each step (`reduce_amax`,       |
|                  |                         | `communication.all_reduce_amaxes`)                   |
| weight gradient  | E4M3, kept on the layer | current, from the accumulated gradient; shared by    |
|                  |                         | all ranks after reduction                            |

Every scale is a power of two (`lowprec.kernels.scaling.compute_scale`). The three GEMMs are
`torch._scaled_mm` on FP8 GPUs and the same math in FP32 elsewhere (emulation).

The weight gradient never becomes a `.grad`: autograd gets None for the weight and the layer keeps the gradient in
its FP8 buffer (`fp8_grad_data` with `fp8_grad_scale`), accumulating micro-batches by dequantise + add + requantise.
`lowprec.optim.LowBitAdamW` reads it from there; the backend's reducer averages it across ranks in FP8. All state
lives in buffers that the autograd function updates in place, so the layer compiles as one graph (torch.compile).

Deliberate difference from MS-AMP: the stored FP16 weight is the true weight, not a value
pre-multiplied by a scale, so every PyTorch tool (initialisers, tied weights, `state_dict`) sees a
real weight. FP16 then stores |w| < 6e-5 as subnormals, whose absolute error (6e-8) is still below
what the E4M3 cast of the GEMM loses for any weight tensor whose amax is above ~1e-5.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels import triton_available
from ...kernels.cast import fp8_transpose
from ...kernels.fused import cuda_fused
from ...kernels.scaling import compute_scale, dequantize, quantize, tensor_amax
from ...optim.grad_store import accumulate_into
from .fsdp import FP8GatheredWeight, FP8MasterWeight, master_view

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
WEIGHT_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# Names of the layer's scaling buffers; checkpoints drop them when exported for a plain model.
META_PREFIX = "fp8_meta_"
_INPUT, _GRAD = 0, 1  # rows of the amax history
# One 0-d buffer per scale, never views of one (3,) buffer: Inductor passes a saved view (storage offset
# 4 or 8 bytes) straight to torch._scaled_mm, and cuBLASLt refuses scale pointers that are not 16-byte
# aligned (CUBLAS_STATUS_NOT_SUPPORTED), seen on the compiled d=4096 proxy's lm_head.
SCALE_NAMES = ("input", "grad", "weight")


def cast_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, *, transpose: bool,
             amax_into: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """`x * scale` in `dtype` (saturating), its transpose (row-major) if asked, and `amax(|x|)`: a new scalar, or
    `amax_into` (an amax window's slot) raised to it in place.

    On CUDA in eager mode one Triton kernel does all three in a single read of `x`; under
    `torch.compile` the torch ops below are fused by Inductor instead. NaN in `x` gives a
    non-finite amax, which no scale is ever computed from.
    """
    # is_compiling first: dynamo would otherwise trace the lru_cache of triton_available (and warn about it)
    if not torch.compiler.is_compiling() and x.is_cuda and x.numel() and triton_available():
        from ...kernels.cast import cast_transpose

        # the kernel's atomic max goes straight into the window's slot: no scalar to zero and no max to record,
        # two of the few launches an eager layer makes, whose host time bounds O3 under FSDP2. A window cast to
        # another dtype (model.half()) gets the max through a scalar, as the kernel writes FP32.
        direct = amax_into is not None and amax_into.dtype == torch.float32
        amax = amax_into if direct else torch.zeros((), dtype=torch.float32, device=x.device)
        q, qt = cast_transpose(x, scale, dtype, amax, transpose=transpose)
        if amax_into is not None and not direct:
            _record(amax_into, amax)
        return q, qt, amax
    amax = tensor_amax(x)
    if amax_into is not None:
        _record(amax_into, amax)
    q = quantize(x, scale, dtype)
    return q, (q.t().contiguous() if transpose else None), amax


def scaled_gemm(a: torch.Tensor, b: torch.Tensor, a_inv: torch.Tensor, b_inv: torch.Tensor,
                out_dtype: torch.dtype, *, emulate: bool, fast_accum: bool) -> torch.Tensor:
    """`(a * a_inv) @ (b * b_inv)` for FP8 `a` (row-major) and `b` (column-major); `*_inv` are the dequantisation
    factors, 1 / scale (exact: every scale is a power of two)."""
    if not a.numel() or not b.numel():  # no tokens (or an empty inner dimension): cuBLAS refuses k == 0
        return torch.zeros(a.shape[0], b.shape[1], dtype=out_dtype, device=a.device)
    if emulate:
        return ((a.float() * a_inv) @ (b.float() * b_inv)).to(out_dtype)
    return torch._scaled_mm(a, b, scale_a=a_inv, scale_b=b_inv, out_dtype=out_dtype, use_fast_accum=fast_accum)


def _pad_cols(t: torch.Tensor, multiple: int) -> torch.Tensor:
    """Zero-pad the last dimension of a row-major FP8 matrix (a zero byte is 0.0 in both formats)."""
    extra = -t.shape[-1] % multiple
    if not extra:
        return t
    return F.pad(t.view(torch.uint8), (0, extra)).view(t.dtype)


def _record(slot: torch.Tensor, amax: torch.Tensor) -> None:
    # Max over the micro-batches of a step; NaN propagates and is dealt with at the step update.
    slot.copy_(torch.maximum(slot, amax))


def _cast_with_scale(t: torch.Tensor, stored: torch.Tensor, dtype: torch.dtype, margin: int, in_time: bool,
                     record_into: torch.Tensor | None):
    """(scale, FP8 tensor, its transpose): scaled from the tensor's own amax while the window warms up (`in_time`),
    else with the stored delayed scale itself, not a copy: the backward dequantises with the factor the forward
    derives from it (`_foreach_reciprocal`), whatever happens to the buffer in between. The amax goes into
    `record_into`, the window's slot of the step, where given."""
    scale = _current_scale(t, stored, dtype, margin) if in_time else stored
    with torch.no_grad():
        q, qt, _ = cast_fp8(t, scale, dtype, transpose=True, amax_into=record_into)
    return scale, q, qt


@cuda_fused
def _current_scale(t: torch.Tensor, previous: torch.Tensor, dtype: torch.dtype, margin: int) -> torch.Tensor:
    """The power-of-two scale from `t`'s own amax (`previous` where that is 0 or not finite). Eager on CUDA one
    compiled call: as separate ops the amax and the scale rule were ~25 launches, each ~20-30 us of the host's time,
    for every input and gradient of the warm-up's steps and every O2 weight of every step."""
    return compute_scale(tensor_amax(t), dtype, margin, previous=previous)


class _FP8LinearFunction(torch.autograd.Function):
    """y = x W^T with the three GEMMs in FP8. State tensors are updated in place (see module doc).

    Eager on CUDA after the warm-up a call launches 3 kernels forward (both dequantisation factors in one
    `_foreach_reciprocal`, the input's cast with its amax, the GEMM) and 5 backward for an O3 weight as FSDP2
    gathered it: each launch costs the host ~20-30 us on the H200 hosts, where O3 under FSDP2 is bound by the host.
    """

    @staticmethod
    def forward(ctx, x, weight, history, scale_x, scale_g, scale_w, grad_data, grad_scale, grad_amax, grad_valid, cfg):
        fwd_dtype, bwd_dtype, margin, in_time_input, in_time_grad, emulate, out_dtype, record = cfg
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        s_x, xq, xqt = _cast_with_scale(x2, scale_x, fwd_dtype, margin, in_time_input,
                                        history[_INPUT, 0] if record else None)
        gathered = isinstance(weight, FP8GatheredWeight)
        if gathered:  # O3: FSDP2 all-gathered it in E4M3 already, and its group recorded the scale (`_GroupCast`)
            # Saved as gathered, transposed in the backward: a transposed copy made here would keep every block's
            # whole E4M3 weight alive from its forward to its backward, though FSDP2 frees the gathered one after
            # the forward and gathers it again for the backward (1 byte per parameter on every rank).
            wq, s_w = weight._data, weight._scale
            wqt = wq
        else:
            s_w = _current_scale(weight, scale_w, fwd_dtype, margin)
            wq, wqt, _ = cast_fp8(weight, s_w, fwd_dtype, transpose=True)
            if record:
                with torch.no_grad():
                    scale_w.copy_(s_w)
        inv_x, inv_w = torch._foreach_reciprocal([s_x, s_w])
        out = scaled_gemm(xq, wq.t(), inv_x, inv_w, out_dtype, emulate=emulate, fast_accum=True)
        ctx.save_for_backward(xqt, wqt, inv_x, inv_w)
        # Mutable state goes on ctx, not through save_for_backward: it changes between forward and
        # backward (a layer used twice, activation recompute), which the saved-tensor version check forbids.
        ctx.state = (history, scale_g, grad_data, grad_scale, grad_amax, grad_valid)
        ctx.cfg = (bwd_dtype, margin, in_time_grad, emulate, x.dtype, shape, gathered, weight.dtype)
        return out.reshape(*shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        xqt, wqt, inv_x, inv_w = ctx.saved_tensors
        history, scale_g, grad_data, grad_scale, grad_amax, grad_valid = ctx.state
        bwd_dtype, margin, in_time, emulate, x_dtype, shape, gathered, w_dtype = ctx.cfg
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        s_g, gq, gqt = _cast_with_scale(g2, scale_g, bwd_dtype, margin, in_time, history[_GRAD, 0])
        inv_g = s_g.reciprocal()
        grad_x = None
        if ctx.needs_input_grad[0]:
            if gathered:  # the weight as gathered (again, by FSDP2) for the backward
                wqt = fp8_transpose(wqt)
            grad_x = scaled_gemm(gq, wqt.t(), inv_g, inv_w, grad_out.dtype, emulate=emulate, fast_accum=False)
            grad_x = grad_x.to(x_dtype).reshape(shape)
        if not ctx.needs_input_grad[1]:  # frozen weight
            return (grad_x,) + (None,) * 10
        # dW = dY^T X: inner dimension = tokens, which FP8 GEMMs need in multiples of 16. Written in a dtype of FP32's
        # range (an FP16 overflow would be a finite max): the output gradient's (as MS-AMP) when stored in E4M3, the
        # weight's when O3's FSDP2 takes it from autograd (FP32 ones were live at O2's peak: h200-memory-8951179).
        keep = grad_out.dtype if grad_data is not None else w_dtype
        out_dtype = keep if keep in (torch.bfloat16, torch.float32) else torch.float32
        wgrad = scaled_gemm(_pad_cols(gqt, 16), _pad_cols(xqt, 16).t(), inv_g, inv_x, out_dtype,
                            emulate=emulate, fast_accum=False)
        if grad_data is None:  # O3: FSDP2 takes the gradient from autograd and reduce-scatters it
            return (grad_x, wgrad) + (None,) * 9
        accumulate_into(grad_data, grad_scale, grad_amax, grad_valid, wgrad)
        return (grad_x,) + (None,) * 10


class FP8Linear(nn.Module):
    """Drop-in for `nn.Linear` with MS-AMP O1/O2 numerics (see module docstring).

    Args:
        in_features, out_features, bias: as `nn.Linear`.
        weight_dtype: storage of the weight, torch.float16 (MS-AMP), torch.bfloat16 or torch.float32.
        fp8_format: "HYBRID" (E5M2 output gradients) or "E4M3".
        amax_history_len: window of the delayed input / output-gradient scales (MS-AMP: 16).
        amax_compute_algo: "max" over the window or "most_recent".
        margin: extra power-of-two headroom of every scale.
        emulate: run the GEMMs in FP32 on dequantised operands (CPU, pre-Hopper GPUs).
        fp8_eval: run FP8 in eval mode too (otherwise eval uses a high-precision GEMM).
        sharded_master: level O3 under FSDP2. The weight is an `FP8MasterWeight` (the FP16 master that
            FSDP2 shards and all-gathers in E4M3, see `lowprec.backends.msamp.fsdp`) and its gradient
            goes back through autograd for FSDP2 to reduce-scatter, instead of into FP8 buffers here.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 weight_dtype: torch.dtype = torch.float16, fp8_format: str = "HYBRID", amax_history_len: int = 16,
                 amax_compute_algo: str = "max", margin: int = 0, emulate: bool = False, fp8_eval: bool = True,
                 device=None, bias_dtype: torch.dtype | None = None, sharded_master: bool = False):
        super().__init__()
        if weight_dtype not in WEIGHT_DTYPES.values():
            raise ValueError(f"FP8Linear.weight_dtype={weight_dtype} is not one of torch.float16, torch.bfloat16, "
                             "torch.float32")
        if fp8_format not in ("HYBRID", "E4M3"):
            raise ValueError(f"FP8Linear.fp8_format={fp8_format!r} is not one of 'HYBRID', 'E4M3'")
        if amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(f"FP8Linear.amax_compute_algo={amax_compute_algo!r} is not one of 'max', 'most_recent'")
        if amax_history_len < 1:
            raise ValueError(f"FP8Linear.amax_history_len={amax_history_len} must be >= 1")
        self.in_features, self.out_features = in_features, out_features
        self.fp8_format, self.amax_history_len, self.amax_compute_algo = fp8_format, amax_history_len, amax_compute_algo
        self.margin, self.emulate, self.fp8_eval = margin, emulate, fp8_eval
        self.sharded_master = sharded_master
        weight = torch.empty(out_features, in_features, dtype=weight_dtype, device=device)
        self.weight = nn.Parameter(FP8MasterWeight(weight, margin) if sharded_master else weight)
        self.bias = (nn.Parameter(torch.zeros(out_features, dtype=bias_dtype or torch.float32, device=device))
                     if bias else None)
        # rows: input, output gradient; column 0 is the step in progress
        self.register_buffer(META_PREFIX + "amax_history", torch.zeros(2, amax_history_len, device=device))
        for name in SCALE_NAMES:
            self.register_buffer(f"{META_PREFIX}scale_{name}", torch.ones((), device=device))
        self.register_buffer(META_PREFIX + "steps", torch.zeros((), dtype=torch.int64, device=device))
        # The FP8 weight gradient; not part of checkpoints (like .grad). O3 has none: FSDP2 keeps the
        # gradient sharded in .grad.
        if not sharded_master:
            self.register_buffer("fp8_grad_data", torch.zeros(out_features, in_features, dtype=E4M3, device=device),
                                 persistent=False)
            self.register_buffer("fp8_grad_scale", torch.ones((), device=device), persistent=False)
            self.register_buffer("fp8_grad_amax", torch.zeros((), device=device), persistent=False)
            self.register_buffer("fp8_grad_valid", torch.zeros((), device=device), persistent=False)
        # Python mirrors of fp8_meta_steps: warm-up is decided without a device sync, and by a bool
        # that flips once, so torch.compile guards on it (two graphs), not on a step count.
        self._steps = 0
        self._in_time = True
        if not sharded_master:
            self.weight.fp8_grad_owner = True  # marks parameters whose gradient lives in FP8 on the layer
        self.register_load_state_dict_post_hook(_sync_steps)

    # ---- construction ----------------------------------------------------------------------
    @classmethod
    def from_float(cls, linear: nn.Linear, **options) -> FP8Linear:
        """Copy of `linear` (weights cast to the storage dtype, bias kept as is), on its device."""
        bias_dtype = None if linear.bias is None else linear.bias.dtype
        if options.get("sharded_master"):  # FSDP2 shards weight and bias as one group: one dtype
            bias_dtype = options.get("weight_dtype", torch.float16)
        new = cls(linear.in_features, linear.out_features, linear.bias is not None, device=linear.weight.device,
                  bias_dtype=bias_dtype, **options)
        with torch.no_grad():
            (new.weight._tensor if new.sharded_master else new.weight).copy_(linear.weight)
            if linear.bias is not None:
                new.bias.copy_(linear.bias)
        new.weight.requires_grad_(linear.weight.requires_grad)
        if linear.bias is not None:
            new.bias.requires_grad_(linear.bias.requires_grad)
        new.original_weight_dtype = linear.weight.dtype
        for name, value in vars(linear).items():  # user attributes (e.g. HF's _is_hf_initialized)
            if not name.startswith("_") and name not in vars(new):
                setattr(new, name, value)
        return new

    # ---- state -----------------------------------------------------------------------------
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.sharded_master:
            # The FP16 master as a plain tensor (a DTensor of plain shards under FSDP2), sharing its
            # memory: checkpoint writers cannot serialise the all-gather wrapper, and loading copies
            # into the wrapper's FP16 bytes either way.
            destination[prefix + "weight"] = master_view(destination[prefix + "weight"])
        elif isinstance(self.weight, FP8GatheredWeight):
            # O3 under DeepSpeed: the stored E4M3 weight, dequantised (plain tensors for any writer); the
            # exact FP16 masters travel in lowprec's own checkpoint entry (zero.ZeroFP8Weights)
            destination[prefix + "weight"] = self.weight.dequantize()

    @property
    def amax_history(self) -> torch.Tensor:
        return getattr(self, META_PREFIX + "amax_history")

    def scale_buffers(self) -> list[torch.Tensor]:
        """The (input, output gradient, weight) scale buffers, live."""
        return [getattr(self, f"{META_PREFIX}scale_{name}") for name in SCALE_NAMES]

    @property
    def scales(self) -> torch.Tensor:
        """(input, output gradient, weight) scales in use, as a (3,) copy."""
        return torch.stack(self.scale_buffers())

    @property
    def fp8_dtypes(self) -> tuple[torch.dtype, torch.dtype]:
        return E4M3, (E5M2 if self.fp8_format == "HYBRID" else E4M3)

    def in_time(self) -> bool:
        """Delayed scales are not trusted yet (warm-up: the first `amax_history_len` steps)."""
        return self._in_time

    def _count_step(self, steps: int) -> None:
        self._steps = steps
        self._in_time = self.amax_history_len == 1 or steps < self.amax_history_len

    def weight_grad(self, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
        """The accumulated weight gradient, dequantised (None if there is none since the last reset)."""
        if self.sharded_master or not bool(self.fp8_grad_valid):
            return None
        return dequantize(self.fp8_grad_data, self.fp8_grad_scale, dtype)

    def reset_fp8_grad(self) -> None:
        if not self.sharded_master:
            self.fp8_grad_valid.zero_()

    def zero_grad(self, set_to_none: bool = True) -> None:
        # A container's zero_grad() does not reach this; lowprec's conversion patches the model's.
        super().zero_grad(set_to_none)
        self.reset_fp8_grad()

    # ---- forward ---------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device_type = x.device.type
        autocast = torch.is_autocast_enabled(device_type)
        out_dtype = torch.get_autocast_dtype(device_type) if autocast else x.dtype
        if not self.training and not self.fp8_eval:
            out = F.linear(x.to(out_dtype), self.weight.to(out_dtype))
        else:
            fwd, bwd = self.fp8_dtypes
            in_time = self.in_time()
            cfg = (fwd, bwd, self.margin, in_time, in_time, self.emulate, out_dtype, self.training)
            grad_buffers = (None,) * 4 if self.sharded_master else (
                self.fp8_grad_data, self.fp8_grad_scale, self.fp8_grad_amax, self.fp8_grad_valid)
            # Emulated GEMMs are FP32 matmuls, which autocast would run in its dtype; on an FP8 GPU no op of the layer
            # is one autocast changes, and entering and leaving it cost each eager call ~20 us of host time.
            with torch.autocast(device_type, enabled=False) if autocast and self.emulate else nullcontext():
                out = _FP8LinearFunction.apply(x, self.weight, self.amax_history, *self.scale_buffers(), *grad_buffers,
                                               cfg)
            if self.training and isinstance(self.weight, FP8GatheredWeight) and not self.sharded_master:
                with torch.no_grad():  # O3 under DeepSpeed: the stored weight's scale, for inspection
                    self.scale_buffers()[2].copy_(self.weight._scale)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"weight={str(self.weight.dtype).replace('torch.', '')}, format={self.fp8_format}, "
                f"window={self.amax_history_len}{', emulated' if self.emulate else ''}")


def _sync_steps(module: FP8Linear, incompatible_keys) -> None:
    module._count_step(int(getattr(module, META_PREFIX + "steps")))


@torch.no_grad()
def update_delayed_scales(layers: list[FP8Linear]) -> None:
    """After an optimizer step: new delayed scales from each layer's window, then roll the window.

    MS-AMP's `_update_scaling_factors`: a non-finite amax is dropped from the window (the scale
    stays the last finite one), the scale comes from the max (or most recent) amax of the window,
    and the window moves on by one step. Batched over all layers (a handful of kernels per step).
    Across data-parallel ranks the backend first all-reduces the step's amaxes
    (`communication.all_reduce_amaxes`).
    """
    groups: dict[tuple, list[FP8Linear]] = {}
    for layer in layers:
        key = (layer.amax_history.device, layer.amax_history_len, layer.amax_compute_algo, layer.margin,
               layer.fp8_format)
        groups.setdefault(key, []).append(layer)
    for (_, _, algo, margin, _), group in groups.items():
        fwd, bwd = group[0].fp8_dtypes
        history = torch.stack([layer.amax_history for layer in group])  # (n, 2, window)
        live = [layer.scale_buffers() for layer in group]  # (input, grad, weight) of each layer
        scales = torch.stack([b for buffers in live for b in buffers]).view(len(group), -1)  # one stack: (n, 3)
        current = history[..., 0]
        finite = torch.isfinite(current)
        history[..., 0] = torch.where(finite, current, torch.zeros_like(current))
        reference = history.amax(dim=-1) if algo == "max" else history[..., 0]
        new_input = compute_scale(reference[:, 0], fwd, margin, previous=scales[:, 0])
        new_grad = compute_scale(reference[:, 1], bwd, margin, previous=scales[:, 1])
        history = torch.roll(history, 1, dims=-1)
        history[..., 0] = 0
        torch._foreach_copy_([layer.amax_history for layer in group], list(history.unbind(0)))
        torch._foreach_copy_([b[0] for b in live] + [b[1] for b in live],
                             list(new_input.unbind(0)) + list(new_grad.unbind(0)))
        torch._foreach_add_([getattr(layer, META_PREFIX + "steps") for layer in group], 1)
        for layer in group:
            layer._count_step(layer._steps + 1)
