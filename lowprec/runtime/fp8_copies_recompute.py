"""Recompute in backward, rather than keep from the forward, the FP8 copies a compiled graph saves only for backward.

An FP8 Linear's weight gradient reads its input as FP8, transposed (Hopper's FP8 GEMM takes no other layout), so a
compiled block keeps that transposed E4M3 copy from its forward to its backward. Inductor's partitioner never
recomputes it: the copy feeds a GEMM, so it "must be materialized in backward" (`ban_recompute_materialized_backward`)
and, by its other rules, it keeps what was cheap to recompute too. Yet each such copy is a cast of a tensor the backward
holds anyway: the down projection's input is SiLU(gate) x up, whose halves SiLU's backward keeps; the attention
projection's is the attention output, which SDPA's backward keeps; the QKV and gate/up inputs are a norm's output,
whose input and reciprocal RMS the norm's backward keeps. On the d4096 proxy (batch 4 x 2048) with FP8 activations
those copies were 0.81 GiB of msamp O2's 10.77 GiB steady peak, the down projection's alone 0.44 GiB
(results/gpu/2026-11-28-h200x2-realize-teloss-0e7acfb).

`RecomputeFP8Copies` is an inductor joint-graph pass that marks such a copy, and the cheap ops between it and the
tensors the backward keeps anyway, to be recomputed (`CheckpointPolicy.MUST_RECOMPUTE`, as selective activation
checkpointing marks its ops): the partitioner then computes them again in backward from those tensors. The weight
gradient then reads a cast of the decoded tensors (with FP8 activations those are FP8 themselves) rather than the
forward's cast of the exact ones: a second FP8 rounding of the same tensor, within the bound the tests derive.
A scale is a scalar, kept as it is: a tensor scaled from its own amax (msamp's warm-up, torchao's dynamic scaling) is
cast again with the forward's scale, its amax not computed again. A copy whose way back passes through anything else
(a GEMM, a reduction over a large tensor) is left to the partitioner.

On by default wherever compiled graphs store their saved tensors in FP8 themselves (the only graphs that keep such
copies past what their backward holds anyway); `LOWPREC_RECOMPUTE_FP8_COPIES=0` keeps the copies. On one H200 (d4096
proxy, msamp O2 with FP8 activations, compiled BF16 in the same call) it took msamp O2 act8 from 0.452x compiled BF16's
peak at 1.288x to 0.430x at 1.285x (results/gpu/2026-11-29-h200-verify-2e2cb06 and -recompute-511ecf5), its held-out
loss after 300 steps -0.60% of BF16's over two seeds (-1.14%, -0.06%; same folder); torchao act8's speed and peak did
not move (results/gpu/2026-11-28-h200x2-recompute-aabeb3e). There (torch 2.11) the second block's QKV/gate-up copies
stayed: their way back crossed the first block's down-projection GEMM. Each copy kept is logged at DEBUG with why.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

from ..utils.env import switch
from .joint_graph_passes import joint_graph_pass, joint_pass_set

_log = logging.getLogger(__name__)
ENV = "LOWPREC_RECOMPUTE_FP8_COPIES"
# tensors of at most this many elements (scales, amax windows) are kept where they are: saving them costs nothing
SMALL = 1 << 12
_FP8 = tuple(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
             if hasattr(torch, name))
# ops that only move, cast or clamp their input's values: cheap to run again in backward
_COPIES = ("aten.clone.", "aten._to_copy.", "prims.convert_element_type.", "aten.clamp.", "aten.clamp_min.",
           "aten.clamp_max.", "aten.contiguous.")


def setting() -> bool | None:
    """`LOWPREC_RECOMPUTE_FP8_COPIES` as set: True (1), False (0) or None (unset)."""
    return switch(ENV, "1 or unset: recompute in backward the FP8 copies of tensors a compiled graph's backward keeps "
                       "anyway; 0: keep them from the forward")


def requested() -> bool:
    """Whether graphs that store FP8 activations recompute their FP8 copies in backward: unless
    `LOWPREC_RECOMPUTE_FP8_COPIES=0`."""
    return setting() is not False


def _value(node: torch.fx.Node):
    return node.meta.get("val")


def _is_fp8(node: torch.fx.Node) -> bool:
    return getattr(_value(node), "dtype", None) in _FP8


def _is_small(node: torch.fx.Node) -> bool:
    value = _value(node)
    if not isinstance(value, torch.Tensor):
        return True  # a size, a dtype: no tensor to keep
    numel = value.numel()
    return type(numel) is int and numel <= SMALL  # a symbolic size is taken as large


def _is_view(node: torch.fx.Node) -> bool:
    return getattr(node.target, "is_view", False)


def _is_cheap(node: torch.fx.Node) -> bool:
    """A view, a cast or an elementwise op (no random one): recomputing it costs one pass over its inputs."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    tags = node.target.tags
    if torch.Tag.nondeterministic_seeded in tags:
        return False
    return _is_view(node) or torch.Tag.pointwise in tags or str(node.target).startswith(_COPIES)


