"""`FP8RecipeKwargs(optimizer_in_backward=True)`: each parameter's optimizer step runs in backward, as soon as
autograd has accumulated its gradient, and its `.grad` is freed there.

Where FP8 activations have taken the saved tensors down, what is left at the peak of a model with FP32 weights and
Adam moments (torchao, te) is the model state plus every parameter's FP32 gradient at the end of the backward: on
one H200 (d4096 proxy) torchao with `activation_dtype="fp8"` held 13.87 GiB of weights and moments and peaked at
19.83 in backward, the gradients 4.6 GiB of the difference (results/gpu/2026-11-28-h200-act8-steady-2a04d10). Stepped
in backward, no more than the gradients autograd is still accumulating exist at once (torchtitan and torchtune
offer the same: "optimizer in backward"). The step is the user's optimizer's own, on one parameter at a time, so
the arithmetic is that of `optimizer.step()` over all of them, and the optimizer's state, `state_dict()` and LR
schedulers are unchanged; `optimizer.step()` after backward then finds no gradient left and only runs its hooks.

What it cannot be: gradients are never all there at once, so `accelerator.clip_grad_norm_` is refused; they are
stepped before any data-parallel reduction could reach them, so it is one process only (DDP, FSDP and DeepSpeed
reduce `.grad` after autograd accumulates it: refused there); a backend that keeps weight gradients outside `.grad`
(msamp, the levels' `weight_grad_dtype`) or te's `fp8_weights` (TE's FusedAdam) is refused by the recipe. Under
`accelerator.accumulate()` the steps run with the micro-batch that synchronises, as `optimizer.step()` would. A model
compiled as one graph hands autograd every gradient at once, at the end of its backward graph: the saving needs the
model compiled block by block (Accelerate's regional compilation) or eager.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..utils.hooks import weak_post_accumulate_grad_hook

FIELD = "FP8RecipeKwargs.optimizer_in_backward"
_HANDLES = "_lowprec_steps_in_backward"


def engine_problem(engine: str, processes: int) -> str | None:
    """Why steps in backward cannot run under `engine` with `processes` processes, or None."""
    if processes > 1 or engine != "single":
        return (f"{FIELD}=True steps each parameter as autograd accumulates its gradient, before DDP, FSDP or "
                f"DeepSpeed reduce gradients across ranks: one process only (this run: engine {engine!r}, "
                f"{processes} processes). Leave it unset here")
    return None


def _raw_step(optimizer: torch.optim.Optimizer) -> Callable[[torch.optim.Optimizer], object]:
    # torch wraps each optimizer class's step in its hook runner: the per-parameter steps skip the hooks, which run
    # once, in the optimizer.step() the training loop still calls
    step = type(optimizer).step
    return getattr(step, "__wrapped__", step)


class StepsInBackward:
    """Per-parameter steps of `optimizer` (the bare torch optimizer, not Accelerate's wrapper) from its parameters'
    post-accumulate-grad hooks, while `syncing()` is true."""

    def __init__(self, optimizer: torch.optim.Optimizer, syncing: Callable[[], bool]):
        if getattr(optimizer, _HANDLES, None) is not None:
            raise ValueError(f"{FIELD}: this optimizer already steps in backward")
        self.optimizer = optimizer
        self.syncing = syncing
        self.step = _raw_step(optimizer)
        self.handles = []
        # parameters stepped since the last optimizer.step(): a second backward before it would step them again,
        # where optimizer.step() would have taken the two gradients' sum once
        self.stepped: set[int] = set()
        seen: set[int] = set()
        for index, group in enumerate(optimizer.param_groups):
            for param in group["params"]:
                if id(param) in seen or not param.requires_grad:
                    continue
                seen.add(id(param))
                self.handles.append(weak_post_accumulate_grad_hook(
                    param, self, lambda steps, tensor, index=index: steps.on_gradient(index, tensor)))
        # in the optimizer's own dict, where the collector sees the cycle back to it: a strong reference is fine
        self.handles.append(optimizer.register_step_post_hook(lambda *_args, **_kwargs: self.stepped.clear()))
        setattr(optimizer, _HANDLES, self)  # the optimizer keeps this alive; the hooks hold it weakly

    def on_gradient(self, index: int, param: torch.Tensor) -> None:
        """`param`'s gradient accumulated: step it with its group (the `index`-th) and free the gradient."""
        if param.grad is None or not self.syncing():
            return  # accumulating micro-batches: the step comes with the one that synchronises
        if id(param) in self.stepped:
            raise RuntimeError(
                f"{FIELD}=True: a second backward reached a parameter already stepped in an earlier one, with no "
                "optimizer.step() between them; optimizer.step() would have stepped once with the gradients' "
                "sum. Call optimizer.step() after each backward, accumulate under accelerator.accumulate(), or "
                "leave optimizer_in_backward unset")
        self.stepped.add(id(param))
        # the group by its place, looked up now: load_state_dict replaces the group dicts (and their LR)
        self.step_one(self.optimizer.param_groups[index], param)
        param.grad = None  # the point: the gradient's memory goes back now, not after the whole backward

    def step_one(self, group: dict, param: torch.Tensor) -> None:
        """The optimizer's own step over `param` alone: its group's hyperparameters (an LR scheduler's too), its
        state entry, the same kernel as over the whole list."""
        optimizer = self.optimizer
        groups, params = optimizer.param_groups, group["params"]
        optimizer.param_groups, group["params"] = [group], [param]
        try:
            with torch.no_grad():
                self.step(optimizer)
        finally:
            optimizer.param_groups, group["params"] = groups, params

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        setattr(self.optimizer, _HANDLES, None)


def steps_in_backward(optimizer) -> StepsInBackward | None:
    """The StepsInBackward installed on `optimizer` (or on the optimizer Accelerate's wrapper holds), or None."""
    return getattr(getattr(optimizer, "optimizer", optimizer), _HANDLES, None)


def install(optimizers, gradient_state) -> list[StepsInBackward]:
    """Steps in backward for each prepared optimizer, synchronised with Accelerate's `gradient_state`."""
    return [StepsInBackward(getattr(opt, "optimizer", opt), lambda: gradient_state.sync_gradients)
            for opt in optimizers]


def refuse_clipping(optimizers, what: str = "clip_grad_norm_") -> None:
    """Clipping (`what`) where an optimizer steps in backward: its gradients are gone by then."""
    if any(steps_in_backward(opt) is not None for opt in optimizers):
        raise ValueError(
            f"{what} with {FIELD}=True: each parameter was stepped and its gradient freed during backward, "
            "so no moment holds all gradients to measure or clip. Train without clipping, or leave "
            "optimizer_in_backward unset")
