"""Cross-entropy over a model's logits that keeps no FP32 copy of them for backward.

The usual language-model loss upcasts the logits to FP32 and takes `F.cross_entropy` of that: autograd then keeps
the FP32 log-probabilities for backward, and the backward makes two more FP32 tensors of the logits' shape (the
log-probabilities' gradient and the FP32 logits' gradient) before casting to the logits' dtype. At a 32000-word
vocabulary and 8192 tokens those are three tensors of 0.98 GiB each, live at the start of the backward, when every
saved activation still is: the step's peak (results/gpu/2026-11-27-h200-whole-087d663).

`cross_entropy` computes the same loss chunk by chunk (rows of at most `CHUNK_ELEMENTS` values in FP32 at a time)
and keeps for backward only the logits themselves, which the model hands back to its caller anyway, and one FP32
log-sum-exp per row. The backward recomputes each chunk's softmax from them and writes the gradient straight in the
logits' dtype. On CUDA the chunks are one inductor kernel each way, every row at once, wherever `fused.cuda_fused`
compiles (Triton, and sm_89 or newer, whose inductor code holds FP8: an A100 runs the torch chunks)
(`fused_requested`; `LOWPREC_FUSED_CROSS_ENTROPY=0`: torch ops). Every value is computed in FP32 as the upcasting
loss computes it, so the loss and the gradient equal the usual ones up to FP32 summation order
(tests/kernels/test_cross_entropy.py). Inside a graph being compiled it is the usual expression, which inductor
fuses: a whole-model graph's peak held no FP32 tensor of the logits' shape
(results/gpu/2026-11-27-h200-whole-087d663).
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from ..utils.env import switch
from . import fused

# FP32 values of the logits in flight at once (128 MiB): the forward's and the backward's temporaries
CHUNK_ELEMENTS = 2**25
REDUCTIONS = ("mean", "sum")
FUSED_ENV = "LOWPREC_FUSED_CROSS_ENTROPY"
_saving = threading.local()


def fused_requested() -> bool:
    """Whether the loss runs fused where it can (`cuda_fused`: on CUDA, the log-sum-exps and the gradient of every
    row as one inductor kernel each, instead of a few torch ops a chunk over FP32 temporaries): yes unless
    `LOWPREC_FUSED_CROSS_ENTROPY=0`. On the d4096 proxy the fused form took 4.8 ms off msamp O2's step at the same
    peak (results/gpu/2026-11-27-h200-memory-8951179)."""
    return switch(FUSED_ENV, "1 or unset: the loss's chunks as one fused kernel each way on CUDA; 0: torch ops") \
        is not False


@fused.cuda_fused
def _fused_lse(logits: torch.Tensor) -> torch.Tensor:
    """Each row's log-sum-exp in FP32 (FP64 for FP64 logits): one reduction kernel over the logits as they are."""
    return torch.logsumexp(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)


@fused.cuda_fused
def _fused_grad(logits: torch.Tensor, lse: torch.Tensor, picked_index: torch.Tensor,
                row_scale: torch.Tensor) -> torch.Tensor:
    """(softmax - one-hot) * row_scale in the logits' dtype: one pointwise kernel, nothing in FP32 in memory."""
    probs = torch.exp(logits.to(lse.dtype) - lse[:, None])
    columns = torch.arange(logits.shape[1], device=logits.device)
    probs = torch.where(columns[None, :] == picked_index[:, None], probs - 1, probs)
    return (probs * row_scale[:, None]).to(logits.dtype)


def rows_per_chunk(vocab: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(vocab, 1))


