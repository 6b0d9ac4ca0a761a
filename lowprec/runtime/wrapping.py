"""Wrappers around the methods of prepared objects: a model's forward in the backend's FP8 context, and a
replacement optimizer's step marked the way LR schedulers expect; and the models a prepared model wraps."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterator

import torch
from torch import nn


def wrap_forward(model: nn.Module, context_factory) -> None:
    forward = model.forward

    @functools.wraps(forward)
    def forward_in_context(*args, **kwargs):
        with context_factory():
            return forward(*args, **kwargs)

    model.forward = forward_in_context


def track_step_for_scheduler(optimizer: torch.optim.Optimizer) -> None:
    """Mark steps of a replacement optimizer as torch's LR schedulers do for the optimizer they were
    built on; otherwise every `scheduler.step()` warns that `optimizer.step()` was overridden."""
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    step = optimizer.step
    optimizer_ref = weakref.ref(optimizer)

    @functools.wraps(step)
    def wrapper(*args, **kwargs):
        opt = optimizer_ref()
        if opt is not None:
            opt._opt_called = True
        return step(*args, **kwargs)

    wrapper._wrapped_by_lr_sched = True
    optimizer.step = wrapper


def models_of(*models: nn.Module) -> Iterator[nn.Module]:
    """`models` and what they wrap, each once, outermost first: a wrapper's (DDP, DeepSpeed) `.module`, a compiled
    model's `_orig_mod`, the one Accelerate's regional compilation keeps beside the copy of the model it
    compiles (a plain attribute there), and a PEFT model's base model (`get_base_model()`)."""
    seen, todo = set(), list(models)
    while todo:
        candidate = todo.pop(0)
        if candidate is None or id(candidate) in seen:
            continue
        seen.add(id(candidate))
        yield candidate
        base = getattr(candidate, "get_base_model", None)
        todo += [getattr(candidate, "_orig_mod", None), getattr(candidate, "module", None),
                 base() if callable(base) else None]
