"""TorchAO float8 adapter: `nn.Linear` -> torchao `Float8Linear` through torchao's public API."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..frontend.specs import backend_spec
from ..utils.imports import require
from ..utils.modules import own_class
from .base import Backend

if TYPE_CHECKING:
    from ..planning.activations import SavedInput
    from ..planning.plan import PrecisionPlan, TensorPrecision

log = logging.getLogger(__name__)


def _forward_with_fp8_input(self: nn.Module, input: torch.Tensor) -> torch.Tensor:
    """The forward of a tensorwise Float8Linear, its input cast to FP8 as torchao's matmul would cast it.

    torchao's matmul saves the high-precision input and casts it again in backward for the weight
    gradient; with tensorwise scaling that cast is the forward's, byte for byte (one amax, one scale, the
    same E4M3 target). Given an input already in FP8, torchao uses it as it is in both passes (its path for
    inputs cast upstream, as under tensor parallelism), so the layer saves one byte per element instead
    of two, and backward skips a cast; the gradients are the same bits. In the forward, not a pre-hook:
    hooks (FSDP2's, `fp8_health`'s) see the input as the model made it."""
    from torchao.float8.distributed_utils import tensor_already_casted_to_fp8
    from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim, hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole

    x = input
    if not tensor_already_casted_to_fp8(x) and (x.requires_grad or self.weight.requires_grad):
        if torch.is_autocast_enabled():  # as Float8Linear.forward does, before its cast
            x = x.to(torch.get_autocast_gpu_dtype())
        cast = self.config.cast_config_input
        x = hp_tensor_to_float8_dynamic(
            x, cast.target_dtype, self.linear_mm_config, gemm_input_role=GemmInputRole.INPUT,
            scaling_granularity=cast.scaling_granularity,
            axiswise_dim=get_maybe_axiswise_dim(-1, cast.scaling_granularity),
            round_scales_to_power_of_2=self.config.round_scales_to_power_of_2)
    return type(self).forward(self, x)


def _to_cpu_autocast_dtype(module: nn.Module, args: tuple):
    """Forward pre-hook: the input in CPU autocast's dtype, as torchao's Float8Linear puts it in CUDA autocast's
    (it asks `torch.is_autocast_enabled()`, CUDA's only). Without it, emulated on a CPU, a recipe whose weight
    gradient is a high-precision GEMM (rowwise_with_gw_hp) multiplied the BF16 output gradient by the FP32 input
    and failed in backward."""
    x = args[0] if args else None
    if isinstance(x, torch.Tensor) and x.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        return (x.to(torch.get_autocast_dtype("cpu")), *args[1:])
    return None


def _is_mha_projection(module: nn.Module) -> bool:
    # nn.MultiheadAttention calls F.linear on out_proj.weight directly, never out_proj.forward, so
    # swapping the module would report FP8 while the GEMM stays high precision.
    return type(module).__name__ == "NonDynamicallyQuantizableLinear"


class TorchAOBackend(Backend):
    spec = backend_spec("torchao")

    reuses_parameters = True
    # Accelerate's FSDP2 optimizer remap keys parameters by data_ptr(); torchao's FP8 all-gather weight
    # subclass reports 0 there, and Accelerate reads the inner tensor only for its own AO backend.
    accelerate_parameter_lookup = "AO"

    def before_engine_prepare(self, objects: list, accelerator=None) -> None:
        """Under FSDP2, let Accelerate's optimizer remap find every parameter.

        Accelerate keys parameters by `data_ptr()` when it swaps an optimizer onto the sharded
        parameters; the FP8 all-gather weight subclass reports 0 there while Accelerate's name-side
        lookup sees its inner tensor. The optimizer's entry for such a parameter becomes that inner
        tensor, which has the pointer Accelerate expects; Accelerate then points the optimizer at the
        sharded parameter.
        """
        if self.context.engine != "fsdp2":
            return
        for opt in (o for o in objects if isinstance(o, torch.optim.Optimizer)):
            for group in opt.param_groups:
                group["params"] = [
                    p._tensor if p.data_ptr() == 0 and isinstance(getattr(p, "_tensor", None), torch.Tensor) else p
                    for p in group["params"]
                ]

    def candidate_kind(self, module: nn.Module) -> str | None:
        if isinstance(module, nn.Linear) and not _is_mha_projection(module):
            return "linear"
        return None

    def is_converted(self, module: nn.Module) -> bool:
        # By name, so planning works without importing torchao.
        cls = own_class(module)
        return cls.__name__ == "Float8Linear" and cls.__module__.startswith("torchao.")

    def constraint(self, module: nn.Module) -> str | None:
        if self.recipe.pad_inner_dim:
            return None
        dims = (("in_features", module.in_features), ("out_features", module.out_features))
        bad = [f"{name}={dim}" for name, dim in dims if dim % 16]
        if bad:
            return f"{', '.join(bad)} not divisible by 16 (FP8 GEMM requirement; pad_inner_dim=True pads instead)"
        return None

    @property
    def speed_scaling(self) -> str:
        from ..planning.speed import PER_ROW, PER_TENSOR, PER_TENSOR_EAGER, PER_TENSOR_EAGER_LAYERS

        # rowwise_with_gw_hp has no thresholds of its own: its forward and input-gradient GEMMs are
        # rowwise's, so rowwise's are used.
        if self.recipe_name != "tensorwise":
            return PER_ROW
        # The eager rules were measured per GEMM shape on one GPU; they hold for the per-rank work of DDP,
        # FSDP2 and DeepSpeed, where eager FP8 layers measured 0.60-0.67x BF16 and compiled ones 1.19x on
        # the d4096 proxy (results/gpu/2026-11-23-h200x2-matrix, -zero-o3). FSDP1: not measured.
        if self.context.compiled or self.context.engine not in self.LAYER_COMPILE_ENGINES:
            return PER_TENSOR
        return PER_TENSOR_EAGER_LAYERS if self.layer_compile()[0] else PER_TENSOR_EAGER

    # ----- configuration -------------------------------------------------------------------
    @property
    def fsdp_fp8_all_gather(self) -> bool:
        """FP8 weight all-gather: FSDP2 only (with DeepSpeed the weight subclass breaks `prepare`)."""
        return (
            self.context.engine == "fsdp2"
            and self.info.fsdp_fp8_all_gather
            and self.recipe.enable_fsdp_float8_all_gather is not False
        )

    def effective_options(self) -> dict[str, object]:
        out = super().effective_options()
        if self.context.engine == "fsdp2":
            out["enable_fsdp_float8_all_gather"] = self.fsdp_fp8_all_gather
        return out

    def float8_config(self):
        float8 = require("torchao", feature="backend='torchao'")
        if self.recipe_name == "tensorwise" and self.fp8_format == "E4M3":
            # Built whole: replace() would keep the E5M2 copy __post_init__ made for grad_weight.
            e4m3 = float8.CastConfig(target_dtype=torch.float8_e4m3fn)
            config = float8.Float8LinearConfig(cast_config_grad_output=e4m3)
        else:
            config = float8.Float8LinearConfig.from_recipe_name(self.recipe_name)
        return dataclasses.replace(
            config,
            emulate=self.emulated,
            pad_inner_dim=bool(self.recipe.pad_inner_dim),
            enable_fsdp_float8_all_gather=self.fsdp_fp8_all_gather,
        )

    # ----- the three jobs --------------------------------------------------------------------
    @property
    def saves_fp8_input(self) -> bool:
        """Whether the FP8 layers keep their FP8 input for backward (`_forward_with_fp8_input`): where the
        weight gradient's cast of the input is the forward's, which per-tensor scaling alone gives
        (rowwise casts it along the other axis for the weight gradient; rowwise_with_gw_hp keeps it BF16),
        and where the layers run eager. In a compiled graph (the model's or a layer's) the partitioner
        chooses what to save: it keeps the input, which the graph receives anyway, and casts it again."""
        return self.recipe_name == "tensorwise" and not self.context.compiled and not self.layer_compile()[0]

    def convert(self, model: nn.Module, plan: PrecisionPlan) -> nn.Module:
        float8 = require("torchao", feature="backend='torchao'")
        chosen = {("" if d.fqn == "<root>" else d.fqn) for d in plan.converted}
        config = self.float8_config()
        model = float8.convert_to_float8_training(
            model, module_filter_fn=lambda module, fqn: fqn in chosen, config=config
        )
        hp_weight_grad = config.cast_config_input_for_grad_weight.scaling_type.name == "DISABLED"
        if self.emulated and self.context.device.type == "cpu" and hp_weight_grad:
            for module in model.modules():
                if self.is_converted(module):
                    module.register_forward_pre_hook(_to_cpu_autocast_dtype)
        if self.saves_fp8_input:
            if config.cast_config_input != config.cast_config_input_for_grad_weight:
                raise RuntimeError(  # a torchao whose tensorwise recipe no longer casts the input once
                    f"lowprec: torchao's {self.recipe_name!r} recipe casts the input differently for the weight "
                    "gradient; lowprec cannot reuse the forward's cast (please report)")
            for module in model.modules():
                if self.is_converted(module):
                    # the instance's forward, as a partial of a module-level function: copy.deepcopy and
                    # pickle (torch.save of the whole model) keep it (a bound method pickles by name, and
                    # the class has no such attribute: the pickled model did not load)
                    module.forward = functools.partial(_forward_with_fp8_input, module)
        return model

    def post_optimizer_step(self, model: nn.Module) -> Callable[[], None] | None:
        if not self.fsdp_fp8_all_gather:
            return None
        precompute = require("torchao", feature="backend='torchao'").precompute_float8_dynamic_scale_for_fsdp
        # One amax all-reduce for every weight after the step, instead of one per layer in forward.
        return lambda: precompute(model)

    def after_load_state(self, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer] = ()) -> None:
        # the scales precomputed for the next FP8 all-gathers came from the weights before the load (or, when the
        # optimizer's state is made for the load, from a step taken before the model loaded)
        hook = self.post_optimizer_step(model)
        if hook is not None:
            hook()

    def setup_communication(self, model: nn.Module, plan: PrecisionPlan) -> None:
        if self.fsdp_fp8_all_gather:
            from .torchao_gather import fuse_gather_casts

            fuse_gather_casts(model)

    @property
    def gathers_fp8_weights(self) -> bool:
        return self.fsdp_fp8_all_gather

    def saved_linear_input(self) -> SavedInput:
        from ..planning.activations import SavedInput

        if self.saves_fp8_input:
            return SavedInput("FP8 E4M3, per-tensor scale (the forward's cast, reused by the weight gradient)", 1.0)
        # torchao's matmul saves input_hp (torchao/float8/float8_linear.py) and casts it again in backward
        if self.recipe_name != "tensorwise":
            why = f"recipe {self.recipe_name!r} casts it again in backward (along the other axis, or not at all)"
        else:
            why = "compiled: the graph keeps the input it receives and casts it again in backward"
        return SavedInput(f"BF16: {why}", 2.0, packable=True)

    def gemm_precision(self, plan: PrecisionPlan) -> TensorPrecision:
        from ..planning.plan import TensorPrecision

        if self.recipe_name == "tensorwise":
            gemm = "FP8 E4M3/E5M2" if self.fp8_format == "HYBRID" else "FP8 E4M3"
            scaling = (
                "dynamic per-tensor: scale from the amax of the current tensor (activations, weights, "
                + ("output grads in E5M2)" if self.fp8_format == "HYBRID" else "output grads, all E4M3)")
            )
        elif self.recipe_name == "rowwise":
            gemm, scaling = "FP8 E4M3", "dynamic per-row (axiswise), scales rounded down to powers of 2"
        else:
            gemm = "FP8 E4M3 (wgrad BF16)"
            scaling = "dynamic per-row, power-of-2 scales; weight-gradient GEMM in high precision"
        return TensorPrecision("gemm", gemm, scaling)

    def notes(self, plan: PrecisionPlan) -> list[str]:
        notes = []
        if not self.emulated:
            if not self.context.compiled and not self.layer_compile()[0]:  # eager model, eager FP8 layers
                notes.append("torchao's FP8 speed-up needs torch.compile: compile the model (Accelerate: "
                             "dynamo_backend='inductor') or leave compile_fp8_layers on")
            if not self.recipe.pad_inner_dim:
                notes.append(
                    "FP8 GEMMs need batch x sequence to be a multiple of 16: pad sequences, or set pad_inner_dim=True"
                )
        if self.context.engine == "fsdp2":
            if self.recipe.enable_fsdp_float8_all_gather is False:
                why_not_fp8_gather = "enable_fsdp_float8_all_gather=False"
            else:
                why_not_fp8_gather = f"recipe {self.recipe_name!r} has no FP8 all-gather"
            if self.fsdp_fp8_all_gather:
                from .torchao_gather import supported

                cast = ("each shard cast in one kernel" if supported() else
                        "each shard cast by torchao (this torchao's fsdp_pre_all_gather is not the one lowprec's "
                        "one-kernel cast stands in for)")
                notes.append("FSDP2: weights all-gathered in FP8, scales precomputed with one all-reduce after each "
                             f"optimizer step, {cast}")
            else:
                notes.append(f"FSDP2: weights all-gathered in high precision ({why_not_fp8_gather})")
        elif self.context.engine == "deepspeed":
            notes.append("DeepSpeed: FP8 weight all-gather stays off "
                         "(torchao's weight subclass breaks DeepSpeed's prepare)")
        return notes
