"""Build a `PrecisionPlan`: choose the backend adapter for a recipe and a run context, let it select
and describe the modules."""

from __future__ import annotations

import dataclasses
import warnings
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..backends import RunContext, create_backend, describe_choice
from ..frontend import named_recipes
from ..frontend.recipe import unapplied_launcher_defaults
from ..planning.activations import saved_activations
from ..planning.hardware import DeviceInfo, assumed_device, device_info
from ..planning.plan import PrecisionPlan, short_dtype
from ..planning.selection import find_blocks, select_modules
from ..planning.speed import unmeasured_note
from .activations_fp32 import fp32_policy
from .activations_in_graph import graphs_store_fp8
from .compile_options import act8_settings
from .fp8_copies_recompute import setting as recompute_setting
from .loss import loss_storage
from .steps_in_backward import engine_problem

if TYPE_CHECKING:
    from ..backends.base import Backend
    from ..frontend.recipe import FP8RecipeKwargs


def _param_dtype(model: nn.Module, engine: str = "single") -> torch.dtype:
    """The dtype most parameter elements are held in during training. Under FSDP2 Accelerate upcasts every
    trainable parameter to FP32 when mixed precision is on (as it is for FP8), so a BF16 model trains on FP32
    masters there."""
    counts: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.is_floating_point():
            dtype = torch.float32 if engine == "fsdp2" and p.requires_grad else p.dtype
            counts[dtype] = counts.get(dtype, 0) + p.numel()
    return max(counts, key=counts.get) if counts else torch.float32


FROZEN = "frozen (requires_grad=False): no gradient to store"


def _mark_frozen(model: nn.Module, modules: list, backend: Backend, param_dtype: torch.dtype) -> list:
    """`modules` with each converted Linear whose weight is frozen saying it gets no gradient store.

    Its GEMMs still run in FP8 (a compute choice, as for any layer); a store would hold nothing."""
    if not backend.stores_weight_grads(param_dtype):
        return modules
    out = []
    for d in modules:
        weight = getattr(model.get_submodule("" if d.fqn == "<root>" else d.fqn), "weight", None)
        if d.convert and d.kind == "linear" and isinstance(weight, nn.Parameter) and not weight.requires_grad:
            d = dataclasses.replace(d, reason=f"FP8, {FROZEN}")
        out.append(d)
    return out


def model_mode(context: RunContext) -> str:
    """'eager', or how the model is compiled and, where the run's own arguments did not ask for it, why."""
    if not context.compiled:
        return "eager"
    return "compiled (torch.compile)" + (f": {context.compile_source}" if context.compile_source else "")


def kv_cache_note(model: nn.Module, compiled: bool) -> str | None:
    """What to say of a compiled Hugging Face model that builds a KV cache in training (`config.use_cache`, True by
    default): each decoder block then guards on the cache's state and, compiled block by block (Accelerate's
    regional compilation), compiles a graph of its own; past dynamo's recompile limit (8) the remaining blocks run
    eager. A 10-block Llama recompiled 9 times with the cache, once without (CPU, `TORCH_LOGS=recompiles`)."""
    config = getattr(model, "config", None)
    if not compiled or not getattr(config, "use_cache", False):
        return None
    return ("the model builds a KV cache in training (model.config.use_cache=True): compiled block by block, each "
            "decoder block then compiles a graph of its own, and past torch's recompile limit (8) the rest run eager "
            "with no FP8 fusion; set model.config.use_cache = False for training")


