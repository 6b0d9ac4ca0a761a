"""FP8 activations inside compiled graphs (the default for compiled models; `LOWPREC_FP8_ACTIVATIONS_IN_GRAPH`):
what a compiled graph saves for backward is encoded in FP8 inside the graph (GraphModule saved-tensor hooks that
AOTAutograd inlines), on CPU with inductor.

The encode and decode are `pack_fp8`'s definitions traced into the graph, so the gradients must be those of the
Python hooks bit for bit, and the compiled backward must hold FP8 where the Python hooks would have packed.
"""

from __future__ import annotations

import contextlib
import os
import sys

import pytest
import torch
from torch import nn

from lowprec.kernels.activations import (
    PackedFP8,
    groups_fit,
    pack_fp8,
    pack_traced_fp8,
    unpack_fp8,
    unpack_traced_fp8,
)
from lowprec.runtime.activations import FP8ActivationStorage
from lowprec.runtime.activations_in_graph import ENV, in_graph_requested, in_graph_wanted, inlining_supported

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from headline import Block  # noqa: E402 - the proxy's block: fused QKV, SDPA, RMSNorm, fused gate/up

pytestmark = pytest.mark.skipif(not inlining_supported(), reason="this torch does not inline GraphModule hooks")
GRAD_BOUND = 0.10  # as tests/test_activation_storage.py


@pytest.mark.parametrize("view", ["contiguous", "transposed slice", "transpose", "a single short group"])
def test_the_graph_form_stores_what_pack_fp8_stores(view):
    torch.manual_seed(0)
    qkv = torch.randn(2, 64, 3, 2, 128, dtype=torch.bfloat16)
    tensor = {"contiguous": qkv[:, :, 0].contiguous(), "transposed slice": qkv[:, :, 1].transpose(1, 2),
              "transpose": torch.randn(256, 384).t(), "a single short group": torch.randn(300, 100) * 1e3}[view]
    assert groups_fit(tensor)
    packed = pack_traced_fp8(tensor)
    # what a graph can return from its forward: tensors (FP8 data, int8 exponents), sizes and a dtype
    data, exponent, shape, dtype = packed
    assert data.dtype == torch.float8_e4m3fn and exponent.dtype == torch.int8 and dtype == tensor.dtype
    assert all(isinstance(n, int) for n in shape)
    back = unpack_traced_fp8(packed)
    assert back.shape == tensor.shape and back.dtype == tensor.dtype
    assert torch.equal(back, unpack_fp8(pack_fp8(tensor)))  # the same groups and values as the Python hooks'


@pytest.mark.parametrize(("shape", "fits"), [((4, 128), True), ((4, 100), True), ((4, 384), True), ((4, 200), False),
                                             ((384, 200), False)])
def test_only_whole_groups_are_taken(shape, fits):
    assert groups_fit(torch.empty(shape)) is fits


def test_non_finite_values_stay_non_finite():
    tensor = torch.randn(4, 256)
    tensor[0, 3], tensor[1, 200], tensor[2, 7] = float("nan"), float("inf"), -float("inf")
    back = unpack_traced_fp8(pack_traced_fp8(tensor))
    assert torch.isnan(back[0, 3]) and not torch.isfinite(back[1, 200]) and not torch.isfinite(back[2, 7])
    assert torch.isfinite(back[3]).all()


