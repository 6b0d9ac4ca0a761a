"""Triton kernels for CUDA devices; every kernel has a plain-torch definition it is tested against."""

from __future__ import annotations

from functools import cache


@cache
def triton_available() -> bool:
    import torch

    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
