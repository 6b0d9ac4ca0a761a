"""Inductor settings that lowprec's FP8 activations ask of the model's compilation, given through Accelerate's
dynamo plugin for the time the model is compiled.

A compiled graph that stores its saved tensors in FP8 itself (`activations_in_graph`) decodes them inside the kernels
of its backward: a SiLU backward over both halves of a fused gate/up output is then a chain of more than 30 ops,
inductor's default `realize_opcount_threshold`, and inductor stores it as an FP32 block instead of keeping it in the
kernels that read it; in msamp's warm-up steps the gradient whose amax sets its scale is stored as well. At 64, on
one H200 (d4096 proxy, results/gpu/2026-11-29-h200-act8-warmup-5b8dafa), msamp O2 with FP8 activations peaked at
0.453x compiled BF16's instead of 0.487x, at 1.5 ms a step (1.7%).

The threshold goes into `torch.compile`'s `options`, which inductor applies to this model's forward and backward
only (not as a process-wide setting); as `torch.compile` takes a `mode` or `options`, not both, a mode is spelt out
as its options (`torch._inductor.list_mode_options`). A threshold the user's own options give is kept.
`LOWPREC_ACT8_COMPILE_OPTIONS=0` leaves the plugin as it is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from ..utils.env import switch
from .activations_in_graph import graphs_store_fp8

ENV = "LOWPREC_ACT8_COMPILE_OPTIONS"
ACT8_OPTIONS = {"realize_opcount_threshold": 64}


def act8_options_requested() -> bool:
    """`LOWPREC_ACT8_COMPILE_OPTIONS`: 0 compiles a model with FP8 activations as the dynamo plugin says; unset or
    1 with ACT8_OPTIONS added."""
    return switch(ENV, "1 or unset: compile a model whose graphs store FP8 activations with inductor's "
                       f"{', '.join(f'{k}={v}' for k, v in ACT8_OPTIONS.items())}; 0: as the dynamo plugin "
                       "says") is not False


def compile_options(mode: str | None, options: dict | None, wanted: dict) -> dict:
    """`torch.compile` options that do what `mode` and `options` do, with `wanted`'s settings where they name none."""
    merged: dict = {}
    if mode not in (None, "default"):
        from torch._inductor import list_mode_options

        merged.update(list_mode_options(mode))
    merged.update(options or {})
    for key, value in wanted.items():
        merged.setdefault(key, value)
    return merged


def uses_inductor(plugin) -> bool:
    backend = getattr(plugin, "backend", None)
    return str(getattr(backend, "value", backend)).lower() == "inductor"


@contextlib.contextmanager
def compiling_with(plugin, wanted: dict) -> Iterator[None]:
    """Within: Accelerate's dynamo `plugin` (a TorchDynamoPlugin) compiles with `wanted`'s inductor settings too
    (`compile_options`); as it was after. Nothing changes without a plugin that compiles with inductor or without
    settings to add."""
    if plugin is None or not wanted or not uses_inductor(plugin):
        yield
        return
    mode, options = plugin.mode, plugin.options
    plugin.mode, plugin.options = None, compile_options(mode, options, wanted)
    try:
        yield
    finally:
        plugin.mode, plugin.options = mode, options


def act8_settings(recipe, context) -> dict:
    """The inductor settings a model prepared with `recipe` under `context` (a RunContext) is compiled with:
    ACT8_OPTIONS where its graphs store their saved tensors in FP8 themselves, else none."""
    if recipe is None or not context.compiled or not graphs_store_fp8(recipe, context):
        return {}
    return dict(ACT8_OPTIONS) if act8_options_requested() else {}