def _compiled_blocks(mode: str, storage_kwargs=None):
    """Two proxy blocks, each compiled, under autocast: x's gradient, the parameters' gradients, the storage, and
    (dtype, shape) of what the compiled graphs hold for backward."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(Block(256, 512), Block(256, 512))
    x = torch.randn(2, 64, 256, generator=torch.Generator().manual_seed(1)).requires_grad_()
    storage, hooks = None, contextlib.nullcontext()
    if mode != "none":
        storage = FP8ActivationStorage(model, in_graph=mode == "graph", **(storage_kwargs or dict(min_elements=0)))
        # the Python hooks keep what a compiled graph saves in FP32 (they cannot tell a rotary angle, which the graph
        # form keeps by its node): told not to, they must store exactly what the graphs do
        storage.keep_untracked_fp32 = mode != "python-all"
        hooks = storage.context()
    blocks = [torch.compile(b, backend="inductor") for b in model]
    with torch.autocast("cpu", dtype=torch.bfloat16), hooks:
        y = x
        for block in blocks:
            y = block(y)
    held = _held(y)
    y.float().square().sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return x.grad.clone(), grads, storage, held, model


def test_compiled_blocks_encode_inside_the_graph_exactly_as_the_python_hooks_do():
    reference_x, reference, _, held_plain, model = _compiled_blocks("none")
    python_x, python, python_storage, _, _ = _compiled_blocks("python-all")
    graph_x, graph, storage, held, _ = _compiled_blocks("graph")
    # the same definitions, traced into the graph: the same bits
    assert torch.equal(graph_x, python_x) and all(torch.equal(graph[n], python[n]) for n in python)
    assert (graph_x - reference_x).norm() / reference_x.norm() <= GRAD_BOUND
    for name, ref in reference.items():
        assert (graph[name].float() - ref.float()).norm() / ref.float().norm() <= GRAD_BOUND, name
    # nothing went through the Python hook: the graphs encoded what they saved
    assert storage.counts.packed == 0 and storage.counts.traced_packed >= 6 and python_storage.counts.packed >= 12
    fp8 = [shape for dtype, shape in held if dtype == torch.float8_e4m3fn]
    assert len(fp8) >= 12
    # what stays in high precision: parameters (the norms' weights), autocast's copies of the weights, and the
    # attention's log-sum-exp (FP32, one per query row); no activation of the block's shape
    params = {(p.dtype, tuple(p.shape)) for p in model.parameters()}
    weight_copies = {(torch.bfloat16, tuple(p.shape)) for p in model.parameters() if p.dim() == 2}
    kept = {entry for entry in held if entry[0] not in (torch.float8_e4m3fn, torch.int8)}
    assert kept <= params | weight_copies | {(torch.float32, (2, 2, 64))}
    assert (torch.float32, (2, 2, 64)) in kept  # the log-sum-exp, as held without the hooks
    assert any(shape == (2, 64, 256) for _, shape in held_plain) and not any(s == (2, 64, 256) for _, s in held)


def test_dynamic_shapes_compile_once_and_stay_within_the_bound():
    # symbolic sizes: no shape is hashed or compared with a parameter's as an int; one graph serves every length
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Block(256, 512)
    storage = FP8ActivationStorage(model, min_elements=0, in_graph=True)
    compiled = torch.compile(model, backend="inductor", dynamic=True)
    graphs = counters["stats"]["unique_graphs"]
    for tokens in (64, 96, 128):
        x = torch.randn(2, tokens, 256, generator=torch.Generator().manual_seed(tokens)).requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16), storage.context():
            y = compiled(x)
        y.float().sum().backward()
        fp8_grad = x.grad.clone()
        x.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(x).float().sum().backward()
        assert (fp8_grad - x.grad).norm() / x.grad.norm() <= GRAD_BOUND, tokens
    assert counters["stats"]["unique_graphs"] - graphs == 1
    assert storage.counts.packed == 0 and storage.counts.traced_packed >= 6


def _held(y) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    """(dtype, shape) of what the compiled graphs behind `y` hold for backward."""
    held, stack, seen = [], [y.grad_fn], set()
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        if type(fn).__name__.startswith("CompiledFunction"):
            held += [(t.dtype, tuple(t.shape)) for t in fn.saved_tensors]
        stack += [next_fn for next_fn, _ in fn.next_functions]
    return held


def test_a_second_length_recompiles_with_dynamic_shapes_and_still_packs():
    # a plain torch.compile turns a size dynamic when a second one comes (automatic dynamic shapes)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Block(256, 512)
    storage = FP8ActivationStorage(model, min_elements=0, in_graph=True)
    compiled = torch.compile(model, backend="inductor")
    for tokens in (64, 96):
        x = torch.randn(2, tokens, 256, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16), storage.context():
            y = compiled(x)
        assert any(dtype == torch.float8_e4m3fn for dtype, _ in _held(y)), tokens
        y.float().sum().backward()
        assert torch.isfinite(x.grad).all()


def test_a_width_that_is_not_whole_groups_is_kept_as_it_is():
    # 200 and 300 columns would need a padded group: inside a graph that is left alone (inductor's CPU decode of a
    # padded row wrote 128 of its 200 columns), and the gradients are those without the hooks
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(200, 300), nn.GELU(), nn.Linear(300, 200))
    x = torch.randn(64, 200, requires_grad=True)
    model(x).sin().sum().backward()
    reference = x.grad.clone()
    x.grad = None
    storage = FP8ActivationStorage(model, min_elements=0, in_graph=True)
    compiled = torch.compile(lambda t: model(t).sin(), backend="inductor")
    with storage.context():
        y = compiled(x)
    assert not any(dtype == torch.float8_e4m3fn for dtype, _ in _held(y))
    y.sum().backward()
    assert storage.counts.traced_packed == 0 and storage.counts.traced_kept > 0
    torch.testing.assert_close(x.grad, reference)


def test_each_storage_gets_graphs_with_its_own_rules():
    # compiled code is shared between instances of a module: a graph carries the rules of the storage it was
    # compiled under, so another storage's hooks (other ids) must get a graph of their own
    torch._dynamo.reset()
    torch.manual_seed(0)
    first, second = Block(256, 512), Block(256, 512)
    packs = FP8ActivationStorage(first, min_elements=0, in_graph=True)
    keeps = FP8ActivationStorage(second, min_elements=10**9, in_graph=True)
    x = torch.randn(2, 64, 256, requires_grad=True)
    for model, storage, fp8 in [(first, packs, True), (second, keeps, False), (first, packs, True)]:
        with torch.autocast("cpu", dtype=torch.bfloat16), storage.context():
            y = torch.compile(model, backend="inductor")(x)
        assert any(dtype == torch.float8_e4m3fn for dtype, _ in _held(y)) is fp8
        y.float().sum().backward()
    assert keeps.counts.traced_kept > 0 and keeps.counts.traced_packed == 0 and packs.counts.traced_packed > 0


def test_the_size_threshold_applies_inside_the_graph():
    # at the default threshold (2**14 elements) the per-row norm statistics (2 x 64) stay as they are
    _, _, storage, held, _ = _compiled_blocks("graph", dict(min_elements=2**14))
    assert (torch.float32, (2, 64, 1)) in held and storage.counts.traced_kept > 0


def test_eager_ops_outside_the_graph_still_go_through_the_python_hook():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.GELU(), Block(256, 512))
    storage = FP8ActivationStorage(model, min_elements=0, in_graph=True)
    compiled_block = torch.compile(model[2], backend="inductor")
    x = torch.randn(2, 64, 256, requires_grad=True)
    with storage.context():
        y = compiled_block(model[1](model[0](x)))
    y.sum().backward()
    assert storage.counts.packed >= 1 and storage.counts.traced_packed >= 1
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_a_graph_input_of_a_parameters_shape_is_kept():
    # FSDP2's unsharded weights reach a compiled block as inputs: one of a parameter's shape is never copied to FP8
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.GELU())
    storage = FP8ActivationStorage(model, min_elements=0, in_graph=True)
    compiled = torch.compile(lambda w, x: torch.nn.functional.gelu(x @ w), backend="inductor")
    weight_like = torch.randn(256, 256, requires_grad=True)
    other = torch.randn(128, 256, requires_grad=True)
    with storage.context():
        y = compiled(weight_like, other)
    held = [(t.dtype, tuple(t.shape)) for t in y.grad_fn.saved_tensors]
    y.sum().backward()
    assert (torch.float32, (256, 256)) in held  # kept as it was
    assert not any(shape == (128, 256) and dtype == torch.float32 for dtype, shape in held)  # the other input packed
    assert storage.counts.traced_kept >= 1 and storage.counts.traced_packed >= 1


@pytest.mark.parametrize(("value", "expected", "eager", "compiled"), [
    (None, None, False, True), ("", None, False, True), ("0", False, False, False), ("1", True, True, True)])
def test_the_switch_and_its_default_for_compiled_models(monkeypatch, value, expected, eager, compiled):
    if value is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, value)
    assert in_graph_requested() is expected
    assert in_graph_wanted(False) is eager and in_graph_wanted(True) is compiled
    # under the other engines the default stays the Python hooks (not yet run there); asked for, it applies
    for engine in ("ddp", "fsdp2", "deepspeed"):
        assert in_graph_wanted(True, engine) is (value == "1")


def test_a_bad_switch_names_the_variable_and_its_values(monkeypatch):
    monkeypatch.setenv(ENV, "yes")
    with pytest.raises(ValueError, match=rf"{ENV}='yes' is not one of '0', '1'"):
        in_graph_requested()


def test_a_torch_that_cannot_inline_keeps_the_python_hooks(monkeypatch):
    import lowprec.runtime.activations as activations

    monkeypatch.setattr(activations, "inlining_supported", lambda: False)
    assert FP8ActivationStorage(nn.Linear(2, 2), in_graph=True).in_graph is False


@pytest.mark.usefixtures("fresh_accelerate_state")
@pytest.mark.parametrize("switch", [None, "1"])
@pytest.mark.parametrize("backend", ["torchao", "msamp"])
def test_through_the_accelerator_with_a_compiled_model(backend, switch, monkeypatch):
    pytest.importorskip("torchao")
    from test_activation_storage import _compiled, batches

    from lowprec.runtime.activations import activation_storage

    if switch is None:  # the default for a compiled model
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, switch)
    x, y = batches(1)[0]
    reference, _, _ = _compiled(backend, None, x, y)
    fp8, model, accelerator = _compiled(backend, "fp8", x, y)
    storage = activation_storage(model)
    assert storage.in_graph and storage.counts.traced_packed >= 2
    assert len(reference) >= 6 and reference.keys() == fp8.keys()
    for name, ref in reference.items():
        assert (fp8[name] - ref).norm() / ref.norm() <= GRAD_BOUND, name
    assert any(not torch.equal(fp8[n], reference[n]) for n in reference)
    assert ENV in accelerator.precision_plan.activations.other_tensors


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_asking_for_it_on_a_torch_that_cannot_inline_says_so(monkeypatch):
    import lowprec.runtime.activations as activations
    import lowprec.runtime.activations_in_graph as activations_in_graph
    from lowprec import Accelerator, FP8RecipeKwargs

    pytest.importorskip("torchao")
    monkeypatch.setenv(ENV, "1")
    monkeypatch.setattr(activations, "inlining_supported", lambda: False)
    # the plan and the compile options ask activations_in_graph.graphs_store_fp8, which asks this
    monkeypatch.setattr(activations_in_graph, "inlining_supported", lambda: False)
    accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[FP8RecipeKwargs(
        backend="torchao", skip_slow_shapes=False, activation_dtype="fp8")])
    with pytest.warns(UserWarning, match="LOWPREC_FP8_ACTIVATIONS_IN_GRAPH=1 needs a torch that inlines"):
        model = accelerator.prepare(nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128)))
    assert activations.activation_storage(model).in_graph is False
    assert ENV not in accelerator.precision_plan.activations.other_tensors


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_zero_keeps_the_python_hooks_in_a_compiled_model(monkeypatch):
    pytest.importorskip("torchao")
    from test_activation_storage import _compiled, batches

    from lowprec.runtime.activations import activation_storage

    monkeypatch.setenv(ENV, "0")
    x, y = batches(1)[0]
    _, model, accelerator = _compiled("torchao", "fp8", x, y)
    storage = activation_storage(model)
    assert not storage.in_graph and storage.counts.traced_packed == 0 and storage.counts.packed >= 2
    assert "inside the graph" not in accelerator.precision_plan.activations.other_tensors


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_an_eager_model_keeps_the_python_hooks_by_default(monkeypatch):
    pytest.importorskip("torchao")
    from lowprec import Accelerator, FP8RecipeKwargs
    from lowprec.runtime.activations import activation_storage

    monkeypatch.delenv(ENV, raising=False)
    accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[FP8RecipeKwargs(
        backend="torchao", skip_slow_shapes=False, activation_dtype="fp8")])
    model = accelerator.prepare(nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128)))
    assert activation_storage(model).in_graph is False
    assert "inside the graph" not in accelerator.precision_plan.activations.other_tensors


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_the_default_on_a_torch_that_cannot_inline_keeps_the_python_hooks_quietly(monkeypatch):
    import warnings

    import lowprec.runtime.activations as activations
    import lowprec.runtime.activations_in_graph as activations_in_graph

    pytest.importorskip("torchao")
    from test_activation_storage import _compiled, batches

    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr(activations, "inlining_supported", lambda: False)
    # the plan and the compile options ask activations_in_graph.graphs_store_fp8, which asks this
    monkeypatch.setattr(activations_in_graph, "inlining_supported", lambda: False)
    x, y = batches(1)[0]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*LOWPREC_FP8_ACTIVATIONS_IN_GRAPH")
        _, model, accelerator = _compiled("torchao", "fp8", x, y)
    assert activations.activation_storage(model).in_graph is False
    assert "inside the graph" not in accelerator.precision_plan.activations.other_tensors


@pytest.mark.slow
def test_under_ddp_asked_for_it_encodes_inside_the_graphs_and_trains_as_the_python_hooks(tmp_path):
    """Two CPU ranks, DDP, regional compilation: with LOWPREC_FP8_ACTIVATIONS_IN_GRAPH=1 the compiled blocks encode
    inside their graphs, the ranks' weights stay equal, and the first step's DDP-averaged gradients are within the
    bound of the run without FP8 activations, as the Python hooks' (=0) are. Not bit for bit with the hooks here:
    the encode inside the forward graph changes inductor's fusions, and so the roundings of the forward itself (the
    first losses differ by 1e-4; the hooks' forward is the reference's exactly), which roughly doubles the error."""
    from conftest import run_two_ranks

    script = os.path.join(os.path.dirname(__file__), "distributed", "activations_in_graph_ddp.py")
    runs = run_two_ranks(script, out=tmp_path / "result.json", timeout=900)
    graph, hooks = runs["1"], runs["0"]
    assert graph["engine"] == hooks["engine"] == "ddp"
    assert graph["in_graph"] and graph["traced_packed"] >= 2 and graph["plan_says_in_graph"]
    assert not hooks["in_graph"] and hooks["traced_packed"] == 0 and hooks["packed"] >= 2
    assert not hooks["plan_says_in_graph"]
    assert graph["max_param_diff_across_ranks"] == 0.0 and hooks["max_param_diff_across_ranks"] == 0.0
    assert graph["losses"] == pytest.approx(hooks["losses"], rel=1e-2)
    for name, reference in runs["reference"]["first_grads"].items():  # the first step's, DDP-averaged
        reference = torch.tensor(reference)
        error = {run: (torch.tensor(r["first_grads"][name]) - reference).norm() / reference.norm()
                 for run, r in (("graph", graph), ("hooks", hooks))}
        assert error["graph"] <= GRAD_BOUND and error["hooks"] <= GRAD_BOUND, (name, error)


@pytest.mark.parametrize("logits_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("logits_of", ["plain", "temperature", "soft cap"])
def test_a_compiled_losss_log_probabilities_are_not_encoded(logits_dtype, logits_of):
    # the compiled cross-entropy saves its log-probabilities (decomposed: the log-softmax's last op); encoded in FP8,
    # the exp() of its backward would spoil the probabilities (tests/test_activation_storage.py)
    import torch.nn.functional as F

    torch._dynamo.reset()
    torch.manual_seed(0)
    head = nn.Linear(256, 32000, bias=False, dtype=logits_dtype)
    x = torch.randn(64, 256, dtype=logits_dtype, requires_grad=True)
    target = torch.randint(0, 32000, (64,))

    def loss_of(h, t):
        logits = head(h).float()  # as Hugging Face's loss: BF16 logits cast up first
        logits = {"plain": logits, "temperature": logits / 2.0, "soft cap": 30.0 * torch.tanh(logits / 30.0)}[logits_of]
        return F.cross_entropy(logits, t)

    compiled = torch.compile(loss_of, backend="inductor")
    reference, = torch.autograd.grad(compiled(x, target), x)
    storage = FP8ActivationStorage(head, min_elements=0, in_graph=True)
    with storage.context():
        loss = compiled(x, target)
    # the logits (250 groups of 128) and the softmax's row max (a group of 1) stay as they are; x is encoded
    assert [shape for dtype, shape in _held(loss) if dtype == torch.float8_e4m3fn] == [(64, 2, 128)]
    grad, = torch.autograd.grad(loss, x)
    assert (grad.float() - reference.float()).norm() / reference.float().norm() < 1e-6


class RotaryAttention(nn.Module):
    """Attention with Hugging Face's rotary embedding computed in the graph from the positions: angle = position x
    frequency, up to the sequence length in radians, cos/sin taken in FP32."""

    def __init__(self, d: int = 256, heads: int = 2):
        super().__init__()
        self.heads, head = heads, d // heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, head, 2).float() / head), persistent=False)

    def forward(self, x, positions):
        b, t, d = x.shape
        with torch.autocast(x.device.type, enabled=False):  # as HF computes them: in FP32
            angles = (self.inv_freq[None, :, None] @ positions[:, None, :].float()).transpose(1, 2)
            emb = torch.cat((angles, angles), dim=-1)
            cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)

        def rotate(u):
            u1, u2 = u.chunk(2, dim=-1)
            return u * cos[:, :, None] + torch.cat((-u2, u1), dim=-1) * sin[:, :, None]

        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        q, k = rotate(q), rotate(k)
        a = nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                       is_causal=True)
        return self.out(a.transpose(1, 2).reshape(b, t, d))


def _rotary_grads(mode: str, tokens: int = 1024):
    """The query projection's weight gradient of a compiled RotaryAttention under autocast, the storage, and what
    the graph holds for backward."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = RotaryAttention()
    x = torch.randn(2, tokens, 256, generator=torch.Generator().manual_seed(1)).requires_grad_()
    positions = torch.arange(tokens)[None].expand(2, tokens)
    storage = FP8ActivationStorage(model, min_elements=0, in_graph=True) if mode == "graph" else None
    with torch.autocast("cpu", dtype=torch.bfloat16), storage.context() if storage else contextlib.nullcontext():
        y = torch.compile(model, backend="inductor")(x, positions)
    held = _held(y)
    y.float().square().sum().backward()
    return model.qkv.weight.grad[:256].clone(), storage, held


