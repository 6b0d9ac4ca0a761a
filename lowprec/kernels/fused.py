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
def _fp8_codegen(device_index: int) -> bool:
    """Whether inductor's Triton code can hold FP8 on this GPU: its `fp8e4nv` needs sm_89 or newer (on an
    A100 the compile fails, pytorch/pytorch#167082), where lowprec's FP8 runs emulated anyway."""
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


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
        if (first is None or first.device.type not in FUSED_DEVICE_TYPES or torch.compiler.is_compiling()
                or (first.is_cuda and not (triton_available() and _fp8_codegen(first.device.index or 0)))):
            return fn(*args, **kwargs)
        if compiled is None:
            # not fullgraph: past dynamo's recompile limit (many dtypes and ranks) a call runs eager, not fails
            compiled = torch.compile(fn, dynamic=True)
        with torch.autocast(first.device.type, enabled=False):
            return compiled(*args, **kwargs)

    wrapper.eager = fn  # the definition, for tests
    return wrapper  # type: ignore[return-value]
