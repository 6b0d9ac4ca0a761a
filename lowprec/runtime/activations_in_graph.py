"""FP8 saved activations inside compiled graphs: saved-tensor hooks that torch inlines into a compiled forward.

With Python hooks (`FP8ActivationStorage.pack`), a compiled block hands every tensor it saves to the hook at the
end of its forward, in high precision, and each is encoded by a kernel of its own (and decoded by another at
the start of the backward): one more read and write of every saved tensor each way, and a Python call each.
On one H200 that cost 22 ms a step on the d4096 proxy (results/gpu/2026-11-27-h200-memory-7ec8725).

When the hooks on top of autograd's stack are `torch.fx.GraphModule`s, AOTAutograd traces them into the graph
it compiles: the pack hook into the forward's epilogue, the unpack hook into the backward's prologue, so that
inductor can fuse the FP8 encode into the kernel that produced the tensor and the decode into the one that
reads it (`torch._functorch._aot_autograd.graph_compile.maybe_inline_graph_saved_tensors_hooks`, torch 2.8 and
later). The hooks here are such GraphModules: each calls one function that torch.fx does not trace into
(`torch.fx.wrap`). Called on a tensor being traced (a fake tensor), it applies the storage's rules to the
tensor's metadata and returns the graph form (`kernels.activations.pack_traced_fp8`); called on a real tensor
(an op outside a compiled graph), it is the storage's own `pack`/`unpack`. What the graph saves of its inputs
is packed too, except parameters and buffers, any input of a parameter's shape
(`saved_tensors_hooks_filtering_mode="no_static"` while the forward compiles, `filtering_mode`) and any input that gets
no gradient (a rotary table: `graph_inputs_without_grad`): a block's input,
which nothing else holds once the next block has run, is then kept in FP8 only, as with the Python hooks.

On by default for models compiled through Accelerate's dynamo plugin on one process
(`LOWPREC_FP8_ACTIVATIONS_IN_GRAPH` unset, `DEFAULT_ENGINES`): on one H200 it took the cost of FP8 activations from
26 to 9 ms a step at the same peak (results/gpu/2026-11-27-h200-memory-d8a48fa). A model the user compiled with
`torch.compile` themselves is not seen as compiled and keeps the Python hooks unless `1` is set. `0` keeps the
Python hooks; `1` asks for it in an eager model too, where only graphs compiled inside it (msamp's compiled FP8
layers) are affected.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterator

import torch

from ..kernels.activations import PackedFP8, unpack_fp8, unpack_traced_fp8
from ..utils.env import switch
from .activations_fp32 import NarrowedTensor, widen
from .fp8_copies_recompute import recompute_fp8_copies, requested
from .graph_inputs_without_grad import recording

ENV = "LOWPREC_FP8_ACTIVATIONS_IN_GRAPH"
# the storages whose forward is under way, innermost last: the hooks are module-level functions
_ACTIVE: list = []


def in_graph_requested() -> bool | None:
    """`LOWPREC_FP8_ACTIVATIONS_IN_GRAPH`: 1 stores compiled graphs' saved tensors in FP8 inside the graphs, 0
    through Python hooks around them; None where unset (`in_graph_wanted` decides)."""
    return switch(ENV, "1: encode the tensors a compiled graph saves inside the graph; 0: through Python hooks after "
                       "it; unset: 1 for a model compiled on one process")


# Where a compiled model encodes inside its graphs by default: measured on one GPU only. Under DDP, FSDP2 and
# DeepSpeed the graphs (DDP's split per bucket; FSDP2's and ZeRO-3's gathered weights, which the rules tell by
# shape) have not run with these hooks yet, so the Python hooks stay their default until they have.
DEFAULT_ENGINES = ("single",)


def in_graph_wanted(compiled: bool, engine: str = "single") -> bool:
    """Whether a model (`compiled`: through Accelerate's dynamo plugin; `engine`: RunContext.engine) stores its
    graphs' saved tensors in FP8 inside them: as `LOWPREC_FP8_ACTIVATIONS_IN_GRAPH` says, else for compiled
    models on one process (measured faster there)."""
    requested = in_graph_requested()
    return (compiled and engine in DEFAULT_ENGINES) if requested is None else requested


def graphs_store_fp8(recipe, context) -> bool:
    """Whether a model prepared with `recipe` under `context` (a RunContext) has its compiled graphs store their
    saved tensors in FP8 themselves: FP8 activations, wanted inside the graphs, and a torch that inlines the hooks."""
    return (recipe.activation_dtype == "fp8" and in_graph_wanted(context.compiled, context.engine)
            and inlining_supported())


def inlining_supported() -> bool:
    """Whether this torch inlines GraphModule saved-tensor hooks into compiled graphs."""
    try:
        from torch._functorch._aot_autograd import utils
    except ImportError:
        return False
    return hasattr(utils, "saved_tensors_hooks_are_inlineable")


def _hook_context():
    try:
        from torch._functorch._aot_autograd.graph_compile import _get_saved_tensor_hook_context
    except ImportError:
        return None
    return _get_saved_tensor_hook_context


def traced_node():
    """The forward graph's node whose value the pack hook is tracing, where torch says (an API it marks as
    unstable: None if absent)."""
    get = _hook_context()
    state = get() if get is not None else None
    return state.get("_node") if state else None


def static_shape(tensor: torch.Tensor) -> tuple[int, ...] | None:
    """`tensor`'s shape as ints, or None where a size is symbolic (dynamic shapes): parameters, and so their
    copies and the statistics compared with them, have static shapes."""
    shape = tuple(tensor.shape)
    return shape if all(type(size) is int for size in shape) else None


def graph_input_of(node):
    """The graph input `node` is, or is a view of (a transpose, a reshape): None if it is computed in the graph."""
    while node is not None and node.op == "call_function" and getattr(node.target, "is_view", False) and node.args:
        node = node.args[0] if hasattr(node.args[0], "op") else None
    return node if node is not None and node.op == "placeholder" else None


def filtering_mode() -> str:
    """Which saved tensors torch hands the hooks: the graph's inputs too, but for parameters and buffers
    ("no_static"), where the hooks can see each one's node (a graph input of a parameter's shape is then kept:
    one that dynamo did not mark static, FSDP2's unsharded weight, must not be copied); only the graph's own
    intermediates ("donated", torch's default) otherwise."""
    return "no_static" if _hook_context() is not None else "donated"


def is_attention_statistic(node) -> bool:
    """Whether `node` is an output of an attention kernel other than its first (the softmax log-sum-exp, RNG
    state): never packed (see `FP8ActivationStorage._is_attention_logsumexp`)."""
    if node is None or node.op != "call_function" or node.target is not operator.getitem:
        return False
    source, index = node.args[0], node.args[1]
    return index != 0 and "attention" in str(getattr(source, "target", ""))


def is_log_probabilities(node) -> bool:
    """Whether `node` is a step of a log-softmax (a cross-entropy's; the compiler decomposes it, and its row max may
    come out as an amax of its own), or feeds one through casts, views and elementwise ops (BF16 logits cast up,
    divided by a temperature, soft-capped): never packed. Backward takes exp() of what it saves of these
    (the decomposed form saves the logits and recomputes the log-probabilities), where FP8's 2**-4 relative error
    in log space becomes a large one in the probabilities (a 32000-way softmax's gradient 28% off, its rows summing
    to 1.04: results/cpu/2026-11-27-log-probabilities-fp8)."""
    def log_softmax(n) -> bool:
        return n.op == "call_function" and "_log_softmax" in str(n.meta.get("original_aten") or n.target)

    return node is not None and (log_softmax(node) or _feeds(node, log_softmax))


# the ops whose input is an angle: an error in it is an error of the angle itself, whatever its size
_PERIODIC = ("aten.sin.", "aten.cos.")


def is_angle(node) -> bool:
    """Whether `node` feeds a sine or a cosine through casts, views, concatenations and elementwise ops: a rotary
    embedding's angles, position x frequency (HF's `freqs`, `emb = cat(freqs, freqs)`), which a compiled graph saves
    and takes cos/sin of again in backward rather than saving the tables. Never packed: FP8's 2**-4 relative error on
    an angle of up to the sequence length in radians is a wrong angle altogether (on the d4096 proxy, T=2048, packing
    it put the held-out loss 10% above BF16's; keeping it, 0.6-2.4%: results/gpu/2026-11-28-h200-act8-bisect)."""
    def periodic(n) -> bool:
        return n.op == "call_function" and str(n.target).startswith(_PERIODIC)

    return node is not None and _feeds(node, periodic, through_cat=True)


def _feeds(node, target, depth: int = 6, through_cat: bool = False) -> bool:
    """Whether a user of `node`, or of what it becomes through at most `depth` value-preserving ops
    (`_passes_values`, and concatenation where `through_cat`), is a node `target` says yes to."""
    for user in node.users:
        if target(user):
            return True
        passes = _passes_values(user) or (through_cat and "aten.cat" in str(user.target))
        if depth and passes and _feeds(user, target, depth - 1, through_cat):
            return True
    return False


def _passes_values(node) -> bool:
    """A cast, a view or an elementwise op: its output is its inputs' values, moved or remapped one by one (the
    softmax's own subtraction of the row max is one, which inductor rewrites out of the decomposition)."""
    if node.op != "call_function":
        return False
    return (getattr(node.target, "is_view", False) or "convert_element_type" in str(node.target)
            or torch.Tag.pointwise in getattr(node.target, "tags", ()))


def _is_traced(tensor: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(tensor)


@torch.fx.wrap
def _pack(tensor: torch.Tensor):
    if not _ACTIVE:  # the hooks outlived their forward (autograd holds no reference to them)
        return tensor
    storage = _ACTIVE[-1]
    return storage.pack_traced(tensor) if _is_traced(tensor) else storage.pack(tensor)


@torch.fx.wrap
def _unpack(saved):
    if isinstance(saved, torch.Tensor):
        return saved
    if isinstance(saved, PackedFP8):
        return unpack_fp8(saved)
    if len(saved) == 2:  # an FP32 tensor stored in BF16, by the hooks or as a graph's plain pair (activations_fp32)
        return widen(NarrowedTensor(*saved))
    return unpack_traced_fp8(saved)


def _pack_hook(tensor):
    return _pack(tensor)


def _unpack_hook(saved):
    return _unpack(saved)


def graph_hooks() -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """A new pair of pack and unpack hooks as GraphModules, for one storage. Dynamo guards a compiled graph on the
    hooks it was compiled under (their identity): a graph compiled under one storage's hooks, whose rules (size
    threshold, kept layers' weights, parameter shapes) it carries, is never reused under another's."""
    return torch.fx.symbolic_trace(_pack_hook), torch.fx.symbolic_trace(_unpack_hook)


@contextlib.contextmanager
def graph_hooks_context(storage, hooks: tuple[torch.fx.GraphModule, torch.fx.GraphModule]) -> Iterator[None]:
    """`storage`'s rules as its GraphModule `hooks` (from `graph_hooks`), around one forward, the graphs' inputs
    without a gradient recorded for them (`graph_inputs_without_grad`); the graphs compiled in it recompute in
    backward the FP8 copies they would keep (`fp8_copies_recompute`; not with `LOWPREC_RECOMPUTE_FP8_COPIES=0`)."""
    import torch._functorch.config as functorch_config  # not imported by `import torch` alone

    _ACTIVE.append(storage)
    try:
        with functorch_config.patch(saved_tensors_hooks_filtering_mode=filtering_mode()), recording(), \
                recompute_fp8_copies(requested()), torch.autograd.graph.saved_tensors_hooks(*hooks):
            yield
    finally:
        # this storage's own entry (the last one that is it), whatever order other contexts end in
        del _ACTIVE[len(_ACTIVE) - 1 - _ACTIVE[::-1].index(storage)]
