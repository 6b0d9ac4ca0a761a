"""How a backend's converted layers execute: their FP8 GEMMs in hardware or emulated (decided once, when
the backend is built), and, in an eager model, compiled one by one or not (`compile_fp8_layers`).

A mixin of `Backend` (lowprec/backends/base.py), whose recipe, run context, recipe declaration and
`converted_kind` it reads; an adapter tunes it with the `LAYER_COMPILE_*` class attributes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from .context import BackendUnavailableError

if TYPE_CHECKING:
    from torch import nn

    from ..frontend.recipe import FP8RecipeKwargs
    from ..frontend.specs import RecipeInfo
    from .context import RunContext


class LayerExecution:
    recipe: FP8RecipeKwargs
    context: RunContext
    recipe_name: str
    info: RecipeInfo
    emulated: bool

    LAYER_COMPILE_BACKEND: ClassVar[str] = "inductor"  # torch.compile backend of compile_layers
    # torch.compile's `dynamic` for the layers (None: its default, static first, dynamic from the second shape)
    LAYER_COMPILE_DYNAMIC: ClassVar[bool | None] = None
    # Engines where compiling the layers was measured to pay (torchao, eager d4096 proxy): one H100
    # (results/gpu/2026-11-23-h100-eager-layers), FSDP2 and DeepSpeed ZeRO-2 on two H200s (1.19x BF16
    # against 0.60-0.67x with eager layers: results/gpu/2026-11-23-h200x2-zero-o3)
    LAYER_COMPILE_ENGINES: ClassVar[tuple[str, ...]] = ("single", "ddp", "fsdp2", "deepspeed")
    # Graphs one layer shape can need: dynamo keeps parameter and buffer shapes static (its
    # force_parameter_static_shapes), so every weight shape is a graph of its own whatever `dynamic` says,
    # times the input dtypes met (FP32 after a norm, BF16 after an FP8 layer under autocast), times what else
    # the layer's forward guards on (msamp: warm-up over or not).
    LAYER_COMPILE_VARIANTS_PER_SHAPE: ClassVar[int] = 2

    def layer_compile(self) -> tuple[bool, str]:
        """(whether `prepare()` compiles each converted layer one by one, why): `compile_fp8_layers`."""
        choice = self.recipe.compile_fp8_layers
        if self.context.compiled:
            return False, "the model is compiled whole (dynamo_backend)"
        if choice is not None:
            return choice, f"compile_fp8_layers={choice}"
        if not self.compiles_layers:
            return False, f"not measured to pay for backend {self.name!r}"
        if self.emulated:
            return False, "emulated: no FP8 speed to win"
        if self.context.engine not in self.LAYER_COMPILE_ENGINES:
            return False, f"not measured under {self.context.engine}"
        return True, "eager model on an FP8 GPU"

    def later_compiles(self) -> str:
        """When, after the first steps, the compiled layers compile again (for the plan's note), or ''."""
        return ""

    def warm_up_steps(self) -> int:
        """Training steps whose FP8 layers run otherwise than all later ones (a timing should leave them out)."""
        return 0

    def compile_layers(self, model: nn.Module) -> int:
        """Compile each converted layer of `model` (nn.Module.compile) where `layer_compile` says so;
        layers of one shape share a compiled graph. Returns how many were compiled."""
        if not self.layer_compile()[0]:
            return 0
        layers = [m for m in model.modules() if self.converted_kind(m) == "linear"]
        shapes = {tuple(layer.weight.shape) for layer in layers}
        raise_recompile_limit(len(shapes) * self.LAYER_COMPILE_VARIANTS_PER_SHAPE)
        for layer in layers:
            layer.compile(backend=self.LAYER_COMPILE_BACKEND, dynamic=self.LAYER_COMPILE_DYNAMIC)
        return len(layers)

    def _decide_execution(self) -> tuple[bool, str]:
        """Hardware FP8 or emulation, with the reason. Raises if neither is possible."""
        dev = self.context.device
        need = self.info.min_capability
        hw_ok = dev.type == "cuda" and dev.capability is not None and dev.capability >= need
        if self.info.max_capability is not None and dev.capability is not None:
            hw_ok = hw_ok and dev.capability < self.info.max_capability
        if self.recipe.emulate:
            return True, "emulated (emulate=True): FP8 numerics, high-precision matmuls, no speed-up"
        if hw_ok:
            return False, f"hardware FP8 on {dev.describe()}"
        why = (
            f"{dev.describe()} has no FP8 tensor cores"
            if not dev.fp8_gemm
            else f"recipe {self.recipe_name!r} needs sm_{need[0]}{need[1]}+, {dev.describe()} is older"
        )
        too_new = self.info.max_capability is not None and dev.capability is not None
        if too_new and dev.capability >= self.info.max_capability:
            why = f"recipe {self.recipe_name!r} is not supported on {dev.describe()}"
        if self.recipe.emulate is False or not self.supports_emulation:
            raise BackendUnavailableError(
                f"backend {self.name!r} recipe {self.recipe_name!r} cannot run here: {why}"
                + ("" if self.supports_emulation else f", and {self.display_name} has no emulation mode")
                + ("; emulate=False forbids emulation" if self.recipe.emulate is False else "")
            )
        return True, f"emulated: {why}. FP8 numerics are exact, matmuls run in high precision, no speed-up"


def raise_recompile_limit(graphs: int) -> None:
    """Let dynamo keep `graphs` graphs of one function (the layers share their forward's code), plus
    headroom. Past its limit (8 by default) dynamo runs every further variant eager for the rest of the
    run, silently but for one log line: on the d4096 Llama proxy msamp's 5 weight shapes x 2 input dtypes x
    warm-up gave 12 variants, so after the 16 warm-up steps layers fell back to eager kernels. Raised only,
    never lowered: the setting is process-wide."""
    import torch._dynamo.config as dynamo_config

    wanted = graphs + 8
    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"  # before 2.7
    if getattr(dynamo_config, name) < wanted:
        setattr(dynamo_config, name, wanted)