class _LogitsCrossEntropy(torch.autograd.Function):
    """Cross-entropy of 2-D `logits` against `target`, summed over the rows that are not `ignore_index` and
    divided by their number (`mean`) or not (`sum`)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, ignore_index: int, mean: bool) -> torch.Tensor:
        compute = torch.promote_types(logits.dtype, torch.float32)
        rows, step = logits.shape[0], rows_per_chunk(logits.shape[1])
        # only where it compiles: as plain torch, the fused form's one pass over every row is FP32 copies of them all
        ctx.fused = fused_requested() and fused.fuses(logits)
        if ctx.fused:  # every row at once: the kernel keeps nothing in FP32 in memory
            lse = _fused_lse(logits)
        else:
            lse = torch.empty(rows, dtype=compute, device=logits.device)
            for start in range(0, rows, step):
                lse[start:start + step] = torch.logsumexp(logits[start:start + step].to(compute), dim=-1)
        valid = target != ignore_index
        picked_index = torch.where(valid, target, 0)
        picked = logits.gather(1, picked_index[:, None]).squeeze(1).to(compute)
        # an ignored row's logits may be anything, inf and NaN included: they never reach the loss
        total = torch.where(valid, lse - picked, 0).sum()
        count = valid.sum().to(compute)
        ctx.save_for_backward(logits, lse, picked_index, valid, count)
        ctx.mean = mean
        return total / count if mean else total

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        if torch.is_grad_enabled():  # backward(create_graph=True): its gradient is computed, not recorded
            raise RuntimeError(
                "lowprec cross_entropy has no double backward (create_graph=True, e.g. a gradient penalty): "
                "compute this loss with F.cross_entropy(logits.float(), ...) (for a Hugging Face model under "
                "activation_dtype='fp8', set model.loss_function to your own before prepare())")
        logits, lse, picked_index, valid, count = ctx.saved_tensors
        compute = lse.dtype
        scale = grad_loss.to(compute) / count if ctx.mean else grad_loss.to(compute)
        # 0 for ignored rows, as F.cross_entropy's gradient is: NaN or inf logits there still come out NaN
        row_scale = torch.where(valid, scale, 0)
        if ctx.fused:
            return _fused_grad(logits, lse, picked_index, row_scale), None, None, None
        grad = torch.empty_like(logits)
        step = rows_per_chunk(logits.shape[1])
        for start in range(0, logits.shape[0], step):
            stop = min(start + step, logits.shape[0])
            # a copy in FP32 (copy=True: FP32 logits are not to be overwritten), then in place: one chunk allocated
            probs = logits[start:stop].to(compute, copy=True).sub_(lse[start:stop, None]).exp_()
            rows = torch.arange(stop - start, device=logits.device)
            probs[rows, picked_index[start:stop]] -= 1
            grad[start:stop] = probs.mul_(row_scale[start:stop, None])
        return grad, None, None, None


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                  reduction: str = "mean") -> torch.Tensor:
    """`F.cross_entropy(logits.float(), target, ignore_index=..., reduction=...)` for `logits` of shape
    (..., vocabulary) and integer `target` of shape (...), returned in FP32 (FP64 logits: FP64), without the FP32
    copies of the logits that expression keeps for backward. `reduction`: 'mean' (over the rows whose target is
    not `ignore_index`; NaN if there are none, as torch's) or 'sum'."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"lowprec cross_entropy: reduction={reduction!r} is not one of {', '.join(REDUCTIONS)}")
    if not logits.is_floating_point():
        raise TypeError(f"lowprec cross_entropy: logits must be a floating tensor, got {logits.dtype}")
    if logits.dim() < 1 or target.shape != logits.shape[:-1]:
        raise ValueError(f"lowprec cross_entropy: target of shape {tuple(target.shape)} does not match logits of "
                         f"shape {tuple(logits.shape)} (expected {tuple(logits.shape[:-1])})")
    if target.is_floating_point() or target.dtype == torch.bool:
        raise TypeError(f"lowprec cross_entropy: target must be an integer tensor of class indices, got "
                        f"{target.dtype}")
    compute = torch.promote_types(logits.dtype, torch.float32)
    flat, labels = logits.reshape(-1, logits.shape[-1]), target.reshape(-1).to(device=logits.device,
                                                                                  dtype=torch.long)
    if torch.compiler.is_compiling():
        return F.cross_entropy(flat.to(compute), labels, ignore_index=ignore_index, reduction=reduction)
    _saving.depth = getattr(_saving, "depth", 0) + 1
    try:  # autograd packs what the Function saved before apply() returns
        return _LogitsCrossEntropy.apply(flat, labels, ignore_index, reduction == "mean")
    finally:
        _saving.depth -= 1


def saving_for_backward() -> bool:
    """Whether the tensors autograd is saving now are this loss's (on this thread): the saved-tensor hooks of
    activation_dtype='fp8' keep them as they are. The logits in FP8 would spoil the probabilities backward
    recomputes from them (their error in log space becomes one in exp(); runtime/activations.py keeps a log-softmax's
    output for the same reason), and the caller holds the logits in any case."""
    return getattr(_saving, "depth", 0) > 0


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                   num_items_in_batch: torch.Tensor | int | None = None, ignore_index: int = -100,
                   shift_labels: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
    """Hugging Face's causal-LM loss (`transformers.loss.loss_utils.ForCausalLMLoss`: tokens < n predict n,
    the mean over the labelled tokens, or the sum divided by `num_items_in_batch` when given) computed by
    `cross_entropy`. Keyword arguments the model passes on and that loss ignores are ignored here too."""
    if shift_labels is None:
        # tokens < n predict n; the last position has nothing to predict
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    flat = logits.reshape(-1, vocab_size)
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = cross_entropy(flat, shift_labels.reshape(-1), ignore_index=ignore_index, reduction=reduction)
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss
