"""`activation_dtype='fp8'` and the loss: a Hugging Face causal LM's loss computed without FP32 copies of the logits.

Hugging Face's `ForCausalLMLoss` upcasts the logits and keeps the FP32 log-probabilities for backward: with the
block's activations in FP8 those copies are the largest thing live at the step's peak. A model whose
`loss_function` is that one gets `lowprec.kernels.cross_entropy.causal_lm_loss`, the same loss and gradient
up to FP32 summation order. A loss the user set (`model.loss_function = ...`) or a model of another kind is left
alone: the plan says which.
"""

from __future__ import annotations

from torch import nn

from ..kernels.cross_entropy import causal_lm_loss
from .wrapping import models_of

HF_LOSS = ("transformers.loss.loss_utils", "ForCausalLMLoss")
SWAPPED = ("Hugging Face's causal-LM loss without FP32 copies of the logits: their softmax recomputed chunk by "
           "chunk in backward from the logits the model returns (lowprec.kernels.cross_entropy); inside a graph "
           "compiled with the loss, the usual upcasting expression, which inductor compiles")
KEPT_OTHER = "the model's own (lowprec computes a Hugging Face ForCausalLMLoss only)"
KEPT_PLAIN = ("as the model computes it (Hugging Face's keeps FP32 log-probabilities of the logits' shape); "
              "activation_dtype='fp8' computes it without FP32 copies")


def _is_hf_causal_lm_loss(model: nn.Module) -> bool:
    if "_loss_function" in getattr(model, "__dict__", {}):  # set by the user (or already by lowprec): theirs stays
        return False
    # a causal LM's loss type (PreTrainedModel sets it from the class name): a bare decoder has none, and reading its
    # loss_function would warn that None is unrecognized
    if getattr(model, "loss_type", None) != "ForCausalLM":
        return False
    fn = getattr(type(model), "loss_function", None)
    if not isinstance(fn, property):
        return False
    current = model.loss_function
    return (getattr(current, "__module__", None), getattr(current, "__name__", None)) == HF_LOSS


def swap_causal_lm_loss(model: nn.Module) -> bool:
    """Give `model` (unwrapped) lowprec's causal-LM loss if its loss is Hugging Face's default one; True if so."""
    if not _is_hf_causal_lm_loss(model):
        return False
    model.loss_function = causal_lm_loss  # PreTrainedModel's setter: the model's forward calls it
    return True


def loss_storage(model: nn.Module, activation_dtype: str | None) -> str:
    """The plan's line on what the loss keeps for backward."""
    if activation_dtype != "fp8":
        return KEPT_PLAIN
    if any(getattr(m, "__dict__", {}).get("_loss_function") is causal_lm_loss or _is_hf_causal_lm_loss(m)
           for m in models_of(model)):
        return SWAPPED
    return KEPT_OTHER
