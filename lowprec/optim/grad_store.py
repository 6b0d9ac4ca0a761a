"""Weight gradients kept outside `.grad`, in FP8 E4M3 with a per-tensor scale or in BF16.

MS-AMP's O1/O2 keep each Linear's weight gradient in FP8. The msamp backend's `FP8Linear` writes
it from its own backward; for any other layer (a TransformerEngine or torchao Linear) a
`GradStore` takes the gradient from a post-accumulate-grad hook the moment autograd produces it,
adds it to what earlier micro-batches left, requantises, and frees `.grad`, so the high-precision
gradient never outlives the layer's backward.

A store has the attributes `LowBitAdamW.attach_fp8_grads`, `clip_grad_norm_` and the FP8 gradient
reducer read: `weight`, `fp8_grad_data`, `fp8_grad_scale` (value = data / scale),
`fp8_grad_amax`, `fp8_grad_valid` (0 until a gradient arrives in this step). Its tensors are
non-persistent buffers of the layer, so they follow `model.to(device)` and stay out of checkpoints.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

from ..kernels.fused import amax_of_rows, cuda_fused, reduction_rows
from ..kernels.scaling import compute_scale, quantize
from ..utils.hooks import weak_post_accumulate_grad_hook

STORE_DTYPES = {"fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16}
_PREFIX = "_lowprec_grad_"


class GradStore:
    """The gradient of `module.weight`, held in `dtype` (FP8 E4M3 or BF16) instead of `.grad`."""

    def __init__(self, module: nn.Module, dtype: torch.dtype):
        if dtype not in STORE_DTYPES.values():
            raise ValueError(f"GradStore dtype={dtype} is not one of {list(STORE_DTYPES.values())}")
        weight = module.weight
        self.module = module
        self.dtype = dtype
        device = weight.device
        module.register_buffer(_PREFIX + "data", torch.zeros(weight.shape, dtype=dtype, device=device),
                               persistent=False)
        module.register_buffer(_PREFIX + "scale", torch.ones((), device=device), persistent=False)
        module.register_buffer(_PREFIX + "amax", torch.zeros((), device=device), persistent=False)
        module.register_buffer(_PREFIX + "valid", torch.zeros((), device=device), persistent=False)
        # the layer keeps its store alive; the weight's hook holds it weakly (a strong one kept the model alive)
        module.__dict__[_PREFIX + "store"] = self
        self._handle = weak_post_accumulate_grad_hook(weight, self, GradStore._take)

    def __getstate__(self) -> dict:
        # a pickled or deep-copied layer (torch.save of a whole model, an EMA copy) carries no hook on its weight: its
        # store is dormant, as the layer was storeless before stores were kept on it (the hook is a local function)
        return {**self.__dict__, "_handle": None}

    # the attributes the optimizer, the clipper and the reducer read
    @property
    def weight(self) -> nn.Parameter:
        return self.module.weight

    @property
    def fp8_grad_data(self) -> torch.Tensor:
        return getattr(self.module, _PREFIX + "data")

    @property
    def fp8_grad_scale(self) -> torch.Tensor:
        return getattr(self.module, _PREFIX + "scale")

    @property
    def fp8_grad_amax(self) -> torch.Tensor:
        return getattr(self.module, _PREFIX + "amax")

    @property
    def fp8_grad_valid(self) -> torch.Tensor:
        return getattr(self.module, _PREFIX + "valid")

    def _take(self, param: torch.Tensor) -> None:
        grad, param.grad = param.grad, None
        self.accumulate(grad)

    def accumulate(self, grad: torch.Tensor) -> None:
        """Add `grad` to the stored gradient (dequantise, add in FP32, requantise)."""
        accumulate_into(self.fp8_grad_data, self.fp8_grad_scale, self.fp8_grad_amax, self.fp8_grad_valid, grad)

    def grad(self) -> torch.Tensor | None:
        """The stored gradient dequantised to FP32, or None when none arrived since the last clear."""
        if not self.fp8_grad_valid.item():
            return None
        return self.fp8_grad_data.float() / self.fp8_grad_scale

    def remove(self) -> None:
        """Stop taking gradients (they go to `.grad` again) and free the buffers."""
        if self._handle is not None:
            self._handle.remove()
        for name in ("data", "scale", "amax", "valid"):
            delattr(self.module, _PREFIX + name)
        self.module.__dict__.pop(_PREFIX + "store", None)


@torch.no_grad()
def accumulate_into(data: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, valid: torch.Tensor,
                    grad: torch.Tensor) -> None:
    """Add `grad` to a gradient kept as `data / scale` (E4M3 with a current power-of-two scale, or
    BF16 with scale 1), in place: dequantise, add in FP32, requantise. `valid` = 0 means empty.
    A store's hook and msamp's FP8Linear backward both accumulate micro-batches this way."""
    new_data, new_scale, new_amax = accumulated(data, scale, valid, grad)
    data.copy_(new_data)
    scale.copy_(new_scale)
    amax.copy_(new_amax)
    valid.fill_(1.0)


# A store's hook runs in autograd's backward, outside any compiled graph. As eager ops the accumulation was a
# dozen passes over FP32 temporaries of the weight's shape: on the d4096 proxy torchao's and te's O2 ran 22-26 ms a
# step slower than their default storage (fused: torchao 2-3 ms, te 8 ms), four 0.49 GiB temporaries live at the peak
# (results/gpu/2026-11-27-h200-memory-8951179). Fused, it reads the stored bytes and the gradient twice (the amax,
# then the cast) and writes the new bytes once. Two compiled passes and aten's between them: the rows' amaxes
# (`_row_amaxes`), their amax (`amax_of_rows`), the cast (`_requantized`). With the last reduction compiled too, it ran
# as one program per weight: 0.54 ms of a 0.9 ms accumulation, 9 ms a step of te's and torchao's O2 with FP8
# activations on the d4096 proxy (results/gpu/2026-11-28-h200-act8-peak-05e9f2d, te_peaks and loss.peak:
# `triton_red_fused__to_copy_abs_add_amax_bitwise_and_clamp_..._reciproc...`, 34 calls in two steps, 18 ms; not in
# the same configuration's table at 62ecff5: how it compiles depends on what the process compiled it for first).
def _total(data: torch.Tensor, scale: torch.Tensor, valid: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The stored gradient's true values (zeros where `valid` is not > 0) plus `grad`, in FP32."""
    previous = torch.where(valid > 0, data.float() / scale, torch.zeros((), device=data.device))
    return previous + grad.float()


