"""`lowprec.Accelerator`: Accelerate's Accelerator with lowprec's FP8 path in place of its own.

Accelerate maps handlers by exact class and has FP8 paths of its own that would fight ours, so
this subclass (1) takes the FP8 handler out of `kwargs_handlers` and runs the rest of Accelerate
in BF16 autocast, which is what Accelerate's own FP8 mode amounts to for everything but the GEMMs,
(2) reports `fp8_backend` as NO so none of Accelerate's TE / torchao / MS-AMP branches fire, and
(3) in `prepare()` converts the model before it is wrapped (DDP, FSDP2, DeepSpeed) and installs
the backend's forward context, communication hooks and post-step hooks after it is wrapped.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

import torch
from accelerate import Accelerator as _Accelerator
from accelerate.utils.dataclasses import FP8BackendType
from torch import nn

from ..backends import Backend, RunContext, create_backend
from ..frontend.compat import is_fp8_handler, to_recipe
from ..frontend.recipe import FP8RecipeKwargs
from ..optim.low_bit_adam import LowBitAdamW
from ..planning.engines import apply_grad_comm_dtype, options_without_effect
from ..planning.plan import PrecisionPlan
from .activations import check_activation_dtype, install_activation_storage
from .checkpoints import ForeignBackendEntries, from_low_bit_states
from .clipping import GradientClipping
from .compile_options import act8_settings, compiling_with
from .console import print_plan_summary, quiet_requested
from .export import BACKEND_ATTR
from .health import FP8HealthMonitor
from .notices import warn_once
from .params import ReplacedParams, remap_optimizer_params
from .planner import build_plan
from .release import ReleasedOnFree
from .run_context import engine_plugin, inherited_dynamo, run_context_of, split_launch_warning
from .sharded_checkpoints import CheckedCheckpoints
from .steps_in_backward import engine_problem, install
from .wrapping import track_step_for_scheduler, wrap_forward

log = logging.getLogger(__name__)

_PLAN_ATTR = "_lowprec_plan"
_FINAL_ATTR = "_lowprec_finalized"


class Accelerator(CheckedCheckpoints, GradientClipping, ReleasedOnFree, _Accelerator):
    """Drop-in `accelerate.Accelerator` that trains in FP8 through lowprec.

    FP8 is on when `mixed_precision="fp8"` (argument or `ACCELERATE_MIXED_PRECISION`, as
    `accelerate launch --mixed_precision fp8` sets it) or when an FP8 handler is passed:
    `lowprec.FP8RecipeKwargs`, or Accelerate's `AORecipeKwargs` / `TERecipeKwargs` /
    `MSAMPRecipeKwargs` / `FP8RecipeKwargs`, which are translated. Without a handler the recipe is
    read from `ACCELERATE_FP8_*` (a config file's `fp8_config:` section). Everything else is Accelerate's but
    `save_state` / `load_state` (runtime/sharded_checkpoints.py: optimizer state completed, FSDP2 loads checked)
    and gradient clipping (runtime/clipping.py: gradients outside `.grad` counted, or refused where unseen).
    `prepare()` prints a summary of each FP8 model's precision plan to stderr on the main process;
    `lowprec_quiet=True` (None: the `LOWPREC_QUIET` environment variable, `1` or `0`) leaves it out.
    """

    def __init__(self, *args: Any, mixed_precision: str | None = None, kwargs_handlers: list | None = None,
                 lowprec_quiet: bool | None = None, **kwargs):
        self._quiet = quiet_requested(lowprec_quiet)
        handlers = list(kwargs_handlers or [])
        fp8_handlers = [h for h in handlers if is_fp8_handler(h)]
        others = [h for h in handlers if not is_fp8_handler(h)]
        if len(fp8_handlers) > 1:
            names = ", ".join(type(h).__name__ for h in fp8_handlers)
            raise ValueError(f"kwargs_handlers holds {len(fp8_handlers)} FP8 recipe handlers ({names}); pass one")
        if mixed_precision is not None and (not isinstance(mixed_precision, str) or not mixed_precision.strip()):
            # '' too, which Accelerate refuses: with an FP8 handler it read as unset
            raise (ValueError if isinstance(mixed_precision, str) else TypeError)(
                f"Accelerator(mixed_precision={mixed_precision!r}): give one of 'no', 'fp16', 'bf16', 'fp8' (a str), "
                "or None for the launcher's setting")
        requested = mixed_precision if mixed_precision is not None else os.environ.get("ACCELERATE_MIXED_PRECISION")
        requested = requested.lower() if requested else None
        recipe = None
        if fp8_handlers:
            if requested not in (None, "fp8"):
                raise ValueError(
                    f"kwargs_handlers holds an FP8 recipe ({type(fp8_handlers[0]).__name__}) but mixed_precision="
                    f"{requested!r}; use mixed_precision='fp8' (or leave it unset) to train in FP8"
                )
            recipe = to_recipe(fp8_handlers[0])
        elif requested == "fp8":
            recipe = FP8RecipeKwargs()
        inherited = inherited_dynamo(kwargs)
        self.fp8_recipe: FP8RecipeKwargs | None = recipe
        self._lowprec: list[tuple[nn.Module, Backend, PrecisionPlan]] = []
        self._health: list[FP8HealthMonitor] = []
        # Parameters conversion replaced -> their replacements, for optimizers prepared later.
        self._replaced_params = ReplacedParams()
        # Outside the FP8 GEMMs, FP8 training is BF16 autocast (as Accelerate's "fp8"); "bf16" also keeps
        # Accelerate from downgrading to FP16 on older GPUs.
        super().__init__(*args, mixed_precision="bf16" if recipe is not None else mixed_precision,
                         kwargs_handlers=others or None, **kwargs)
        self.fp8_enabled = recipe is not None
        split = split_launch_warning(self.num_processes)
        if split is not None:
            warn_once(split, stacklevel=3)
        # What compiles the model when this Accelerator's own arguments did not ask for it (see inherited_dynamo).
        self._compile_source = ""
        if inherited is not None:
            was, asked = inherited
            self._compile_source = (f"dynamo_backend={was} inherited from an earlier Accelerator in this process "
                                    "(Accelerate keeps one AcceleratorState per process)")
            what = "not compile the model" if was == "NO" else "compile the model"
            warnings.warn(
                f"lowprec: this Accelerator's defaults ask for dynamo_backend={asked}, but an earlier Accelerator in "
                f"this process set dynamo_backend={was}, and Accelerate keeps that (one AcceleratorState per process): "
                f"prepare() will {what}, and lowprec plans for that (speed rules, backend='auto''s order). Call "
                "accelerate.state.AcceleratorState._reset_state(reset_partial_state=True) before building this "
                "Accelerator, or run each configuration in its own process.",
                stacklevel=2,
            )
        if recipe is not None:
            # Fail here, not at prepare() (the backend is made again per model there): a missing package, no FP8
            # hardware with emulate=False, a recipe this device or engine cannot run. The reduction dtype in force
            # (the recipe's, or msamp O3's BF16 under FSDP2 on one host) goes to the engine's plugin before it wraps.
            context = self.run_context()
            check_activation_dtype(recipe.activation_dtype, self.state.dynamo_plugin if context.compiled else None,
                                   source=self._compile_source)
            apply_grad_comm_dtype(create_backend(recipe, context).grad_comm_choice, context.engine,
                                  engine_plugin(self.state, context.engine))
            create_backend(recipe, self.run_context())
            if recipe.optimizer_in_backward and (problem := engine_problem(context.engine, self.num_processes)):
                raise ValueError(problem)
            for option, why in options_without_effect(recipe, context.engine, self.num_processes):
                warnings.warn(f"lowprec: FP8RecipeKwargs.{option} has no effect in this run: {why}", stacklevel=2)

    # ---- what Accelerate sees ----------------------------------------------------------------
    @property
    def fp8_backend(self) -> FP8BackendType:
        # lowprec owns FP8: every Accelerate branch keyed on this must stay off, except the parameter
        # lookup below, for a backend whose weights need Accelerate's accessor (Backend.accelerate_parameter_lookup).
        if getattr(self, "_resolving_parameters", False):
            for _, backend, _ in self._lowprec:
                if backend.accelerate_parameter_lookup is not None:
                    return FP8BackendType[backend.accelerate_parameter_lookup]
        return FP8BackendType.NO

    def _get_named_parameters(self, *args, drop_refs: bool = False):
        # Under FSDP2 Accelerate remaps optimizer parameters by data_ptr(), with an accessor for weight
        # subclasses that it installs only for its own FP8 backends: see fp8_backend above.
        self._resolving_parameters = True
        try:
            return super()._get_named_parameters(*args, drop_refs=drop_refs)
        finally:
            self._resolving_parameters = False

    @property
    def mixed_precision(self) -> str:
        return "fp8" if self.fp8_recipe is not None else super().mixed_precision

    @property
    def precision_plans(self) -> list[PrecisionPlan]:
        """The plan of every model prepared so far, in order."""
        return [plan for _, _, plan in self._lowprec]

    @property
    def precision_plan(self) -> PrecisionPlan | None:
        """The plan of the last model prepared, or None without FP8."""
        return self._lowprec[-1][2] if self._lowprec else None

    def get_state_dict(self, model, unwrap: bool = True):
        """Accelerate's `get_state_dict`; with `unwrap=True` (what `save_model` uses) the result loads
        into the original, unconverted model: backend-only entries such as TE's `_extra_state` are
        dropped and FP8-only weights dequantised. `save_state` (unwrap=False) keeps everything,
        so training resumes exactly."""
        state_dict = super().get_state_dict(model, unwrap=unwrap)
        if unwrap and state_dict is not None:
            inner = self.unwrap_model(model, keep_torch_compile=False)
            for converted, backend, _ in self._lowprec:
                if converted is inner:
                    state_dict = backend.portable_state_dict(state_dict)
        return state_dict

    def run_context(self) -> RunContext:
        """The device and distributed engine plans are made for."""
        return run_context_of(self, self._compile_source)

    # ---- prepare -----------------------------------------------------------------------------
    def prepare(self, *args: Any, device_placement: list[bool] | None = None):
        if self.fp8_recipe is None:
            return super().prepare(*args, device_placement=device_placement)
        args = list(args)
        self._refuse_prepared_again(args)
        optimizers = [a for a in args if isinstance(a, torch.optim.Optimizer)]
        to_convert = [i for i, obj in enumerate(args)
                      if isinstance(obj, nn.Module) and getattr(obj, _PLAN_ATTR, None) is None]
        if to_convert:
            # Refuse an engine setting or an optimizer the backend cannot take before the model is changed in place.
            context = self.run_context()
            backend = create_backend(self.fp8_recipe, context)
            if context.engine == "deepspeed":
                problem = backend.engine_config_problem(self.state.deepspeed_plugin.deepspeed_config)
                if problem is not None:
                    raise ValueError(problem)
            if len(to_convert) == 1:
                for opt in optimizers:
                    backend.check_optimizer(getattr(opt, "optimizer", opt))
        converted = []
        self._models_in_call = len(to_convert)  # the summary's pointer to each plan (see _convert)
        for i in to_convert:
            args[i] = self._convert(args[i])
            converted.append(i)
        remap_optimizer_params(optimizers, self._replaced_params)
        # Optimizers prepared with the model, or later on their own when one model was converted.
        owner = None
        if optimizers and (len(converted) == 1 or (not converted and len(self._lowprec) == 1)):
            owner = self._lowprec[-1]
            _, backend, plan = owner
            replaced = {}
            for i, obj in enumerate(args):
                if isinstance(obj, torch.optim.Optimizer):
                    args[i] = backend.wrap_optimizer(obj, plan)
                    replaced[id(obj)] = args[i]
                    plan.verify_optimizer(args[i])
                    if not isinstance(args[i], LowBitAdamW):
                        # a checkpoint saved with low-bit states (another level) loads as FP32 moments, not as
                        # E4M3 bytes torch would read as numbers up to their scale (LowBitAdamW converts itself)
                        args[i].register_load_state_dict_pre_hook(from_low_bit_states)
            # An LR scheduler built on the user's optimizer must drive its replacement.
            for obj in args:
                if hasattr(obj, "optimizer") and id(obj.optimizer) in replaced:
                    obj.optimizer = replaced[id(obj.optimizer)]
                    if isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
                        track_step_for_scheduler(obj.optimizer)
        for _, backend, _ in self._lowprec:
            backend.before_engine_prepare(args, self)
        self._preparing = True
        try:
            with compiling_with(self.state.dynamo_plugin, act8_settings(self.fp8_recipe, self.run_context())):
                result = super().prepare(*args, device_placement=device_placement)
        finally:
            self._preparing = False
            for _, backend, _ in self._lowprec:
                backend.after_engine_prepare()
        # One prepared object comes back bare; several as a tuple (or a list on the FSDP2 path).
        results = tuple(result) if isinstance(result, (tuple, list)) and len(args) > 1 else (result,)
        for i in converted:
            self._finalize(results[i])
        if owner is not None:
            inner, backend, _ = owner
            hook = backend.post_optimizer_step(inner)
            if hook is not None:
                for opt in (r for r in results if isinstance(r, torch.optim.Optimizer)):
                    getattr(opt, "optimizer", opt).register_step_post_hook(lambda *_a, **_k: hook())
        elif converted:
            for _, backend, _ in self._lowprec[-len(converted):]:
                where = backend.gradients_outside_grad()
                if where:
                    warn_once(f"lowprec: backend={backend.name!r} keeps weight gradients {where}; only an optimizer "
                              "prepared by this Accelerator reads them. Pass the optimizer to prepare() (with the "
                              "model or right after it)")
        if self.fp8_recipe.optimizer_in_backward:  # every optimizer this call prepared, with a model or without
            install([r for r in results if isinstance(r, torch.optim.Optimizer)], self.gradient_state)
        return result

    def _refuse_prepared_again(self, args: list) -> None:
        """A model lowprec already converted, or an optimizer already prepared, handed to prepare() again: refused
        rather than half-prepared (passed over, msamp's FP8 weights trained with no plan and a plain optimizer)."""
        from accelerate.optimizer import AcceleratedOptimizer

        for obj in args:
            if isinstance(obj, AcceleratedOptimizer):
                raise ValueError(
                    "lowprec: prepare() got an optimizer that was already prepared (an AcceleratedOptimizer around "
                    f"{type(obj.optimizer).__name__}): pass the optimizer you built, once, with its model")
            if not isinstance(obj, nn.Module):
                continue
            inner = self.unwrap_model(obj, keep_torch_compile=False)
            plan = getattr(inner, _PLAN_ATTR, None) or getattr(obj, _PLAN_ATTR, None)
            if plan is None:
                continue
            what = (f"backend {plan.backend!r}, recipe {plan.recipe!r}" + (f", {plan.opt_level}" if plan.opt_level
                                                                           else ""))
            if any(entry[0] is inner for entry in self._lowprec):
                raise ValueError(
                    f"lowprec: model {type(inner).__name__} was already prepared by this Accelerator ({what}): "
                    "prepare() each model once; an optimizer built afterwards can be prepared on its own")
            raise ValueError(
                f"lowprec: model {type(inner).__name__} was already converted to FP8 by another lowprec.Accelerator "
                f"({what}). Its FP8 layers, gradient stores and hooks belong to that Accelerator: prepared here it "
                "would train without a plan or lowprec's optimizer. Prepare the original, unconverted model with "
                "this Accelerator, or load lowprec.portable_state_dict(model) into a fresh plain model and prepare "
                "that.")

    def backward(self, loss, **kwargs):
        super().backward(loss, **kwargs)
        for _, backend, _ in self._lowprec:
            backend.after_backward(self.sync_gradients)
        for monitor in self._health:
            monitor.after_backward(self.sync_gradients)

    def fp8_health(self, every: int = 100, out: str | None = None, model: nn.Module | None = None) -> FP8HealthMonitor:
        """Sample the FP8 casts of a prepared model's converted layers every `every` optimizer steps
        (`lowprec.runtime.health`): returns the monitor (`.table()`, `.latest`, `.remove()`); with `out`, each
        sample is appended there as a JSON line. Off unless called."""
        if not self._lowprec:
            raise RuntimeError("fp8_health() watches a model lowprec prepared: call it after prepare()")
        if model is None:
            inner, backend, _ = self._lowprec[-1]
        else:
            target = self.unwrap_model(model, keep_torch_compile=False)
            entry = next((e for e in self._lowprec if e[0] is target), None)
            if entry is None:
                raise ValueError("fp8_health(model=...): that model was not prepared with FP8 by this Accelerator")
            inner, backend, _ = entry
        monitor = FP8HealthMonitor(inner, backend, every, out=out if self.is_main_process else None)
        self._health.append(monitor)
        return monitor

    def prepare_model(self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False):
        if self.fp8_recipe is None:
            return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        if not getattr(self, "_preparing", False):  # called by the user, not from prepare() with the converted model
            self._refuse_prepared_again([model])
        if getattr(model, _PLAN_ATTR, None) is None:
            model = self._convert(model)
        with compiling_with(self.state.dynamo_plugin, act8_settings(self.fp8_recipe, self.run_context())):
            prepared = super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        self._finalize(prepared)
        return prepared

    def _convert(self, model: nn.Module) -> nn.Module:
        context = self.run_context()
        backend = create_backend(self.fp8_recipe, context)
        # the user's recipe (backend='auto' included): the plan says how the backend was chosen
        plan = build_plan(model, self.fp8_recipe, context=context, backend=backend)
        before = dict(model.named_parameters())
        with torch.no_grad():
            new = backend.convert(model, plan)
            backend.apply_storage(new)
        plan.verify(new, backend.is_converted)
        backend.verify_storage(new)
        after = dict(new.named_parameters())
        for name, p in before.items():
            if name in after and after[name] is not p:
                self._replaced_params.add(p, after[name])
        object.__setattr__(new, _PLAN_ATTR, plan)
        object.__setattr__(new, BACKEND_ATTR, backend)  # lowprec.portable_state_dict undoes its conversion
        self._lowprec.append((new, backend, plan))
        if self.is_main_process and not self._quiet:  # first: the warnings below are about this plan
            index = len(self._lowprec) - 1  # precision_plan is the last model's: name the others by index
            several = index > 0 or getattr(self, "_models_in_call", 1) > 1
            print_plan_summary(plan, type(model).__name__, f"print(accelerator.precision_plans[{index}])" if several
                               else "print(accelerator.precision_plan)")
        if plan.emulated:
            warn_once(f"lowprec: {plan.backend} runs {plan.execution}")
        if self.is_main_process:
            log.info("%s", plan)
            shortfall = plan.shortfall()
            if shortfall:
                # A warning, not only the summary (lowprec_quiet leaves that out) or the INFO log (unseen by
                # default): a run that trains in BF16 while asked for FP8 must not pass unnoticed. Not
                # warn_once: each model prepared gets its own, pointing at the user's prepare().
                warnings.warn(
                    f"lowprec: model {type(model).__name__}: " + "\n".join(shortfall)
                    + "\nOptions are lowprec.FP8RecipeKwargs fields (Accelerate's AORecipeKwargs has only "
                    "module_filter_func, which replaces both skip rules); print(accelerator.precision_plan) "
                    "lists every layer.",
                    stacklevel=3,
                )
        return new

    def _finalize(self, prepared: nn.Module) -> None:
        """After wrapping: forward context and communication hooks. Once per model."""
        if getattr(prepared, _FINAL_ATTR, False):
            return
        inner = self.unwrap_model(prepared, keep_torch_compile=False)
        entry = next((e for e in self._lowprec if e[0] is inner), None)
        if entry is None:
            return
        _, backend, plan = entry
        backend.setup_communication(prepared, plan)
        backend.setup_grad_stores(prepared)
        backend.setup_grad_comm(prepared)
        backend.compile_layers(inner)
        inner.register_load_state_dict_pre_hook(ForeignBackendEntries(plan, backend))
        context = backend.forward_context(inner)
        # No FP8 GEMM, no FP8 context: a model the plan kept in high precision trains as the plain one.
        if context is not None and plan.fp8_linear_param_fraction > 0:
            wrap_forward(prepared, context)
        if self.fp8_recipe.activation_dtype == "fp8":  # outermost: it sees every tensor the forward saves
            install_activation_storage(prepared, inner, converted=lambda m: backend.converted_kind(m) == "linear",
                                       keep_saved_by=backend.keeps_saved_tensors, compiled=backend.context.compiled,
                                       engine=backend.context.engine)
        object.__setattr__(prepared, _FINAL_ATTR, True)
        # old -> new Parameters, kept only while a model holds the new ones: FSDP2 shards them into others, O3
        # under ZeRO replaces its weights while being set up above
        self._replaced_params.keep_only(p for entry in self._lowprec for p in entry[0].parameters())

