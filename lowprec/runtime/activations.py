"""`activation_dtype='fp8'`: the tensors autograd saves during a prepared model's forward, stored in FP8.

Every plain floating tensor autograd saves in the forward (the inputs of the Linear layers, norms,
activation functions and attention) is stored in E4M3 with a power-of-2 scale per 1x128 group
(`lowprec.kernels.activations`) through `torch.autograd.graph.saved_tensors_hooks` around the model's
forward, and decoded when backward needs it. The hooks are per process and see only tensors, not the
distributed engine (tested under DDP, FSDP2 and DeepSpeed ZeRO-1/2/3). With a compiled model they sit around
the compiled forward and store what the compiled graph saves (CUDA graphs are refused). Inside activation
checkpointing nothing is quantised twice: a non-reentrant checkpointed region's own hooks take its tensors (none
reach these), and any recomputation runs in backward, outside the forward these hooks wrap.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ..kernels.activations import PackedFP8, SpanKey, groups_fit, overlapping, pack_fp8, pack_traced_fp8, unpack_fp8
from ..kernels.cross_entropy import saving_for_backward
from ..planning.activations import MIN_ELEMENTS
from .activations_checks import check_activation_dtype  # noqa: F401 (prepare() checks)
from .activations_fp32 import NarrowedTensor, fp32_policy, narrow, widen
from .activations_in_graph import (
    graph_hooks,
    graph_hooks_context,
    graph_input_of,
    in_graph_requested,
    in_graph_wanted,
    inlining_supported,
    is_angle,
    is_attention_statistic,
    is_log_probabilities,
    static_shape,
    traced_node,
)
from .graph_inputs_without_grad import last_inputs_without_grad
from .loss import swap_causal_lm_loss
from .wrapping import models_of, wrap_forward

ACTIVATIONS_ATTR = "_lowprec_activation_storage"
# Autograd nodes of views between a saved tensor and the cast it views
_VIEWS = {"TBackward0", "TransposeBackward0", "PermuteBackward0", "ViewBackward0", "UnsafeViewBackward0",
          "ExpandBackward0", "AliasBackward0"}


@dataclass
class ActivationCounts:
    """What the hooks did since the counts were last reset: tensors packed (and their elements and bytes
    before and after), tensors left as they were because they are parameters or views of them, and
    saves that reused the FP8 copy of a tensor saved earlier in the same forward."""

    packed: int = 0
    packed_elements: int = 0
    bytes_before: int = 0
    bytes_after: int = 0
    parameters_kept: int = 0
    others_kept: int = 0
    shared: int = 0  # saves of a tensor already packed in the same forward: they share its FP8 copy
    weight_shaped_kept: int = 0  # of parameters_kept, kept for the shape and dtype of a kept layer's weight copy
    logsumexp_kept: int = 0  # attention's softmax log-sum-exp, kept in FP32 (FP8 would spoil the probabilities)
    log_probabilities_kept: int = 0  # a log-softmax's output (a loss's log-probabilities), kept for the same reason
    logits_kept: int = 0  # a compiled graph's logits (no autograd history, the output head's width): the same reason
    backend_kept: int = 0  # saved inside a module whose saved tensors are the backend's (`leave_alone`)
    # FP32 tensors with no autograd history: an eager model's inputs and constants (held anyway); every FP32 tensor a
    # compiled graph hands these hooks, among them rotary angles FP8 would spoil (activations_in_graph.is_angle)
    untracked_fp32_kept: int = 0
    # in an eager model, views of BF16/FP16 tensors with no autograd history: its constants (a rotary embedding's
    # cos/sin tables, of which every layer saves a view), held anyway; FP8 would round every gradient through them
    constants_kept: int = 0
    narrowed: int = 0  # of packed, FP32 tensors stored in BF16 (LOWPREC_FP8_ACTIVATIONS_FP32=bf16: activations_fp32)
    fp32_kept: int = 0  # FP32 tensors kept as they are (=keep, or =bf16 for a strided view)
    # in-graph storage (activations_in_graph): a compiled graph's saved tensors, counted once when the graph
    # compiles (not once a forward: the graph packs them from then on, with no hook called)
    traced_packed: int = 0
    traced_kept: int = 0


class FP8ActivationStorage:
    """The pack and unpack hooks of one prepared model; `counts` says what they did."""

    def __init__(self, model: nn.Module, min_elements: int = MIN_ELEMENTS, converted=None, in_graph: bool = False,
                 eager_model: bool = False):
        # Weights are saved by reference (their memory is held anyway): packing them would add a copy and
        # an error. One set of storage pointers, built once, catches the parameters and every view of them
        # (a transpose, a slice) at the cost of one lookup per saved tensor.
        self._parameter_storages = {p.untyped_storage().data_ptr() for p in model.parameters()
                                    if type(p) in (torch.Tensor, nn.Parameter)}
        self._parameter_ids = {id(p) for p in model.parameters()}
        # a compiled graph's input of one of these shapes is never packed (activations_in_graph.filtering_mode)
        self._parameter_shapes = {shape for p in model.parameters() for shape in (tuple(p.shape), tuple(p.shape)[::-1])}
        # Autocast saves its low-precision copy of a weight, not the weight: a layer kept in high precision
        # would then run its backward on an FP8 weight. A copy made with autograd names its parameter
        # (below); one of a frozen weight, or one a compiled graph saves, has no autograd history, so its
        # shape and dtype must tell. Only the weights of layers kept in high precision count (`converted`:
        # which modules the backend converted; their GEMMs take FP8 weights anyway): an activation of a
        # weight's shape (tokens == hidden size) would otherwise never be packed.
        self._weight_copy_keys = {(shape, dtype) for module in model.modules()
                                  if converted is None or not converted(module)
                                  for p in module.parameters(recurse=False) if p.dim() >= 2
                                  for shape in (tuple(p.shape), tuple(reversed(p.shape)))
                                  for dtype in (torch.bfloat16, torch.float16) if p.dtype != dtype}
        self.min_elements = min_elements
        self._head_widths = head_widths(model)
        self.counts = ActivationCounts()
        # The tensors packed in the forward under way: id -> (weak reference, version, packed). One tensor
        # is often saved by several ops (an RMSNorm's FP32 input by its square and its product, RoPE's
        # cos/sin by every layer): one FP8 copy serves them all, where autograd would have shared the
        # tensor itself. The weak reference and the version counter make sure it is that tensor, unchanged
        # (an id or an address can be reused once a tensor is freed).
        self._packed: dict[int, tuple[weakref.ref, int, PackedFP8]] = {}
        self._spans: dict[int, tuple[weakref.ref, SpanKey]] = {}  # id(base) -> (its weak reference, key)
        self._row_shapes: set[tuple[int, ...]] = set()  # shape[:-1] of the 4-D tensors saved in this forward
        self._storage_spans: dict[int, tuple[weakref.ref, SpanKey]] = {}  # storage address -> (first view, key)
        self._inside = 0  # forwards under way of modules whose saved tensors are left alone (`leave_alone`)
        self.in_graph = in_graph and inlining_supported()  # graphs encode their saves themselves, where torch can
        self._graph_hooks = graph_hooks() if self.in_graph else None  # its own: dynamo guards on their identity
        self._traced: set[tuple[int, str]] = set()  # (forward graph, node) already counted: torch traces each twice
        # FP32 tensors with no autograd history stay as saved (`ActivationCounts.untracked_fp32_kept`); False only
        # to compare these hooks with the in-graph form bit for bit
        self.keep_untracked_fp32 = True
        # only an eager model's tensors with no history are its constants: a compiled graph hands these hooks its
        # activations so (`eager_model`: the model is not compiled)
        self.keep_constants = eager_model
        self.fp32_policy = fp32_policy()

    def leave_alone(self, module: nn.Module) -> None:
        """Keep as they are the tensors saved while `module`'s forward runs."""
        def enter(*_):
            self._inside += 1

        def leave(*_):
            self._inside -= 1

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave, always_call=True)

    def pack(self, tensor: torch.Tensor):
        if self._inside:
            self.counts.backend_kept += 1
            return tensor
        if (type(tensor) is not torch.Tensor  # parameters, DTensors, FP8 tensor subclasses: theirs to store
                or not tensor.is_floating_point() or tensor.element_size() < 2 or tensor.dim() == 0
                or tensor.numel() < self.min_elements  # a 0-d tensor is a scale or a loss: nothing to save
                or overlapping(tensor)):  # an expanded view: its memory is smaller than its elements
            if id(tensor) in self._parameter_ids:
                self.counts.parameters_kept += 1
            else:
                self.counts.others_kept += 1
            return tensor
        # A view of a parameter outside the set built at install: FSDP2's unsharded parameters live in its
        # all-gather buffers, not in the sharded DTensors the model listed, and F.linear saves weight.t()
        if (tensor.untyped_storage().data_ptr() in self._parameter_storages or isinstance(tensor._base, nn.Parameter)
                or self._is_weight_copy(tensor)):
            self.counts.parameters_kept += 1
            return tensor
        if self._is_attention_logsumexp(tensor):
            self.counts.logsumexp_kept += 1
            return tensor
        # a log-softmax's output, or a view of it (nll_loss2d saves one for a [batch, classes, tokens] input), or
        # the logits lowprec's cross-entropy recomputes the probabilities from
        if saving_for_backward() or any(
                t is not None and t.grad_fn is not None and t.grad_fn.name() == "LogSoftmaxBackward0"
                for t in (tensor, tensor._base)):
            self.counts.log_probabilities_kept += 1
            return tensor
        untracked = tensor.grad_fn is None and not tensor.requires_grad
        if untracked and tensor.shape[-1] in self._head_widths:
            self.counts.logits_kept += 1
            return tensor
        if self.keep_untracked_fp32 and tensor.dtype == torch.float32 and untracked:
            self.counts.untracked_fp32_kept += 1
            return tensor
        # a view (cos.unsqueeze(1)) of a tensor with no history either: a compiled graph's outputs have no `_base`
        if self.keep_constants and untracked and tensor._base is not None and tensor._base.grad_fn is None:
            self.counts.constants_kept += 1
            return tensor
        if tensor.dim() == 4:  # a query, perhaps: its rows' shape tells its log-sum-exp, saved after it
            self._row_shapes.add(tuple(tensor.shape[:-1]))
        earlier = self._packed.get(id(tensor))
        if earlier is not None and earlier[0]() is tensor and earlier[1] == tensor._version:
            self.counts.shared += 1
            return earlier[2]
        if tensor.dtype == torch.float32 and self.fp32_policy != "fp8":
            if self.fp32_policy == "keep" or not tensor.is_contiguous():  # BF16 copies keep no strides
                self.counts.fp32_kept += 1
                return tensor
            packed = narrow(tensor)
            self.counts.narrowed += 1
        else:
            packed = pack_fp8(tensor, self._span_key(tensor))
        self._packed[id(tensor)] = (weakref.ref(tensor), tensor._version, packed)
        self.counts.packed += 1
        self.counts.packed_elements += tensor.numel()
        self.counts.bytes_before += tensor.numel() * tensor.element_size()
        self.counts.bytes_after += packed.nbytes()
        return packed

    def pack_traced(self, tensor: torch.Tensor):
        """`pack` for a tensor a graph being compiled saves (a fake tensor: its metadata only), the same rules as
        far as metadata tells them: parameters and buffers never come here (torch filters them out) and a graph
        input of a parameter's shape is kept, a copy of a kept layer's weight is told by its shape and dtype, an
        attention kernel's statistics by their node."""
        from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols, guard_or_false

        node = traced_node()
        if (not tensor.is_floating_point() or tensor.element_size() < 2 or tensor.dim() == 0
                or free_unbacked_symbols(tensor)  # a data-dependent size (a mask's count): no guard may ask it
                or guard_or_false(tensor.numel() < self.min_elements) or overlapping(tensor)
                or not groups_fit(tensor)
                or (static_shape(tensor), tensor.dtype) in self._weight_copy_keys
                or is_attention_statistic(node) or is_log_probabilities(node) or is_angle(node)
                or (node is None and static_shape(tensor) is not None and self._is_attention_logsumexp(tensor))
                or self._is_parameter_shaped_input(node) or self._is_input_without_grad(node)):
            self._count_traced(node, packed=False)
            return tensor
        if tensor.dim() == 4 and static_shape(tensor) is not None:
            self._row_shapes.add(static_shape(tensor)[:-1])
        if tensor.dtype == torch.float32 and self.fp32_policy != "fp8":
            self._count_traced(node, packed=self.fp32_policy == "bf16")
            # a plain (BF16 tensor, dtype) pair: what a graph may return from its forward
            return tensor if self.fp32_policy == "keep" else tuple(narrow(tensor))
        self._count_traced(node, packed=True)
        return pack_traced_fp8(tensor)

    @staticmethod
    def _is_input_without_grad(node) -> bool:
        """A graph input that gets no gradient (a rotary table every block takes): held anyway, and every gradient
        through it would be rounded (`graph_inputs_without_grad`)."""
        return node is not None and node.op == "placeholder" and node.name in last_inputs_without_grad()

    def _is_parameter_shaped_input(self, node) -> bool:
        base = graph_input_of(node)
        return base is not None and static_shape(base.meta["val"]) in self._parameter_shapes

    def _count_traced(self, node, packed: bool) -> None:
        key = (id(node.graph), node.name) if node is not None else None
        if key is not None and key in self._traced:
            return
        if key is not None:
            self._traced.add(key)
        if packed:
            self.counts.traced_packed += 1
        else:
            self.counts.traced_kept += 1

    def _span_key(self, tensor: torch.Tensor) -> SpanKey | None:
        """The key shared by the strided views of one tensor's memory saved in this forward (q, k, v of a fused
        QKV output), so that they decode into one buffer; None for a contiguous tensor, or one whose memory is
        over 4 times its size (a buffer that long would cost more than the views save)."""
        base = tensor._base
        length = tensor.untyped_storage().nbytes() // tensor.element_size()
        if tensor.is_contiguous() or length > 4 * tensor.numel():
            return None
        if base is None:
            # A compiled graph's outputs are views with no `_base`: their storage tells which share memory. The
            # first view seen keeps that storage, and so its address, while it lives: a later storage at the
            # same address (once it is freed) gets a key of its own.
            ptr = tensor.untyped_storage().data_ptr()
            entry = self._storage_spans.get(ptr)
            first = entry[0]() if entry is not None else None
            if first is None or first.untyped_storage().data_ptr() != ptr:
                entry = self._storage_spans[ptr] = (weakref.ref(tensor), SpanKey())
            return entry[1]
        entry = self._spans.get(id(base))
        if entry is None or entry[0]() is not base:  # an id can be reused once a tensor is freed
            entry = self._spans[id(base)] = (weakref.ref(base), SpanKey())
        return entry[1]

    def _is_attention_logsumexp(self, tensor: torch.Tensor) -> bool:
        """An attention kernel's softmax log-sum-exp (flash, memory-efficient, cuDNN): FP32, no gradient, one
        value per row of a 4-D query saved before it ([B, H, T], or [B, H, T, 1] from cuDNN). Backward
        recomputes the probabilities as exp(scores - lse): E4M3's 2**-4 relative error on lse becomes a
        factor of up to exp(|lse| / 16) on each probability (measured on CPU flash attention, BF16 [4, 8, 512, 64],
        causal: the q/k/v gradients' relative error 0.12-0.14 with it packed, 0.04-0.06 without, as
        tests/test_activation_storage.py checks). It is 1/head_dim of the query's size."""
        if tensor.dtype != torch.float32 or tensor.requires_grad:
            return False
        shape = tuple(tensor.shape)
        return shape in self._row_shapes or (len(shape) == 4 and shape[-1] == 1 and shape[:-1] in self._row_shapes)

    def _is_weight_copy(self, tensor: torch.Tensor) -> bool:
        fn = tensor.grad_fn
        if fn is None:  # (a view of) a copy of a frozen weight, or a compiled graph's: the same shape, another dtype
            if (tuple(tensor.shape), tensor.dtype) in self._weight_copy_keys:
                self.counts.weight_shaped_kept += 1
                return True
            return False
        while type(fn).__name__ in _VIEWS and fn.next_functions:  # the linear saves weight.t()
            fn = fn.next_functions[0][0]
        if type(fn).__name__ != "ToCopyBackward0" or not fn.next_functions:
            return False
        # the leaf the copy was made from: any Parameter, not only those listed at install (FSDP2's unsharded
        # parameters are other Parameter objects than the sharded ones the model lists)
        return isinstance(getattr(fn.next_functions[0][0], "variable", None), nn.Parameter)

    @staticmethod
    def unpack(saved):
        if isinstance(saved, NarrowedTensor):
            return widen(saved)
        return unpack_fp8(saved) if isinstance(saved, PackedFP8) else saved

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        """The hooks, around one forward; what was packed is forgotten after it (autograd's graph holds it)."""
        self._forget_forward()
        try:
            if self.in_graph:
                with graph_hooks_context(self, self._graph_hooks):
                    yield
            else:
                with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                    yield
        finally:
            self._forget_forward()

    def _forget_forward(self) -> None:
        """What one forward's saves told: its FP8 copies, views' spans, query row shapes, modules under way."""
        self._packed.clear()
        self._spans.clear()
        self._storage_spans.clear()
        self._row_shapes.clear()
        self._inside = 0