def build_plan(
    model: nn.Module,
    recipe: FP8RecipeKwargs,
    *,
    context: RunContext | None = None,
    backend: Backend | None = None,
) -> PrecisionPlan:
    """Resolve `recipe` against `model` on `context` (default: this machine, one process).

    Args:
        model: the model as the user built it (meta-device models work: only shapes are read).
        recipe: the FP8 handler.
        context: device and distributed engine the plan is for.
        backend: an already-created adapter for `recipe` (the Accelerator passes its own).

    Returns:
        The plan. Raises `BackendUnavailableError` if the backend cannot run here.
    """
    if context is None:
        context = RunContext(device=device_info())
    if backend is None:
        backend = create_backend(recipe, context)
    param_dtype = _param_dtype(model, context.engine)
    plan = PrecisionPlan(
        backend=backend.name,
        backend_display=backend.display_name,
        recipe=backend.recipe_name,
        fp8_format=backend.fp8_format,
        opt_level=backend.opt_level,
        emulated=backend.emulated,
        execution=backend.execution_note,
        device=context.device.describe(),
        engine=context.engine,
        world_size=context.world_size,
        tensors=[],
        modules=_mark_frozen(model, select_modules(model, backend.recipe, backend), backend, param_dtype),
        param_dtype=short_dtype(param_dtype),
        bytes_per_param={},
        total_params=sum(p.numel() for p in model.parameters()),
        options=backend.effective_options(),
        model_mode=model_mode(context),
        choice=describe_choice(recipe, context),
    )
    if recipe.optimizer_in_backward and (problem := engine_problem(context.engine, context.world_size)):
        raise ValueError(problem)
    plan.tensors = backend.tensor_precisions(plan)
    if recipe.optimizer_in_backward:  # the row says when they exist: one parameter's at a time
        plan.tensors = [dataclasses.replace(t, scaling="each stepped by the optimizer in backward once accumulated, "
                                            "then freed (optimizer_in_backward)") if t.kind == "weight_grad" else t
                        for t in plan.tensors]
    _check_rows(backend, plan.tensors)
    plan.bytes_per_param = backend.model_state_bytes(plan, param_dtype)
    found = find_blocks(model)
    blocks = None if found is None else (found[0], len(found[1]), type(found[1][0]).__name__)
    in_graph = graphs_store_fp8(recipe, context)
    recompute = recompute_setting()  # a bad value is refused here, whatever the configuration
    plan.activations = saved_activations(plan.modules, backend.saved_linear_input(), recipe.activation_dtype, blocks,
                                         compiled=context.compiled, in_graph=in_graph,
                                         recompute_fp8_copies=in_graph and recompute is not False,
                                         loss=loss_storage(model, recipe.activation_dtype),
                                         fp32=fp32_policy() if recipe.activation_dtype == "fp8" else "fp8")
    plan.notes = backend.notes(plan) + backend.communication.notes()
    cache = kv_cache_note(model, context.compiled)
    if cache is not None:
        plan.notes.append(cache)
        warnings.warn(f"lowprec: {cache}", stacklevel=4)
    settings = act8_settings(recipe, context)
    if settings:
        plan.notes.append(f"compiled with inductor's {', '.join(f'{k}={v}' for k, v in settings.items())} where the "
                          "dynamo plugin's options do not set it: the FP8 activations' decodes stay in the backward "
                          "kernels that read them, not stored in FP32 (LOWPREC_ACT8_COMPILE_OPTIONS=0: compiled as "
                          "the plugin says)")
    if recipe.activation_dtype == "fp8" and not in_graph:
        plan.notes.append(_hooks_note(context))
    if recipe.optimizer_in_backward:
        plan.notes.append("optimizer_in_backward: each parameter's optimizer step runs in backward once autograd has "
                          "accumulated its gradient, which is freed there (the gradients never all exist at once); "
                          "optimizer.step() then only runs its hooks; gradient clipping is refused")
    if recompute is True and not in_graph:
        plan.notes.append("LOWPREC_RECOMPUTE_FP8_COPIES=1 does nothing here: it acts in compiled graphs that store "
                          "their saved tensors in FP8 themselves (activation_dtype='fp8', a compiled model)")
    compiles, _ = backend.layer_compile()
    if compiles and plan.converted:
        plan.notes.append(
            f"eager model: each of the {len(plan.converted)} FP8 layers is compiled by torch.compile (casts, amaxes "
            f"and transposes fused; the first steps take longer while it compiles{backend.later_compiles()}); "
            "compile_fp8_layers=False keeps them eager, dynamo_backend='inductor' compiles the whole model instead")
    if backend.recipe.skip_slow_shapes and backend.speed_scaling is not None:
        note = unmeasured_note(context.device, backend.speed_scaling)
        if note is not None:
            plan.notes.append(note)
    written = recipe.recipe
    if written is not None and written != backend.recipe_name:
        plan.notes.insert(0, f"recipe {written!r} is {backend.display_name}'s {backend.recipe_name!r}: "
                             f"{backend.info.summary}")
    if recipe.name is not None:
        named = named_recipes.lookup(recipe.name)
        plan.notes.insert(0, f"named recipe {named.name!r} ({named.source}): {named_recipes.describe(named)}; "
                             "fields set explicitly win over it")
    unapplied = unapplied_launcher_defaults(recipe, plan.options)
    if unapplied:
        plan.notes.append(
            "accelerate launch exported its own defaults " + ", ".join(unapplied) + ", as it does on every "
            "--mixed_precision fp8 run; a value equal to the launcher's default is not applied (lowprec cannot tell "
            "it from one written in fp8_config). To apply one, set the field in FP8RecipeKwargs or write its key as "
            "`lowprec_<key>:` in fp8_config")
    if not plan.converted:
        plan.notes.insert(0, "no module runs in FP8 with this recipe and model: training is high precision throughout")
    return plan