def test_rotary_angles_a_graph_saves_are_not_encoded(monkeypatch):
    # A compiled graph saves the angles and takes cos/sin of them again in backward: FP8's 2**-4 relative error on an
    # angle of hundreds of radians is a wrong angle (on the d4096 proxy, T=2048: held-out loss +10% against BF16's,
    # results/gpu/2026-11-28-h200-act8-bisect). Kept, the query's gradient is as close as the other tensors allow.
    import lowprec.runtime.activations as activations

    reference, _, _ = _rotary_grads("none")
    kept, storage, held = _rotary_grads("graph")
    # what the angles are computed from, as the graph saves it: the positions in FP32 (inductor turns the
    # [64, 1] x [1, 1024] product into a broadcast multiply, so they reach cos/sin through elementwise ops)
    angles_shape = (2, 1, 1024)
    assert (torch.float32, angles_shape) in held
    assert storage.counts.traced_packed >= 4  # q, k, v, attention's output
    error = float((kept - reference).norm() / reference.norm())
    assert error < 0.07, error
    # the rule is what keeps them: without it they are encoded and the query's gradient is twice as far off
    monkeypatch.setattr(activations, "is_angle", lambda node: False)
    encoded, _, held_encoded = _rotary_grads("graph")
    assert (torch.float32, angles_shape) not in held_encoded
    assert float((encoded - reference).norm() / reference.norm()) > 1.5 * error


