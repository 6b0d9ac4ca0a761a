"""A compiled graph's inputs that get no gradient (a rotary table every block takes) are kept by the in-graph FP8
storage, told by the joint graph (`lowprec/runtime/graph_inputs_without_grad.py`), and the gradient through them is
closer to FP32's than with them packed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lowprec.runtime import activations as activations_module
from lowprec.runtime.activations import FP8ActivationStorage
from lowprec.runtime.activations_in_graph import inlining_supported
from lowprec.runtime.graph_inputs_without_grad import inputs_without_grad

pytestmark = pytest.mark.skipif(not inlining_supported(), reason="needs a torch that inlines saved-tensor hooks")


class _Rotary(nn.Module):
    """q * cos + rotate(q) * sin, as a Llama block applies the tables the model hands it."""

    def __init__(self, d: int = 256):
        super().__init__()
        self.proj = nn.Linear(d, d, bias=False)

    def forward(self, x, cos, sin):
        q = self.proj(x)
        half = q.shape[-1] // 2
        rotated = torch.cat((-q[..., half:], q[..., :half]), dim=-1)
        return x + q * cos + rotated * sin


def _tables(length: int = 512, d: int = 256):
    angles = torch.arange(length).float()[:, None] * torch.logspace(0, -4, d)[None, :]
    return angles.cos()[None], angles.sin()[None]


def _step(monkeypatch, user_pass=None):
    """x's gradient through the compiled block with the in-graph storage, and what it did with each saved input."""
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    torch.manual_seed(0)
    block = _Rotary()
    decisions = {}
    pack_traced = FP8ActivationStorage.pack_traced

    def recording(self, tensor):
        result = pack_traced(self, tensor)
        node = activations_module.traced_node()
        if node is not None and node.op == "placeholder":
            decisions[node.name] = result is tensor  # True: kept as it is
        return result

    monkeypatch.setattr(FP8ActivationStorage, "pack_traced", recording)
    storage = FP8ActivationStorage(block, min_elements=0, in_graph=True)
    compiled = torch.compile(block, backend="inductor")
    cos, sin = _tables()
    x = torch.randn(1, 512, 256, generator=torch.Generator().manual_seed(1)).requires_grad_()
    # inductor's config patched, not monkeypatched: undoing that deletes a config entry it did not see in __dict__
    with inductor_config.patch(joint_custom_pre_pass=user_pass):
        with storage.context():
            y = compiled(x, cos, sin)
        y.square().sum().backward()
    return x.grad, decisions


def _reference_grad():
    torch.manual_seed(0)
    block = _Rotary()
    cos, sin = _tables()
    x = torch.randn(1, 512, 256, generator=torch.Generator().manual_seed(1)).requires_grad_()
    block(x, cos, sin).square().sum().backward()
    return x.grad


def test_a_table_input_is_kept_and_the_blocks_input_packed(monkeypatch):
    # x, cos and sin have one shape: what tells the tables apart is the joint graph (no gradient), not the shape; x
    # is saved as the projection's 2-D input (a view, packed), the tables as they came in
    grad, decisions = _step(monkeypatch)
    assert len(decisions) == 2 and all(decisions.values()), decisions
    reference = _reference_grad()
    error = float((grad - reference).norm() / reference.norm())
    # a user's own pre-pass is left alone: the tables are then packed as before, and x's gradient is further off
    packed_grad, packed_decisions = _step(monkeypatch, user_pass=lambda graph: None)
    assert packed_decisions.keys() == decisions.keys() and not any(packed_decisions.values()), packed_decisions
    packed_error = float((packed_grad - reference).norm() / reference.norm())
    assert error < packed_error, (error, packed_error)


def test_the_joint_graph_names_its_inputs_without_gradient():
    from torch._functorch.aot_autograd import aot_function

    seen = []

    def partition(joint, joint_inputs, **kwargs):
        seen.append(inputs_without_grad(joint.graph))
        from torch._functorch.partitioners import default_partition
        return default_partition(joint, joint_inputs, **kwargs)

    def fn(x, table, weight):
        return (x * table) @ weight

    compiled = aot_function(fn, fw_compiler=lambda g, _: g, partition_fn=partition)
    x, weight = torch.randn(8, 16, requires_grad=True), torch.randn(16, 4, requires_grad=True)
    compiled(x, torch.randn(8, 16), weight).sum().backward()
    assert seen == [{"primals_2"}]  # the table, the second input; x and the weight get gradients


def test_gradients_laid_out_otherwise_name_no_input():
    # a gradient whose shape is not its input's: the outputs are not (forward outputs, one gradient per input)
    from torch.fx.experimental.proxy_tensor import make_fx

    def joint(primals_1, primals_2):
        return [primals_1 * 2, primals_1.sum(0), None]  # the "gradient" of primals_1 has another shape

    graph = make_fx(joint)(torch.randn(4, 8), torch.randn(4, 8)).graph
    for node in graph.nodes:  # make_fx names placeholders after the arguments
        assert node.op != "placeholder" or node.name.startswith("primals")
    assert inputs_without_grad(graph) == set()

    def aligned(primals_1, primals_2):
        return [primals_1 * 2, primals_1 * 3, None]

    graph = make_fx(aligned)(torch.randn(4, 8), torch.randn(4, 8)).graph
    second = [n.name for n in graph.nodes if n.op == "placeholder"][1]
    assert inputs_without_grad(graph) == {second}


def test_a_slot_set_by_the_user_or_missing_is_left_alone():
    import torch._inductor.config as inductor_config

    from lowprec.runtime.joint_graph_passes import joint_pass_set

    def mine(graph):
        return None

    with joint_pass_set("joint_custom_pre_pass", object()) as ours:
        assert ours and inductor_config.joint_custom_pre_pass is not None
    assert inductor_config.joint_custom_pre_pass is None
    with inductor_config.patch(joint_custom_pre_pass=mine):
        with joint_pass_set("joint_custom_pre_pass", object()) as ours:
            assert not ours and inductor_config.joint_custom_pre_pass is mine
    with joint_pass_set("no_such_slot_in_this_torch", object()) as ours:
        assert not ours