def _hooks_note(context: RunContext) -> str:
    """What FP8 activations cost where they are encoded from Python hooks, and what avoids it."""
    note = ("activation_dtype='fp8' through Python hooks: each saved tensor is encoded by a kernel of its own from a "
            "Python call and decoded the same way, which costs time in a step the host bounds (docs/performance.md: "
            "msamp O3 under FSDP2, 0.86-1.13x BF16's speed in four runs on two H200s); ")
    if context.engine == "single" and context.compiled:  # LOWPREC_FP8_ACTIVATIONS_IN_GRAPH=0, or a torch before 2.8
        return note + ("compiled graphs encode inside them where LOWPREC_FP8_ACTIVATIONS_IN_GRAPH is not 0 and torch "
                       "inlines saved-tensor hooks (2.8 and later)")
    if context.engine == "single":
        return note + ("compiling the model through Accelerate (dynamo_backend='inductor') encodes inside the "
                       "compiled graphs instead")
    return note + (f"under {context.engine} that is the default; LOWPREC_FP8_ACTIVATIONS_IN_GRAPH=1 with the model "
                   "compiled through Accelerate encodes inside the compiled graphs (measured on one process only)")


def plan_for(model: nn.Module, recipe: FP8RecipeKwargs, *, capability: str | None = None,
             engine: str = "single", world_size: int = 1, hosts: int = 1) -> PrecisionPlan:
    """Plan for an assumed device (`capability` like '9.0', or None for this machine), `world_size` processes on
    `hosts` machines."""
    device: DeviceInfo = device_info() if capability is None else assumed_device(capability)
    return build_plan(model, recipe, context=RunContext(device=device, engine=engine, world_size=world_size,
                                                        hosts=hosts))


def _check_rows(backend, rows) -> None:
    """Every kind of the precision table exactly once: a missing row would surface much later as a bare
    StopIteration from `PrecisionPlan.tensor` (verifying the optimizer, printing the plan)."""
    from ..planning.plan import TENSOR_KINDS

    kinds = [row.kind for row in rows]
    missing = [k for k in TENSOR_KINDS if k not in kinds]
    extra = sorted({k for k in kinds if k not in TENSOR_KINDS or kinds.count(k) > 1})
    if missing or extra:
        raise TypeError(
            f"{type(backend).__name__}.tensor_precisions() must give one row per kind of {list(TENSOR_KINDS)}; "
            + "; ".join(part for part in (f"missing {missing}" if missing else "",
                                          f"unknown or repeated {extra}" if extra else "") if part)
            + ". Define gemm_precision(plan) and leave the other rows to the base class (lowprec/backends/base.py)"
        )