def test_is_angle_follows_values_to_a_sine_or_cosine():
    from torch.fx.experimental.proxy_tensor import make_fx

    from lowprec.runtime.activations_in_graph import is_angle

    def graph_of(fn):  # in aten ops, as AOTAutograd's graphs are
        return {n.name: n for n in make_fx(fn)(torch.arange(8.0)[:, None], torch.rand(4)).graph.nodes}

    def rotary(positions, inv_freq):
        angles = positions * inv_freq
        emb = torch.cat((angles, angles), dim=-1)
        return emb.cos(), emb.sin()

    def not_periodic(positions, inv_freq):
        return torch.exp(positions * inv_freq).sum()

    nodes = graph_of(rotary)
    assert is_angle(nodes["mul"]) and is_angle(nodes["cat"]) and not is_angle(nodes["cos"])
    nodes = graph_of(not_periodic)
    assert not any(is_angle(n) for n in nodes.values()) and not is_angle(None)


class _Head(nn.Module):
    """A causal LM's output head as the hooks find it: named by `get_output_embeddings`."""

    def __init__(self, d: int, vocab: int):
        super().__init__()
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def get_output_embeddings(self):
        return self.lm_head


def _hooks_loss_grads(keep_logits: bool):
    """The input gradient's relative error of a compiled loss over BF16 logits with the Python hooks around the
    graph (the form under DDP/FSDP2/DeepSpeed), against the unencoded run, and the storage. The logits spread as a
    trained model's do (sd ~6), where FP8's 2**-4 relative error is tenths in log space."""
    import torch.nn.functional as F

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Head(256, 1000).to(torch.bfloat16)
    with torch.no_grad():
        model.lm_head.weight.mul_(10)
    x = torch.randn(256, 256, dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, 1000, (256,))

    def loss_of(h, t):
        return F.cross_entropy(model.lm_head(h).float(), t)

    compiled = torch.compile(loss_of, backend="inductor")
    reference, = torch.autograd.grad(compiled(x, target), x)
    storage = FP8ActivationStorage(model, min_elements=0, in_graph=False)
    if not keep_logits:
        storage._head_widths = frozenset()
    with storage.context():
        loss = compiled(x, target)
    grad, = torch.autograd.grad(loss, x)  # (the weight's gradient reads x's FP8 copy either way)
    return ((grad.float() - reference.float()).norm() / reference.float().norm()).item(), storage