def backward_nodes(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The joint graph's nodes that depend on an output gradient (`tangents_*` placeholders): its backward."""
    backward: set[torch.fx.Node] = set()
    for node in graph.nodes:  # topological order
        if (node.op == "placeholder" and node.name.startswith("tangents")) or any(
                arg in backward for arg in node.all_input_nodes):
            backward.add(node)
    return backward


def recompute_chain(copy: torch.fx.Node, backward: set[torch.fx.Node]) -> set[torch.fx.Node] | None:
    """The forward nodes to compute `copy` again from in backward: `copy` and the cheap ops above it, up to tensors
    the backward keeps anyway (used there directly), graph inputs and small tensors. None where the way up passes
    through anything else."""
    def kept_anyway(node: torch.fx.Node) -> bool:
        return node.op == "placeholder" or _is_small(node) or any(user in backward for user in node.users)

    if not _is_cheap(copy):
        _log.debug("FP8 copy %s kept: it is made by %s", copy.name, copy.target)
        return None
    chain, todo = {copy}, [copy]
    while todo:
        for arg in todo.pop().all_input_nodes:
            if arg in chain or kept_anyway(arg):
                continue
            if not _is_cheap(arg):
                # why a copy stays is what a user asks first (DEBUG: logging or TORCH_LOGS-style handlers)
                _log.debug("FP8 copy %s kept: %s (%s) on its way back is neither cheap nor kept by the backward",
                           copy.name, arg.name, arg.target)
                return None
            chain.add(arg)
            todo.append(arg)
    return chain


def mark_fp8_copies(graph: torch.fx.Graph) -> int:
    """Mark for recomputation every FP8 forward tensor of the joint `graph` that its backward reads, with the ops
    `recompute_chain` finds. Returns how many copies were marked."""
    from torch.utils.checkpoint import CheckpointPolicy

    backward = backward_nodes(graph)
    marked = 0
    for node in graph.nodes:
        if node in backward or node.op != "call_function" or not _is_fp8(node) or _is_small(node):
            continue
        if not any(user in backward for user in node.users):
            continue
        chain = recompute_chain(node, backward)
        # a chain of views alone would have the partitioner keep the tensor viewed: nothing saved
        if chain is None or all(_is_view(n) for n in chain):
            continue
        for n in chain:
            n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        marked += 1
    return marked


def graph_pass():
    """`mark_fp8_copies` as inductor's joint-graph post pass (one instance)."""
    return joint_graph_pass("RecomputeFP8Copies", mark_fp8_copies, __file__)


@contextlib.contextmanager
def recompute_fp8_copies(enabled: bool) -> Iterator[None]:
    """Around a compiled model's forward (where its graphs compile): inductor's joint-graph post pass set to this
    one, where `enabled` and no other post pass is set (a user's own is left alone, this one then not run)."""
    if not enabled:  # every forward of such a model comes through here: nothing more to do
        yield
        return
    with joint_pass_set("joint_custom_post_pass", graph_pass()):
        yield