def head_widths(model: nn.Module) -> frozenset[int]:
    """The widths (vocabulary sizes) of the output heads a model names (Hugging Face's `get_output_embeddings`).
    A compiled graph hands the Python hooks plain tensors with no history: one of a head's width is the logits its
    loss recomputes the probabilities from (the in-graph form tells it by node: `is_log_probabilities`), which FP8
    would spoil: in one step's traces on the GPU (results/gpu/2026-11-28-h200-act8-bisect/round2) the one tensor
    the hooks stored in FP8 and the graphs did not, where the hooks trained 1.2% above BF16 and the graphs -0.8%;
    with it kept, the hooks trained -0.26% (results/gpu/2026-11-28-h200x2-hooks-largest-ca5c63f).
    A width another layer also has (a model as wide as its vocabulary) tells nothing and is left out."""
    heads, others = set(), set()
    for module in model.modules():
        try:
            head = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
        except (NotImplementedError, AttributeError):  # a model class without a head
            head = None
        width = getattr(head, "out_features", None) or getattr(getattr(head, "weight", None), "shape", (None,))[0]
        if isinstance(width, int) and width > 1:
            heads.add((id(head), width))
    head_ids = {i for i, _ in heads}
    for module in model.modules():
        if id(module) not in head_ids:  # a tied input embedding is (vocabulary, width): only its width is one
            others.update(w for w in (getattr(module, "in_features", None), getattr(module, "out_features", None),
                                      getattr(module, "embedding_dim", None)) if isinstance(w, int))
    return frozenset(w for _, w in heads if w not in others)