def test_the_python_hooks_keep_a_compiled_graphs_logits_by_the_heads_width():
    # the hooks see a compiled graph's saves as plain tensors with no history: a BF16 one of the output head's width
    # is the logits the loss's backward takes the softmax of again, kept as the in-graph form keeps it by node
    error, storage = _hooks_loss_grads(keep_logits=True)
    assert storage._head_widths == {1000} and storage.counts.logits_kept >= 1
    assert error < 1e-6  # nothing the input's gradient reads was encoded
    spoilt, plain = _hooks_loss_grads(keep_logits=False)
    assert plain.counts.logits_kept == 0 and plain.counts.packed > storage.counts.packed
    assert spoilt > 0.1  # the logits in FP8 (0.35 here): the softmax of backward off by tenths in log space


def test_a_tracked_tensor_or_another_width_is_not_taken_for_logits():
    storage = FP8ActivationStorage(_Head(256, 1000), min_elements=0)
    with storage.context():
        tracked = torch.randn(64, 1000, requires_grad=True).to(torch.bfloat16)  # eager: autograd tells what it is
        assert isinstance(storage.pack(tracked), PackedFP8)
        assert isinstance(storage.pack(torch.randn(64, 1024).to(torch.bfloat16)), PackedFP8)
        logits = torch.randn(64, 1000).to(torch.bfloat16)
        assert storage.pack(logits) is logits
    assert storage.counts.logits_kept == 1
    assert FP8ActivationStorage(nn.Linear(4, 4))._head_widths == frozenset()  # no head named: no rule


