"""What each distributed engine does with precision, outside the FP8 GEMMs.

lowprec hands Accelerate `mixed_precision="bf16"`, and the engines act on it: FSDP2 all-gathers
weights and reduce-scatters gradients in its `MixedPrecisionPolicy` dtypes (BF16/BF16 by
Accelerate's default), DeepSpeed keeps BF16 weights with FP32 masters inside its optimizer and
communicates gradients in BF16, DDP all-reduces `.grad` in the parameters' dtype. The plan's
communication, weight and master-weight rows come from here, so they say what the engine really does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_SHORT = {torch.float32: "FP32", torch.bfloat16: "BF16", torch.float16: "FP16"}
BYTES = {"FP32": 4, "BF16": 2, "FP16": 2}  # per element, by the names EnginePrecision uses


def dtype_name(dtype: torch.dtype | str | None) -> str | None:
    """'BF16' for torch.bfloat16 or 'bf16'; None stays None."""
    if dtype is None:
        return None
    if isinstance(dtype, torch.dtype):
        return _SHORT.get(dtype, str(dtype).replace("torch.", ""))
    aliases = {"fp32": "FP32", "float32": "FP32", "bf16": "BF16", "bfloat16": "BF16", "fp16": "FP16",
               "float16": "FP16"}
    return aliases.get(str(dtype).strip().lower(), str(dtype).upper())


@dataclass(frozen=True)
class EnginePrecision:
    """Precisions the engine imposes. None means "the parameters' own dtype" (or: not applicable).

    Attributes:
        grad_reduce: dtype gradients are reduced across ranks in (None: the parameters' dtype).
        param_gather: dtype sharded weights are all-gathered in for compute (sharded engines only).
        weight: dtype the engine stores trainable weights in (None: the model's own).
        master_weight: the engine's own high-precision weight copy, if it keeps one.
        source: where these values come from, for the plan ("Accelerate's FSDP2 defaults", ...).
    """

    grad_reduce: str | None = None
    param_gather: str | None = None
    weight: str | None = None
    master_weight: str | None = None
    source: str = ""


FSDP_ENGINES = ("fsdp2", "fsdp1")


def fsdp_shards(engine: str, world_size: int) -> bool:
    """Whether each rank holds 1/world_size of every weight, gradient, master and optimizer state (FSDP)."""
    return engine in FSDP_ENGINES and world_size > 1


def default_engine_precision(engine: str) -> EnginePrecision:
    """What `accelerate launch` gives each engine when lowprec passes it mixed_precision='bf16'."""
    if engine in FSDP_ENGINES:
        # FullyShardedDataParallelPlugin.set_mixed_precision("bf16"): param_dtype = reduce_dtype = bf16
        return EnginePrecision(grad_reduce="BF16", param_gather="BF16",
                               source="Accelerate's FSDP mixed-precision policy for bf16")
    if engine == "deepspeed":
        # bf16.enabled: BF16 weights and gradients, FP32 masters in DeepSpeed's optimizer wrapper;
        # gradients are communicated in BF16 unless communication_data_type says otherwise.
        return EnginePrecision(grad_reduce="BF16", weight="BF16", master_weight="FP32",
                               source="DeepSpeed bf16 (Accelerate's default config)")
    return EnginePrecision()


def fsdp_precision(policy) -> EnginePrecision:
    """From the `MixedPrecisionPolicy` (FSDP2) or `MixedPrecision` (FSDP1) Accelerate will apply."""
    if policy is None:
        return EnginePrecision(source="FSDP without a mixed-precision policy")
    return EnginePrecision(
        grad_reduce=dtype_name(getattr(policy, "reduce_dtype", None)),
        param_gather=dtype_name(getattr(policy, "param_dtype", None)),
        source="the FSDP plugin's mixed-precision policy",
    )


def deepspeed_precision(config: dict) -> EnginePrecision:
    """From a DeepSpeed config dict (as Accelerate's DeepSpeed plugin holds it)."""
    def enabled(section: str) -> bool:
        value = (config.get(section) or {}).get("enabled", False)
        # Accelerate fills "auto" from mixed_precision, which lowprec sets to bf16
        return value is True or (value == "auto" and section == "bf16")

    weight = "BF16" if enabled("bf16") else "FP16" if enabled("fp16") else None
    comm = dtype_name(config.get("communication_data_type")) or weight
    return EnginePrecision(grad_reduce=comm, weight=weight, master_weight="FP32" if weight else None,
                           source="the DeepSpeed config")


# ----- grad_comm_dtype: what each engine does with it ------------------------------------------------
# (engine, choice) -> how it is done, for the plan's gradient-communication row; a pair not here is
# refused (grad_comm_problem). One process sends nothing, whatever the choice.
GRAD_COMM_MEANS = {
    ("ddp", "fp32"): "DDP comm hook (all-reduce in FP32)",
    ("ddp", "bf16"): "DDP comm hook (all-reduce in BF16)",
    ("ddp", "fp8"): "DDP comm hook; one power-of-2 scale per 1024-element block from the all-reduced amaxes, "
                    "all_to_all of the E4M3 bytes, FP32 sums, all_gather of the E4M3 mean; inf/NaN arrive as NaN",
    ("fsdp2", "fp32"): "the FSDP2 MixedPrecisionPolicy's reduce_dtype",
    ("fsdp2", "bf16"): "the FSDP2 MixedPrecisionPolicy's reduce_dtype",
    ("fsdp2", "fp8"): "FSDP2 custom reduce-scatter for the groups holding FP8 Linears; one power-of-2 scale per "
                      "1024-element block from the all-reduced amaxes, inf/NaN arrive as NaN; the other groups in "
                      "the MixedPrecisionPolicy's reduce_dtype",
    ("fsdp1", "fp32"): "the FSDP MixedPrecision's reduce_dtype",
    ("fsdp1", "bf16"): "the FSDP MixedPrecision's reduce_dtype",
    ("deepspeed", "fp32"): "DeepSpeed's communication_data_type",
    ("deepspeed", "bf16"): "DeepSpeed's communication_data_type",
}


def comm_dtype_name(choice: str, engine: str) -> str:
    """The plan's name for what `grad_comm_dtype=choice` sends under a multi-process `engine`."""
    if choice == "fp8":
        return "FP8 E4M3, block scales (groups with FP8 Linears)" if engine == "fsdp2" else "FP8 E4M3, shared scale"
    return dtype_name(choice)


def supports_custom_reduce_scatter() -> bool:
    """Whether this torch's FSDP2 lets a custom reduce-scatter replace its own."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return hasattr(FSDPModule, "set_custom_reduce_scatter")


def grad_comm_problem(choice: str | None, engine: str) -> str | None:
    """Why `grad_comm_dtype=choice` cannot be honoured under `engine`, or None."""
    if choice is None or engine == "single":
        return None
    if (engine, choice) == ("fsdp2", "fp8"):
        if supports_custom_reduce_scatter():
            return None
        return (f"grad_comm_dtype='fp8' under FSDP2 needs FSDPModule.set_custom_reduce_scatter, which torch "
                f"{torch.__version__} lacks (torch >= 2.8 has it); use grad_comm_dtype='bf16' or 'fp32' there")
    if (engine, choice) in GRAD_COMM_MEANS:
        return None
    if engine == "fsdp1":
        return ("grad_comm_dtype='fp8' needs FSDP2 (fsdp_version: 2): FSDP1 has no way to replace its "
                "reduce-scatter; use FSDP2, or grad_comm_dtype='bf16'/'fp32' under FSDP1")
    if engine == "deepspeed":
        return ("grad_comm_dtype='fp8' cannot be honoured under DeepSpeed: its communication_data_type takes "
                "fp32, bf16 or fp16 only. Use grad_comm_dtype='bf16' or 'fp32' there, or DDP/FSDP2 for FP8 "
                "gradient reduction")
    return f"grad_comm_dtype={choice!r} under engine {engine!r} is not known to lowprec"


def apply_grad_comm_dtype(choice: str | None, engine: str, plugin=None) -> None:
    """Set the engine's own gradient-reduction precision from `grad_comm_dtype`, before it wraps the
    model: FSDP's mixed-precision `reduce_dtype`, DeepSpeed's `communication_data_type` (`plugin`:
    Accelerate's FSDP or DeepSpeed plugin). FP8 under FSDP2 keeps the policy's reduce_dtype for the
    buffer FSDP hands lowprec's FP8 reduce-scatter, and DDP is hooked after wrapping: neither
    changes a plugin.

    Raises ValueError where the DeepSpeed config already names another communication_data_type.
    """
    if choice is None or choice == "fp8" or plugin is None:
        return
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[choice]
    if engine in FSDP_ENGINES:
        import dataclasses

        policy = plugin.mixed_precision_policy
        if policy is None:
            if engine == "fsdp2":
                from torch.distributed.fsdp import MixedPrecisionPolicy as policy_type
            else:
                from torch.distributed.fsdp import MixedPrecision as policy_type
            plugin.mixed_precision_policy = policy_type(reduce_dtype=dtype)
        else:
            plugin.mixed_precision_policy = dataclasses.replace(policy, reduce_dtype=dtype)
    elif engine == "deepspeed":
        config = plugin.deepspeed_config
        current = config.get("communication_data_type")
        if current not in (None, "auto") and str(current).lower() != choice:
            raise ValueError(
                f"FP8RecipeKwargs.grad_comm_dtype={choice!r} but the DeepSpeed config sets communication_data_type="
                f"{current!r}; set one of them (or the same value in both)"
            )
        config["communication_data_type"] = choice


def options_without_effect(recipe, engine: str, processes: int) -> list[tuple[str, str]]:
    """(option=value, why) for each option `recipe` sets that this run has no use for: accepted (the same recipe
    runs under other engines), but said, since the plan's rows alone would show them as N/A."""
    idle = []
    if processes == 1:
        if recipe.grad_comm_dtype is not None:
            idle.append((f"grad_comm_dtype={recipe.grad_comm_dtype!r}",
                         "one process communicates no gradients (it applies under DDP, FSDP and DeepSpeed)"))
        if recipe.reduce_amax is not None:
            idle.append((f"reduce_amax={recipe.reduce_amax!r}", "one process has no other rank's amaxes to reduce"))
    if recipe.enable_fsdp_float8_all_gather and engine != "fsdp2":
        idle.append(("enable_fsdp_float8_all_gather=True",
                     f"it applies under FSDP2, and this run's engine is {engine}"))
    return idle
