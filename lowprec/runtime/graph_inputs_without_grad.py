"""Which inputs of a compiled graph get no gradient: told to the in-graph FP8 storage, which keeps them as they are.

Compiled block by block, a Llama's decoder block takes the rotary embedding's cos/sin tables as inputs (the model
computes them once for every block), and saves them for backward: q and k's gradients go through them. The in-graph
storage packs what a graph saves of its inputs (`saved_tensors_hooks_filtering_mode="no_static"`), the block's
hidden-state input first of all; at the time it sees a saved input, a placeholder's fake tensor no longer says
whether the input needs a gradient. The joint graph does: its backward returns one gradient per input, None for an
input that needs none. `InputsWithoutGradient`, an inductor joint-graph pre-pass, records those placeholders'
names for the partition that follows (the saved-tensor hooks are traced into the forward right after it), and the
storage keeps each such input unpacked: a table the model holds anyway, whose FP8 copy would cost memory and round
every gradient through it by 2**-4.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from .joint_graph_passes import joint_graph_pass, joint_pass_set

# the joint graph last partitioned: its floating-point inputs without a gradient (placeholder names)
_LAST: set[str] = set()


def inputs_without_grad(graph: torch.fx.Graph) -> set[str]:
    """The names of the joint `graph`'s primal inputs whose gradient output is None, floating point only. The joint
    graph returns its forward's outputs, then one gradient per primal input, in order."""
    primals = [n for n in graph.nodes if n.op == "placeholder" and n.name.startswith("primals")]
    output = next((n for n in graph.nodes if n.op == "output"), None)
    if output is None or not primals:
        return set()
    flat = torch.utils._pytree.tree_leaves(output.args[0], is_leaf=lambda x: x is None)
    if len(flat) < len(primals):
        return set()
    grads = flat[len(flat) - len(primals):]

    def shape(node):
        return tuple(getattr(node.meta.get("val"), "shape", ())) if isinstance(node, torch.fx.Node) else None

    # each gradient has its input's shape: where one does not, the outputs are not laid out as read here, and no
    # input is named (packed, as before) rather than a wrong one kept
    if any(g is not None and shape(g) != shape(p) for p, g in zip(primals, grads)):
        return set()
    return {p.name for p, g in zip(primals, grads)
            if g is None and getattr(p.meta.get("val"), "is_floating_point", lambda: False)()}


def last_inputs_without_grad() -> set[str]:
    """What the last joint graph's pass recorded (empty where the pass did not run)."""
    return _LAST


def _record(graph: torch.fx.Graph) -> None:
    _LAST.clear()
    _LAST.update(inputs_without_grad(graph))


def graph_pass():
    """`InputsWithoutGradient`: records `inputs_without_grad` of each joint graph, changes nothing in it."""
    return joint_graph_pass("InputsWithoutGradient", _record, __file__)


@contextlib.contextmanager
def recording() -> Iterator[None]:
    """Around a compiled model's forward: inductor's joint-graph pre-pass set to `InputsWithoutGradient`, where no
    other is set (a user's own is left alone; the storage then packs such inputs, as before)."""
    with joint_pass_set("joint_custom_pre_pass", graph_pass()) as ours:
        if not ours:
            _LAST.clear()
        yield