def test_a_head_as_wide_as_another_layer_is_not_taken_for_a_vocabulary():
    class Wide(_Head):  # hidden width 1000 = vocabulary: a tensor of that width could be anything
        def __init__(self):
            super().__init__(64, 1000)
            self.up = nn.Linear(64, 1000)

    class Tied(_Head):  # the input embedding (vocabulary, width) shares the head's weight
        def __init__(self):
            super().__init__(64, 1000)
            self.embed = nn.Embedding(1000, 64)
            self.embed.weight = self.lm_head.weight

    assert FP8ActivationStorage(Wide())._head_widths == frozenset()
    assert FP8ActivationStorage(Tied())._head_widths == {1000}


def test_a_hugging_face_causal_lm_names_its_vocabulary():
    pytest.importorskip("transformers")
    from lowprec.demo.model import PRESETS, build_model
    from lowprec.runtime.activations import head_widths

    assert head_widths(build_model(PRESETS["tiny"], vocab_size=256)) == {256}
    assert head_widths(build_model(PRESETS["tiny"], vocab_size=128)) == frozenset()  # = the hidden size


def test_the_inlined_decode_leaves_silus_backward_unstored_under_inductors_gpu_rules(monkeypatch):
    """The decode is inlined into every backward kernel that reads a saved tensor; inductor stores (realizes) an
    expression of more than 30 ops on a GPU. With a clamp in the decode, SiLU's backward over both FP8 halves of the
    fused gate/up output passed it and was stored as an FP32 block of the d4096 step's peak (0.44 GiB, results/gpu/
    2026-11-28-h200-act8-peak-05e9f2d). Here inductor's CPU code is generated under its GPU rules (the op and read
    thresholds, the pointwise cat)."""
    import re

    import torch._inductor.config as inductor_config
    import torch._inductor.ir as inductor_ir
    from torch._inductor.utils import run_and_get_code

    if not hasattr(inductor_ir, "is_cpu"):
        pytest.skip("this torch's inductor has no is_cpu to apply its GPU rules on a CPU")
    monkeypatch.setattr(inductor_ir, "is_cpu", lambda node: False)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Block(256, 512)
    storage = FP8ActivationStorage(model, min_elements=0, in_graph=True)
    block = torch.compile(model, backend="inductor")
    x = torch.randn(2, 64, 256).requires_grad_()

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16), storage.context():
            y = block(x)
        y.float().square().sum().backward()

    with inductor_config.patch(realize_opcount_threshold=30, force_pointwise_cat=True, fx_graph_cache=False):
        _, codes = run_and_get_code(step)
    assert storage.counts.traced_packed >= 6 and x.grad is not None
    fp32_mlp_blocks = [m.group(0) for code in codes
                       for m in re.finditer(r"empty_strided_cpu\(\(2, 64, 512\), [^)]*\), torch\.float32\)", code)]
    assert fp32_mlp_blocks == []