def install_activation_storage(prepared: nn.Module, inner: nn.Module, converted=None,
                               keep_saved_by=None, compiled: bool = False,
                               engine: str = "single") -> FP8ActivationStorage:
    """Run `prepared`'s forward inside the FP8 saved-tensor hooks; the storage is kept on `inner` (the
    unwrapped model) as `_lowprec_activation_storage`, for `activation_storage(model)`. What the modules
    `keep_saved_by(module)` names save in their forward is left as it is (`Backend.keeps_saved_tensors`).
    `compiled`: the model is compiled, under `engine` (whether its graphs then encode what they save:
    `in_graph_wanted`). A Hugging Face causal LM's default loss becomes one without FP32 copies of the logits
    (runtime/loss.py)."""
    in_graph = in_graph_wanted(compiled, engine)
    # only an explicit request is worth a warning: by default a torch that cannot inline keeps the Python hooks
    if in_graph and not inlining_supported() and in_graph_requested():
        warnings.warn("lowprec: LOWPREC_FP8_ACTIVATIONS_IN_GRAPH=1 needs a torch that inlines GraphModule "
                      f"saved-tensor hooks into compiled graphs (2.8 or later; this is {torch.__version__}): the "
                      "tensors compiled graphs save are stored in FP8 by the Python hooks after each graph instead",
                      stacklevel=3)
    storage = FP8ActivationStorage(inner, converted=converted, in_graph=in_graph, eager_model=not compiled)
    for module in inner.modules():
        if keep_saved_by is not None and keep_saved_by(module):
            storage.leave_alone(module)
    wrap_forward(prepared, storage.context)
    object.__setattr__(inner, ACTIVATIONS_ATTR, storage)
    # every model object of the chain: regional compilation runs a copy of the model, made before this
    for model in models_of(prepared, inner):
        swap_causal_lm_loss(model)
    return storage


def activation_storage(model: nn.Module) -> FP8ActivationStorage | None:
    """The FP8 activation storage of a model prepared with activation_dtype='fp8', else None: on the model, or
    on what it wraps. A wrapper (DDP, DeepSpeed) holds it as `.module`; Accelerate's regional compilation hands
    back a copy of the model with compiled blocks and keeps the model itself as `_orig_mod`, where the storage is."""
    return next((m.__dict__[ACTIVATIONS_ATTR] for m in models_of(model)
                 if ACTIVATIONS_ATTR in getattr(m, "__dict__", {})), None)
