"""Checkpoints that load into the original model, whichever backend trained it."""

from __future__ import annotations

from typing import Any

from torch import nn

from .backends.te_modules import portable_state_dict as _strip_backend_entries


def portable_state_dict(model: nn.Module) -> dict[str, Any]:
    """`model.state_dict()` as the unconverted model has it: no TE `_extra_state`, FP8-only weights
    dequantised to their nominal dtype. torchao's Float8Linear already saves plain tensors.

    Works on a model converted by any lowprec backend (and on an unconverted one: a no-op)."""
    return _strip_backend_entries(model.state_dict())
