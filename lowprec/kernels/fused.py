"""Eager chains of elementwise ops fused into one kernel on CUDA by inductor.

Code that runs outside any compiled graph (FSDP2's all-gather and reduce-scatter hooks, the steps'
scale updates) would otherwise run a quantisation as five kernels over FP32 temporaries (float, inf to
NaN, scale, clamp, cast): on the d4096 proxy each block's FP8 all-gather took 4 ms of which one fused
pass needs a fraction (results/gpu/2026-11-25-h100-engines-world1). `cuda_fused` compiles such a
function once, with symbolic shapes, for CUDA tensors; on CPU, and inside a graph being traced (where
inductor fuses it anyway), the function runs as written, so its plain-torch body is the definition.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch

from . import triton_available

F = TypeVar("F", bound=Callable)

# Where the fused form runs. CUDA alone: on CPU inductor's compile time would outweigh what fusing saves
# (tests add "cpu" to check the compiled form against the definition without a GPU).
FUSED_DEVICE_TYPES: tuple[str, ...] = ("cuda",)


@functools.cache
def fp8_codegen(device_index: int) -> bool:
    """Whether inductor's Triton code can hold FP8 on this GPU: its `fp8e4nv` needs sm_89 or newer (on an
    A100 the compile fails, pytorch/pytorch#167082), where lowprec's FP8 runs emulated anyway."""
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


def fuses(tensor: torch.Tensor | None) -> bool:
    """Whether a `cuda_fused` function whose first tensor argument is `tensor` runs compiled: on a device type in
    FUSED_DEVICE_TYPES (a CUDA one with Triton and FP8 code generation), no graph being traced."""
    return (tensor is not None and tensor.device.type in FUSED_DEVICE_TYPES and not torch.compiler.is_compiling()
            and not (tensor.is_cuda and not (triton_available() and fp8_codegen(tensor.device.index or 0))))


def cuda_fused(fn: F) -> F:
    """`fn` compiled by inductor (dynamic shapes) when its first tensor argument is on a CUDA device with
    Triton and FP8 code generation (a device type in FUSED_DEVICE_TYPES) and no graph is being traced; `fn`
    itself otherwise. The compiled form runs with autocast off: `fn` does its own casts, and autocast's state
    is one more guard that would double the graphs toward dynamo's recompile limit."""
    compiled = None

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        nonlocal compiled
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if not fuses(first):
            return fn(*args, **kwargs)
        if compiled is None:
            # not fullgraph: past dynamo's recompile limit (many dtypes and ranks) a call runs eager, not fails
            compiled = torch.compile(fn, dynamic=True)
        with torch.autocast(first.device.type, enabled=False):
            return compiled(*args, **kwargs)

    wrapper.eager = fn  # the definition, for tests
    return wrapper  # type: ignore[return-value]


# A whole-tensor reduction that inductor compiles (in a `cuda_fused` function, or an amax in a compiled FP8 layer)
# goes over rows of REDUCTION_ROW elements first. Inductor compiles such code once for every length (dynamic
# shapes) and decides whether to split a reduction over a whole tensor from the length it first saw: on the d4096
# proxy every FP8 gradient norm (7 ms) and every O3 weight requantisation under ZeRO (14 ms) then ran as one
# program, 200 ms a step each on an H200 (results/gpu/2026-11-27-h200x2-profile-85a7575). Over rows, the
# tensor's shape holds the parallelism.
REDUCTION_ROW = 4096


def reduction_rows(tensor: torch.Tensor, fill: float = 0) -> torch.Tensor:
    """`tensor` as [rows, columns], so that a reduction over all of it is this one over dim 1, then over the
    rows, when `fill` leaves the reduction unchanged (0 for a sum or an amax of magnitudes, inf for a min).
    In a graph being traced, `padded_rows`; eager, one row, a view: aten's reductions split by the actual
    length, and padding would only copy. (The default is the int 0: dynamo lifts a float default into a float64
    input of the graph, made on every call.)"""
    if not torch.compiler.is_compiling():
        return tensor.reshape(1, -1)
    return padded_rows(tensor, fill)


def padded_rows(tensor: torch.Tensor, fill: float) -> torch.Tensor:
    """`tensor` flattened and padded with `fill` to whole rows of REDUCTION_ROW and one row more, as
    [rows, REDUCTION_ROW]. The extra row keeps the pad above 0 and the rows above 1 whatever the length:
    neither is then a case dynamo guards on, which would be one graph more of every compiled caller (a
    compiled layer's graphs count toward dynamo's limit). On CUDA the padding is a masked load, not a copy."""
    flat = tensor.reshape(-1)
    return torch.nn.functional.pad(flat, (0, -flat.numel() % REDUCTION_ROW + REDUCTION_ROW),
                                   value=fill).view(-1, REDUCTION_ROW)


def amax_of_rows(row_amax: Callable[..., torch.Tensor], tensor: torch.Tensor, *args) -> torch.Tensor:
    """`max(|...|)` over all of `tensor` as a float32 scalar (0 for an empty tensor, NaN kept), from `row_amax(tensor,
    *args)`'s per-row amaxes (a compiled pass that computes the values first, as the grad store's), their amax by
    aten: compiled for every length, inductor ran this last reduction as one program per tensor (0.54 ms for a
    d4096 weight's 14337 rows in the grad store's accumulation, results/gpu/2026-11-28-h200-act8-peak-05e9f2d; 0.34-
    0.44 ms for the whole accumulation with aten's, 2026-11-28-h200-act8-steady-2a04d10). Not for a pass that is
    only an amax before a compiled cast: O3's requantisation split so ran 10x slower than as one compiled function
    (`backends.msamp.fsdp._scaled_cast`)."""
    if tensor.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=tensor.device)
    return row_amax(tensor, *args).amax().float()


def amax_by_rows(tensor: torch.Tensor) -> torch.Tensor:
    """`max(|tensor|)` as a float32 scalar, 0 for an empty tensor (as `scaling.tensor_amax`), NaN kept; reduced
    over `reduction_rows`."""
    if tensor.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=tensor.device)
    return reduction_rows(tensor.detach().abs()).amax(dim=1).amax().float()


def sum_over_ranks(received: torch.Tensor) -> torch.Tensor:
    """The FP32 sum over dim 0 of `received` ([n, ...], n the ranks), added in order 0..n-1. Unrolled over
    the n rows (dynamo specialises n, the world size), so that on CUDA it is one elementwise kernel at memory
    speed: as `sum(0)` inductor made it a reduction over a symbolic n of 2, which took 7 ms for 487 M elements
    on an H200 (the FP8 gradient mean, results/gpu/2026-11-27-h200x2-matrix-187dca0)."""
    total = received[0].float()
    for row in range(1, received.shape[0]):
        total = total + received[row].float()
    return total
