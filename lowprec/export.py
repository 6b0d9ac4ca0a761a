"""Checkpoints that load into the original model, whichever backend trained it."""

from __future__ import annotations

from typing import Any

from torch import nn

from .backends import strip_backend_entries

BACKEND_ATTR = "_lowprec_backend"  # set on a converted model by lowprec.Accelerator


def portable_state_dict(model: nn.Module) -> dict[str, Any]:
    """`model.state_dict()` as the unconverted model has it: no backend-only entries (TE's `_extra_state`,
    msamp's scaling metadata), FP8-only weights dequantised, weights kept in `weight_dtype` back in
    the dtype the model was built with. torchao's Float8Linear already saves plain tensors.

    A model prepared by `lowprec.Accelerator` (wrapped or not) is undone by the backend that converted
    it; any other model gets every backend's clean-up, which leaves a plain model's state dict as is."""
    inner = model
    for _ in range(4):  # DDP/FSDP `.module`, torch.compile's `_orig_mod`
        if hasattr(inner, BACKEND_ATTR):
            break
        inner = getattr(inner, "module", None) or getattr(inner, "_orig_mod", None) or inner
    backend = getattr(inner, BACKEND_ATTR, None)
    state_dict = model.state_dict()
    if backend is not None:
        return backend.portable_state_dict(state_dict)
    return strip_backend_entries(state_dict)
