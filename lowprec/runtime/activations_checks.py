"""What is checked and said about `activation_dtype='fp8'` before a model runs with it: the settings refused
(CUDA graphs), and the warning for a whole-model graph, which saves no memory."""

from __future__ import annotations

import warnings

# torch.compile modes that run the graphs through CUDA graphs (inductor's "triton.cudagraphs")
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def check_activation_dtype(activation_dtype: str | None, dynamo_plugin=None, source: str = "") -> None:
    """Refuse what this path does not do yet, when the Accelerator is built rather than mid-prepare().

    A compiled model is fine: the hooks sit around the compiled forward and store what the compiled
    graph saves for its backward (AOTAutograd's saved tensors, as the partitioner chose them). Under
    CUDA graphs those tensors live in the graphs' static memory pool, which stays allocated whatever is
    done with them: packing would add FP8 copies and save nothing. Not measured, so refused for now.
    `source`: where the dynamo setting came from when not from this Accelerator's arguments."""
    if activation_dtype != "fp8" or dynamo_plugin is None:
        return
    if not getattr(dynamo_plugin, "use_regional_compilation", False):
        warn_whole_model_compile("Accelerate's dynamo plugin compiles the whole model" + (f" ({source})" if source
                                                                                         else ""))
    backend = str(getattr(dynamo_plugin.backend, "value", dynamo_plugin.backend)).lower()
    mode = dynamo_plugin.mode
    if backend == "cudagraphs":
        how = f"dynamo_backend='{backend}'"
    elif backend == "inductor" and mode in CUDA_GRAPH_MODES:
        how = f"dynamo mode='{mode}'"
    elif backend == "inductor" and (dynamo_plugin.options or {}).get("triton.cudagraphs"):
        how = "dynamo options triton.cudagraphs=True"
    else:
        return
    if source:  # not this Accelerator's own setting: say where it came from
        how = f"{how}; {source}"
    raise ValueError(
        f"lowprec: FP8RecipeKwargs.activation_dtype='fp8' is not yet supported with CUDA graphs ({how}): the "
        "graphs' memory pool keeps the high-precision tensors the forward saves, so FP8 copies would add "
        "memory, not save it. Use dynamo mode 'default' or 'max-autotune-no-cudagraphs' (both supported), "
        "or activation_dtype=None")


def warn_whole_model_compile(how: str) -> None:
    """Say that FP8 activations lower no peak when one graph holds the whole model (a review's CPU probe of a
    toy model: 15 of its 16 saved tensors alive in high precision when the last was packed, 3 eager; not yet
    measured on a GPU)."""
    warnings.warn(
        f"lowprec: FP8RecipeKwargs.activation_dtype='fp8' saves little or no memory here: {how} as one graph, "
        "which hands every tensor it saves to autograd at the end of its forward, all in high precision, and "
        "takes them all back at once at the start of its backward, so the FP8 copies come on top of them. "
        "Compile block by block instead (TorchDynamoPlugin(use_regional_compilation=True), or "
        "use_regional_compilation: true under dynamo_config), where each block's tensors are stored as it ends",
        stacklevel=4)
