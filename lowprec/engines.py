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


def default_engine_precision(engine: str) -> EnginePrecision:
    """What `accelerate launch` gives each engine when lowprec passes it mixed_precision='bf16'."""
    if engine in ("fsdp2", "fsdp1"):
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