@cuda_fused
def _row_amaxes(data: torch.Tensor, scale: torch.Tensor, valid: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """max(|total|) of each of `reduction_rows`' rows of the sum (one row eager); NaN kept."""
    return reduction_rows(_total(data, scale, valid, grad).abs()).amax(dim=1)


@cuda_fused
def _requantized(data: torch.Tensor, scale: torch.Tensor, valid: torch.Tensor, grad: torch.Tensor,
                 total_amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sum in the store's dtype and its scale: E4M3 with a power-of-two scale from `total_amax` (the old one
    where that is 0, inf or NaN; an inf element becomes NaN), or BF16 with scale 1."""
    total = _total(data, scale, valid, grad)
    if data.dtype == torch.float8_e4m3fn:
        new_scale = compute_scale(total_amax, data.dtype, previous=scale)
        return quantize(total, new_scale, data.dtype), new_scale
    return total.to(data.dtype), torch.ones_like(scale)  # clipping may have divided the old scale


def accumulated(data: torch.Tensor, scale: torch.Tensor, valid: torch.Tensor, grad: torch.Tensor,
                row_amaxes=_row_amaxes, requantized=_requantized) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(data, scale, amax) of the stored gradient `data / scale` (none where `valid` is not > 0) plus `grad`: E4M3
    with a new power-of-two scale from the sum's amax (the old one where that amax is 0, inf or NaN; an inf element
    becomes NaN), or BF16 with scale 1."""
    total_amax = amax_of_rows(row_amaxes, data, scale, valid, grad)
    new_data, new_scale = requantized(data, scale, valid, grad, total_amax)
    return new_data, new_scale, total_amax


accumulated.eager = functools.partial(  # the definition, for tests
    accumulated, row_amaxes=_row_amaxes.eager, requantized=_requantized.eager)


def install_grad_stores(modules: list[nn.Module], dtype: torch.dtype) -> list[GradStore]:
    """One store per module's `weight` (each weight once, so a shared weight gets one store)."""
    stores, seen = [], set()
    for module in modules:
        weight = getattr(module, "weight", None)
        if not isinstance(weight, nn.Parameter) or not weight.requires_grad or id(weight) in seen:
            continue
        seen.add(id(weight))
        stores.append(GradStore(module, dtype))
    return stores


def ignore_in_ddp(root: nn.Module, modules, buffer_prefix: str = _PREFIX, *, weights: bool = True) -> None:
    """DDP must neither all-reduce the weights of `modules` (their gradients are not in .grad) nor
    broadcast their buffers whose names start with `buffer_prefix` (rank-local gradients and
    scales); FP8GradReducer averages the gradients instead. `buffer_prefix=""`: every buffer;
    `weights=False`: the buffers only (a frozen weight, which DDP broadcasts and never reduces)."""
    wanted = {id(m) for m in modules}
    names = []
    for prefix, module in root.named_modules():
        if id(module) in wanted:
            dot = prefix + "." if prefix else ""
            if weights:
                names.append(dot + "weight")
            names += [dot + name for name, _ in module.named_buffers(recurse=False) if name.startswith(buffer_prefix)]
    existing = list(getattr(root, "_ddp_params_and_buffers_to_ignore", []))
    torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(root, existing + names)


def clear_grad_stores(stores) -> None:
    """Mark every store empty (what `zero_grad` does to `.grad`)."""
    if stores:
        torch._foreach_zero_([store.fp8_grad_valid for store in stores])


def clear_in_zero_grad(model: nn.Module, holders) -> None:
    """`model.zero_grad()` also clears gradients kept outside `.grad` (as in MS-AMP).

    `holders` are stores or msamp FP8Linear layers. A partial of module-level code (not a closure),
    so the model still pickles and deep-copies.
    """
    if holders and getattr(model.zero_grad, "func", None) is not _zero_grad:
        model.zero_grad = functools.partial(_zero_grad, model.zero_grad, list(holders))


def _zero_grad(original, holders, set_to_none: bool = True) -> None:
    original(set_to_none)
    clear_grad_stores(holders)


def fp8_grad_norms(stores, norm_type: float) -> torch.Tensor | None:
    """Per-store `norm_type` norms of the true (dequantised) gradients, or None without stores."""
    if not stores:
        return None
    return torch.stack([_stored_norm(store.fp8_grad_data, store.fp8_grad_scale, store.fp8_grad_valid, norm_type)
                        for store in stores])


@cuda_fused
def _row_norms(data: torch.Tensor, scale: torch.Tensor, valid: torch.Tensor, norm_type: float) -> torch.Tensor:
    """The `norm_type` norms of the rows (`reduction_rows`: padded rows when compiled, on CUDA; one row eager) of a
    stored gradient's true values (zeros without one). The padding is neutral: 0, or inf for a negative order
    (|inf|**p = 0)."""
    grad = data.float() / scale
    rows = reduction_rows(torch.where(valid > 0, grad, torch.zeros_like(grad)), math.inf if norm_type < 0 else 0.0)
    return torch.linalg.vector_norm(rows, norm_type, dim=1)


def _stored_norm(data: torch.Tensor, scale: torch.Tensor, valid: torch.Tensor, norm_type: float,
                 row_norms=_row_norms) -> torch.Tensor:
    """The `norm_type` norm of a stored gradient's true values (0 without one): the norm of its rows' norms, which
    is the norm, but for order 0 (a count of non-zeros, summed). The rows' norms are the compiled kernel; the last
    reduction, over a few thousand values, is aten's: compiled for every length, inductor ran it as one program of
    0.34 ms (28 a step under ZeRO-2 at O3: results/gpu/2026-11-27-h200x2-matrix-7ec8725)."""
    per_row = row_norms(data, scale, valid, norm_type)
    return per_row.sum() if norm_type == 0 else torch.linalg.vector_norm(per_row, norm_type)


_stored_norm.eager = functools.partial(_stored_norm, row_norms=_row_norms.eager)  # the definition, for tests


@torch.no_grad()
def clip_grad_norm_(parameters, stores, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` over `parameters`' `.grad` plus the stored gradients of those
    parameters.

    The norm is of the true (dequantised) gradients. Clipping a stored gradient only divides its
    scale (a metadata change, as in MS-AMP); the stored bytes are untouched.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    parameters = list(parameters)
    wanted = {id(p) for p in parameters}
    stores = [store for store in stores if id(store.weight) in wanted]
    grads = [p.grad for p in parameters if p.grad is not None]
    norm_type = float(norm_type)
    parts = []
    if grads:
        parts.append(torch.stack([torch.linalg.vector_norm(g.float(), norm_type) for g in grads]))
    stored = fp8_grad_norms(stores, norm_type)
    if stored is not None:
        parts.append(stored)
    if not parts:
        return torch.tensor(0.0)
    device = parts[0].device
    norms = torch.cat([p.to(device) for p in parts])
    total = norms.max() if norm_type == float("inf") else torch.linalg.vector_norm(norms, norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"The total norm of order {norm_type} for gradients is non-finite, so it cannot be clipped")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].device))
    for store in stores:
        store.fp8_grad_scale.div_(coef)
        store.fp8_grad_amax.mul_(coef)
    return total
