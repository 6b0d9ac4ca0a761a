"""Gradient clipping through lowprec's Accelerator (lowprec/runtime/clipping.py): `clip_grad_value_` refused where a
backend keeps weight gradients outside `.grad` (it would leave them unclipped), and as torch's elsewhere."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


def _prepared(**fields):
    from lowprec import Accelerator, FP8RecipeKwargs

    torch.manual_seed(0)
    accelerator = Accelerator(mixed_precision="fp8", lowprec_quiet=True,
                              kwargs_handlers=[FP8RecipeKwargs(skip_slow_shapes=False, **fields)])
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    accelerator.backward(model(torch.randn(8, 64)).float().square().mean() * 1e3)
    return accelerator, model


def test_clip_grad_value_is_refused_where_weight_gradients_live_outside_grad():
    accelerator, model = _prepared(backend="msamp", opt_level="O2")
    with pytest.raises(ValueError, match=r"clip_grad_value_ with backend='msamp'.*accelerator.clip_grad_norm_"):
        accelerator.clip_grad_value_(model.parameters(), 0.01)
    assert accelerator.clip_grad_norm_(model.parameters(), 1.0) > 0  # the supported way counts them


def test_clip_grad_value_clamps_every_gradient_where_all_are_in_grad():
    accelerator, model = _prepared(backend="torchao")
    assert max(float(p.grad.abs().max()) for p in model.parameters()) > 0.01
    accelerator.clip_grad_value_(model.parameters(), 0.01)
    assert max(float(p.grad.abs().max()) for p in model.parameters()) <= 0.01


def test_clip_grad_value_is_refused_with_steps_in_backward():
    accelerator, model = _prepared(backend="torchao", optimizer_in_backward=True)
    with pytest.raises(ValueError, match=r"clip_grad_value_ with FP8RecipeKwargs.optimizer_in_backward=True"):
        accelerator.clip_grad_value_(model.parameters(), 0.01)
