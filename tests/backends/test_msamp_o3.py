"""MS-AMP O3 (FP16 master shards all-gathered in FP8, FP8 reduce-scatter, sharded O2 states) under FSDP2.

One torchrun launch of tests/distributed/fsdp2_o3.py on two CPU processes (gloo), checked against
MS-AMP's O3 expectations (reference/msamp.md 2.3: E4M3 weights with one scale per tensor, FP16
masters and FP8+FP16 states on their owner rank only, FP8 gradient reduction) and against O2 on one
process over the same global batches. Where O3 may run, and the plan it prints, are checked here too.
"""

from __future__ import annotations

import os
import re

import pytest
import torch
from torch import nn

from lowprec import FP8RecipeKwargs, RunContext, build_plan
from lowprec.backends import BackendUnavailableError, create_backend
from lowprec.planning.engines import deepspeed_precision, fsdp_precision
from lowprec.planning.hardware import device_info

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "distributed", "fsdp2_o3.py")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    from conftest import run_two_ranks

    result = run_two_ranks(SCRIPT, out=tmp_path_factory.mktemp("fsdp2_o3") / "result.json")
    assert len(result) == 2
    return result


@pytest.mark.slow
@pytest.mark.parametrize("rows", ["48", "33"])
def test_weights_are_all_gathered_as_the_e4m3_cast_of_the_whole_master(ranks, rows):
    shard_rows = [r["gather"][rows]["local_rows"] for r in ranks]
    assert sum(shard_rows) == int(rows)  # 33: rank 0 holds 17 rows, rank 1 16 (FSDP2 pads its input)
    for r in ranks:
        g = r["gather"][rows]
        assert (g["local_type"], g["local_dtype"]) == ("FP8MasterWeight", "torch.float16")
        assert (g["gathered_type"], g["gathered_dtype"]) == ("FP8GatheredWeight", "torch.float8_e4m3fn")
        # one power-of-two scale from the amax over both ranks: the very bytes of casting the whole master
        assert g["scale"] == g["expected_scale"] and g["bytes_equal"]
        assert 0.005 < g["dequantised_rel_err"] < 0.04  # E4M3's rounding, not FP16's


@pytest.mark.slow
def test_a_nan_in_one_shard_keeps_the_last_scale(ranks):
    for r in ranks:
        assert r["gather"]["nan"]["scale"] == r["gather"]["nan"]["previous"]


@pytest.mark.slow
def test_o3_on_two_ranks_trains_like_o2_on_one_process(ranks):
    train = ranks[0]["train"]
    assert train["o3"] == ranks[1]["train"]["o3"]  # the global batch's loss, on both ranks
    o3, o2, fp32 = train["o3"], train["o2_single"], train["fp32_single"]
    assert o3[-1] < 0.7 * o3[0]
    for a, b, c in zip(o3, o2, fp32):
        assert abs(a - b) / b < 0.01, (o3, o2)  # same FP8 GEMMs; FP8 reduction and FP16 gradients differ
        assert abs(a - c) / c < 0.02, (o3, fp32)
    assert ranks[0]["train"]["param_sums"] == ranks[1]["train"]["param_sums"]


@pytest.mark.slow
def test_o3_on_one_host_reduce_scatters_through_fsdp2_and_trains_as_with_fp8(ranks):
    # O3's default on one host: no FP8 reduce-scatter installed, FSDP2 reduces in the policy's dtype (FP32 here);
    # the global loss the same on both ranks, within 1% of the FP8 reduce-scatter's run and of O2 on one process
    for r in ranks:
        default = r["train"]["default_comm"]
        assert default["comm"] == "NoneType"
        assert default["losses"] == pytest.approx(r["train"]["o3"], rel=0.01)
        assert default["losses"] == pytest.approx(r["train"]["o2_single"], rel=0.01)
    assert ranks[0]["train"]["default_comm"]["losses"] == ranks[1]["train"]["default_comm"]["losses"]


@pytest.mark.slow
def test_o3_under_fsdp2_with_fp8_activations_follows_the_run_without(ranks):
    # activation_dtype='fp8' under FSDP2 (issue 32): packed on both ranks, the unsharded weights kept (the
    # gathered FP8 weights, the norm's from an FSDP2 all-gather buffer), the global loss the same on both ranks
    # and within 2% of the run without
    for r in ranks:
        act = r["train"]["fp8_activations"]
        assert act["packed"] > 0 and act["kept"] > 0
        assert act["losses"] == pytest.approx(r["train"]["o3"], rel=0.02) and act["losses"] != r["train"]["o3"]
    assert ranks[0]["train"]["fp8_activations"]["losses"] == ranks[1]["train"]["fp8_activations"]["losses"]


@pytest.mark.slow
def test_o3_under_fsdp2_with_compiled_layers_trains_as_with_eager_ones(ranks):
    # compile_fp8_layers under FSDP2 (the default on FP8 GPUs): each layer's compiled forward and backward
    # take the E4M3 weight FSDP2 gathered and hand the gradient to its FP8 reduce-scatter, as eager ones do
    for r in ranks:
        compiled = r["train"]["compiled"]
        assert compiled["layers"] == 3 and compiled["gathered"] == "DTensor"  # resharded after the step
        assert compiled["losses"] == pytest.approx(r["train"]["o3"], rel=1e-3)
    assert ranks[0]["train"]["compiled"]["losses"] == ranks[1]["train"]["compiled"]["losses"]


@pytest.mark.slow
def test_o3_under_fsdp2_gives_every_rank_the_same_delayed_scales(ranks):
    """Each rank trains its own half of every batch, so its own amaxes differ; reduce_amax (on by default)
    all-reduces them after each step, and both ranks hold the same windows and input / output-gradient
    scales."""
    first, second = (r["train"] for r in ranks)
    assert first["reduce_amax"] is True and first["amax_reduction"] is True
    assert first["amax_windows"] == second["amax_windows"]
    assert first["delayed_scales"] == second["delayed_scales"]
    assert all(v > 0 for layer in first["amax_windows"] for row in layer for v in row[:11])  # 12 steps recorded


def test_o3_keeps_masters_gradients_and_states_sharded(ranks):
    for r in ranks:
        train = r["train"]
        assert train["optimizer"] == "LowBitAdamW"
        assert train["state_types"] == ["DTensor torch.float16", "DTensor torch.float8_e4m3fn"]
        assert train["grad_types"] == ["DTensor torch.float16", "DTensor torch.float32"]  # Linear / LayerNorm
        assert train["param_locals"] == ["FP8MasterWeight", "Tensor"]
        # the 3 Linear groups, 13 backwards; the root (norms, head) reduce-scatters in its reduce_dtype
        assert train["comm"] == "FP8ReduceScatter" and train["comm_calls"] == 3 * 13
        linear = train["state_bytes"]["linear_weights"]
        # per rank, per parameter: FP16 master 2/2, FP16 gradient 2/2, E4M3 + FP16 states 3/2 (+ their scales)
        assert linear["weight"] == pytest.approx(1.0) and linear["grad"] == pytest.approx(1.0)
        assert linear["optimizer_states"] == pytest.approx(1.5, abs=0.01)
        assert linear["total"] <= 1 + 6 / 2  # MS-AMP's O3 under ZeRO-2: 1 + 6/N


@pytest.mark.slow
def test_o3_checkpoints_load_into_the_plain_model_and_resume_exactly(ranks):
    first = ranks[0]["checkpoint"]
    assert first["plain_matches"]
    assert first["portable_types"] == ["Tensor torch.float32"]  # the plain model's own dtypes again
    assert "Tensor torch.float16" in first["full_types"]
    for r in ranks:
        assert r["checkpoint"]["resumed"] == r["checkpoint"]["continued"]
        assert r["checkpoint"]["master_type_after_load"] == "FP8MasterWeight"


def _backend(engine: str, **kw):
    recipe = FP8RecipeKwargs(backend="msamp", opt_level="O3", **kw)
    return create_backend(recipe, RunContext(device=device_info("cpu"), engine=engine, world_size=4))


@pytest.mark.parametrize("engine, hint", [("single", "opt_level='O2'"), ("ddp", "opt_level='O2'"),
                                          ("fsdp1", "use FSDP2")])
def test_o3_outside_fsdp2_and_deepspeed_names_what_to_use(engine, hint):
    with pytest.raises(BackendUnavailableError, match="opt_level='O3'") as err:
        _backend(engine)
    assert hint in str(err.value) and "FSDP2 and DeepSpeed ZeRO-1/2" in str(err.value)


@pytest.mark.parametrize("config, message", [
    ({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}, "not zero_stage=3.*FSDP2"),
    ({"zero_optimization": {"stage": 0}}, "not zero_stage=0.*DDP with opt_level='O2'"),
    ({}, "not zero_stage=0"),
    ({"zero_optimization": {"stage": 2}, "fp16": {"enabled": True}}, "not fp16.*mixed_precision='fp8'"),
])
def test_o3_under_deepspeed_refuses_zero3_no_zero_and_fp16(config, message):
    backend = _backend("deepspeed")
    assert backend.zero_o3 and not backend.sharded
    assert re.search(message, backend.engine_config_problem(config))
    assert backend.engine_config_problem({"zero_optimization": {"stage": 1}, "bf16": {"enabled": "auto"}}) is None


@pytest.mark.parametrize("engine", ["fsdp2", "deepspeed"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_o1_o2_under_sharded_engines_point_at_o3(level, engine):
    with pytest.raises(BackendUnavailableError, match="opt_level='O3' under FSDP2 or DeepSpeed ZeRO-1/2"):
        create_backend(FP8RecipeKwargs(backend="msamp", opt_level=level),
                       RunContext(device=device_info("cpu"), engine=engine, world_size=2))


def test_o3_plan_under_deepspeed_shows_fp8_weights_and_owner_masters():
    model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 64))
    recipe = FP8RecipeKwargs(backend="msamp", opt_level="O3", skip_first_last=False)
    context = RunContext(device=device_info("cpu"), engine="deepspeed", world_size=4,
                         precision=deepspeed_precision({"bf16": {"enabled": True}}))
    backend = create_backend(recipe, context)
    plan = build_plan(model, recipe, context=context, backend=backend)
    assert plan.tensor("weight").dtype == "FP8 E4M3 (Linear, every rank), BF16 (rest)"
    assert plan.tensor("master_weight").dtype == "FP16 (Linear, whole tensors over 4 ranks), FP32 (rest)"
    assert plan.tensor("grad_comm").dtype == "FP8 E4M3, shared scale (Linear), BF16 (rest)"
    assert plan.tensor("optimizer_states").dtype == "FP8 E4M3+FP16"
    share = plan.fp8_param_share
    # Linear: 1 + 1 + (2 + 3) / N; the rest as DeepSpeed keeps it: BF16 weight and gradient, FP32 master, states
    expected = share * (1 + 1 + 5 / 4) + (1 - share) * (2 + 2 + (4 + 3) / 4)
    assert plan.model_state_bytes_per_param == pytest.approx(expected)
    converted = backend.convert(model, plan)
    assert not converted[0].sharded_master and converted[0].weight.dtype == torch.float16
    assert converted[0].fp8_grad_data.dtype == torch.float8_e4m3fn and not backend.grad_stores


@pytest.mark.parametrize("hosts, comm", [(2, "FP8"), (1, "BF16")])
def test_o3_plan_shows_sharded_masters_fp8_weights_and_the_reduce_scatter(hosts, comm):
    model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 64))
    recipe = FP8RecipeKwargs(backend="msamp", opt_level="O3", skip_first_last=False)
    context = RunContext(device=device_info("cpu"), engine="fsdp2", world_size=4, hosts=hosts)
    backend = create_backend(recipe, context)
    plan = build_plan(model, recipe, context=context, backend=backend)
    assert plan.tensor("weight").dtype.startswith("FP8 E4M3 (Linear)")
    assert plan.tensor("master_weight").dtype == "FP16 (Linear), sharded over 4 ranks by FSDP2"
    assert plan.tensor("grad_comm").dtype.startswith(comm)
    # on one host the plan says why the gradients are not FP8 there, and how to ask for FP8
    said = [note for note in plan.notes if note.startswith("O3 under FSDP2 on one host")]
    assert (said == []) if hosts > 1 else ("reduce-scattered in BF16" in said[0] and "grad_comm_dtype='fp8'" in said[0])
    assert plan.tensor("optimizer_states").dtype == "FP8 E4M3+FP16"
    share = plan.fp8_param_share
    expected = (share * (2 + 2 + 3) + (1 - share) * (4 + 4 + 3)) / 4
    assert plan.model_state_bytes_per_param == pytest.approx(expected)
    converted = backend.convert(model, plan)
    assert converted[0].sharded_master and converted[0].weight.dtype == torch.float16
    assert converted[0].bias.dtype == torch.float16  # one dtype per FSDP2 group
    assert backend.gradients_outside_grad() is None and not backend.grad_stores


@pytest.mark.parametrize("engine, compiled, compile_layers, eager", [
    ("fsdp2", True, None, True), ("fsdp2", True, True, True),  # a compiled model: no layer compiled on its own
    ("fsdp2", False, None, True), ("fsdp2", False, False, True),  # eager layers, also under a user's torch.compile
    ("fsdp2", False, True, False),  # compiled one by one, as asked
    ("deepspeed", True, None, False), ("deepspeed", False, None, False),  # ZeRO's O3 layers compile (1.43x)
])
def test_o3_layers_under_fsdp2_stay_eager_unless_compiled_one_by_one(engine, compiled, compile_layers, eager):
    from lowprec.backends.msamp.eager_layers import EagerFP8Linear

    model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 64))
    recipe = FP8RecipeKwargs(backend="msamp", opt_level="O3", skip_first_last=False, compile_fp8_layers=compile_layers)
    context = RunContext(device=device_info("cpu"), engine=engine, world_size=2, compiled=compiled)
    backend = create_backend(recipe, context)
    plan = build_plan(model, recipe, context=context, backend=backend)
    converted = backend.convert(model, plan)
    assert isinstance(converted[0], EagerFP8Linear) is eager and isinstance(converted[2], EagerFP8Linear) is eager
    said = any(n.startswith("O3 under FSDP2 in a compiled model: the FP8 layers run eager") for n in plan.notes)
    assert said is (engine == "fsdp2" and compiled)
    if eager:  # the forward dynamo does not trace is FP8Linear's, to the bit
        x = torch.randn(8, 64)
        reference = type(converted[0]).__mro__[1].forward(converted[0], x)
        assert torch.equal(converted[0](x), reference)


def test_o3_reduce_scatters_in_fp8_across_hosts_and_in_the_engines_dtype_on_one():
    def choice(hosts=1, precision=None, **kw):
        recipe = FP8RecipeKwargs(backend="msamp", opt_level="O3", **kw)
        context = RunContext(device=device_info("cpu"), engine="fsdp2", world_size=4, hosts=hosts, precision=precision)
        return create_backend(recipe, context).grad_comm_choice

    assert choice(hosts=2) == "fp8"  # MS-AMP's FP8 reduce-scatter where the link between hosts is slow
    assert choice() is None  # one host: the FSDP plugin's reduce dtype (Accelerate's BF16), measured faster
    assert choice(precision=fsdp_precision(None)) == "bf16"  # a plugin without a reduce dtype: BF16, not FP16
    for named in ("fp8", "bf16", "fp32"):  # a named dtype wins on any number of hosts
        assert choice(grad_comm_dtype=named) == choice(hosts=4, grad_comm_dtype=named) == named


@pytest.mark.parametrize("hosts", [0, 5, True, 1.0])
def test_a_run_context_names_the_hosts_it_spans(hosts):
    with pytest.raises(ValueError, match="RunContext.hosts=.* must be an integer from 1 to world_size=4"):
        RunContext(device=device_info("cpu"), engine="fsdp2", world_size=4, hosts=hosts)


@pytest.mark.parametrize("backend", ["te", "torchao"])
def test_o3_on_other_backends_points_at_msamp(backend):
    with pytest.raises(ValueError, match="O3 .* is backend='msamp' under FSDP2"):
        FP8RecipeKwargs(backend=backend, opt_level="O3")


@pytest.mark.slow
def test_o3_through_accelerates_fsdp2_preparation(ranks):
    # lowprec shards the 15 converted Linears of the 2-layer Llama first (frozen while Accelerate
    # upcasts trainable non-FP32 parameters), Accelerate shards the decoder layers and the root.
    for r in ranks:
        acc = r["accelerate"]
        assert acc["fp8_layers"] == acc["frozen_while_preparing"] == 15
        assert acc["trainable_after"]
        assert acc["master_locals"] == ["FP8MasterWeight torch.float16"]  # not upcast to FP32
        assert acc["other_dtypes"] == ["torch.float32"]
        assert acc["optimizer_holds_the_sharded_params"]  # Accelerate's data_ptr remap found every one
        assert acc["fp8_groups"] == [1, 7, 7]  # one FSDP2 group per decoder layer's 7 Linears, lm_head alone
        # a decoder layer's norms are all it holds beside its FP8 group: sharded with the root, no group of their own;
        # the plugin's block classes are as the user set them once prepared
        assert acc["blocks_sharded"] == [False, False] and acc["norms_sharded"]
        assert acc["wrap_after"] == ["LlamaDecoderLayer"]
        assert acc["losses"][-1] < acc["losses"][0] - 0.5


@pytest.mark.slow
def test_o3_in_a_model_compiled_block_by_block_runs_its_fp8_layers_eager(ranks):
    # Accelerate's _prepare_fsdp2 compiles the blocks (compile_regions_fsdp2) after lowprec sharded the FP8 layer
    # groups: dynamo traces the blocks' norms, never the FP8 layers' autograd function (torch 2.11's dynamo asserted
    # there on the GPU host, results/gpu/2026-11-28-h200-world1-6365b0b), and the losses are the eager model's
    for r in ranks:
        eager, compiled = r["accelerate"], r["accelerate_compiled"]
        assert "EagerFP8Linear" in compiled["layer_class"] and "EagerFP8Linear" in eager["layer_class"]
        assert compiled["graphs"] > 0 and compiled["graphs_with_norm"] > 0
        assert compiled["graphs_with_fp8_function"] == 0
        assert eager["graphs"] == 0
        assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-5)
        assert compiled["fp8_groups"] == eager["fp8_groups"] == [1, 7, 7]
        assert any("O3 under FSDP2 in a compiled model: the FP8 layers run eager" in n for n in compiled["plan_notes"])
        assert not any("in a compiled model" in n for n in eager["plan_notes"])


@pytest.mark.slow
def test_o3_accumulates_micro_batches_like_one_batch(ranks):
    for r in ranks:
        one, two = r["accumulation"]["1"], r["accumulation"]["2"]
        assert two[-1] < 0.8 * two[0]
        # the unreduced FP16 gradients of the first micro-batch add to the second's before the FP8 reduction
        assert two == pytest.approx(one, rel=0.01)



@pytest.mark.slow
def test_weight_scales_are_set_after_each_step_in_one_all_reduce(ranks):
    for r in ranks:
        pre = r["precomputed"]
        assert all(pre["flags_after_step"]) and pre["scales"] == pre["expected"]  # the scale a gather would compute
        assert pre["precompute_all_reduces"] == 1  # every weight of the mesh at once
        assert pre["gather_all_reduces"] == 0  # three layers gathered, none all-reduced
        assert pre["dropped_on_change"] and pre["gather_all_reduces_after_change"] == 1  # only the changed one

def test_fsdp2_sees_the_five_argument_all_gather_extension_through_the_precomputed_signature():
    # FSDP2 calls inspect.signature on the bound method at every gather and takes 1 or 5 parameters
    import inspect

    from lowprec.backends.msamp.fsdp import FP8MasterWeight

    master = FP8MasterWeight(torch.zeros(4, 4, dtype=torch.float16))
    assert "__signature__" in vars(FP8MasterWeight.fsdp_pre_all_gather)  # precomputed: not parsed at every gather
    assert list(inspect.signature(master.fsdp_pre_all_gather).parameters) == [
        "mesh", "outer_size", "outer_stride", "module", "mp_policy"]


def test_a_master_weight_moved_to_another_device_takes_its_scale_along():
    # FSDP2 moves each shard to its GPU: reading the scale must not sync with the host afterwards
    from lowprec.backends.msamp.fsdp import FP8MasterWeight

    master = FP8MasterWeight(torch.randn(4, 4).half(), margin=1)
    moved = master.to("meta")
    assert isinstance(moved, FP8MasterWeight) and moved._scale.device.type == "meta" and moved._margin == 1
    assert master[:2]._scale is master._scale  # a view on the same device shares it


@pytest.mark.slow
def test_the_health_report_sees_the_gathered_fp8_weight(ranks):
    first, second = (r["health"] for r in ranks)
    assert first["tensors"] == ["input", "output_grad", "weight"] and first["layers"] == ["0", "2", "4"]
    assert first["weight_amax"] == second["weight_amax"]  # the whole weight on every rank, not its shard
    for layer, amax in first["weight_amax"].items():
        assert amax == pytest.approx(first["master_amax"][layer], rel=0.07)  # E4M3's rounding of the largest value


def test_copying_into_a_stored_fp8_weight_requantises_it():
    # O3 under DeepSpeed stores each weight as E4M3 bytes + scale; load_state_dict copies into it
    from lowprec.backends.msamp.fsdp import FP8GatheredWeight
    from lowprec.kernels.scaling import compute_scale, quantize

    torch.manual_seed(0)
    value = torch.randn(32, 16)
    scale = compute_scale(value.abs().max(), torch.float8_e4m3fn)
    weight = FP8GatheredWeight(quantize(value, scale, torch.float8_e4m3fn), scale.clone(), torch.float16)
    new = 10 * torch.randn(32, 16)
    weight.copy_(new)
    expected = compute_scale(new.abs().max(), torch.float8_e4m3fn)
    assert weight._scale == expected and weight._data.dtype == torch.float8_e4m3fn
    sqnr = 10 * torch.log10(new.pow(2).sum() / (weight.dequantize().float() - new).pow(2).sum())
    assert sqnr > 25  # E4M3 with a per-tensor power-of-2 scale
    bad = new.clone()
    bad[0, 0] = float("nan")
    weight.copy_(bad)
    assert weight._scale == expected  # a NaN amax never becomes a scale


class _Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        from lowprec.backends.msamp.linear import FP8Linear

        self.norm = nn.LayerNorm(d)
        self.up = FP8Linear(d, 2 * d, sharded_master=True)
        self.down = FP8Linear(2 * d, d, sharded_master=True)


class _Stack(nn.Module):
    def __init__(self, d: int = 16, n: int = 3):
        super().__init__()
        from lowprec.backends.msamp.linear import FP8Linear

        self.layers = nn.ModuleList(_Block(d) for _ in range(n))
        self.head = FP8Linear(d, 32, sharded_master=True)
        self.plain = nn.Linear(d, d)


@pytest.mark.parametrize("block_classes", [(), ("_Block",), ("NotInTheModel",)])
def test_o3_layers_of_one_block_form_one_fsdp2_group(block_classes):
    # One all-gather and one reduce-scatter per block, as FSDP2 does for a BF16 block, instead of one per
    # layer: the plugin's wrapped classes name the blocks, else the model's block list does.
    from lowprec.backends.msamp.fsdp_groups import fp8_layer_groups

    model = _Stack()
    groups = fp8_layer_groups(model, block_classes)
    expected = [[b.up, b.down] for b in model.layers] + [[model.head]]
    assert [[id(m) for m in g] for g in groups] == [[id(m) for m in g] for g in expected]


class _MoEBlock(nn.Module):
    def __init__(self, d: int, experts: int = 3):
        super().__init__()
        from lowprec.backends.msamp.linear import FP8Linear

        self.attn = FP8Linear(d, d, sharded_master=True)
        self.router = FP8Linear(d, experts, sharded_master=True)
        self.experts = nn.ModuleList(nn.Sequential(FP8Linear(d, 2 * d, sharded_master=True),
                                                   FP8Linear(2 * d, d, sharded_master=True)) for _ in range(experts))


def test_experts_that_may_sit_out_a_forward_are_groups_of_their_own():
    # FSDP2 reshards a group only after every member ran: an expert given no token would keep its block's
    # gathered weights alive for the rest of the forward
    from lowprec.backends.msamp.fsdp_groups import fp8_layer_groups

    model = nn.Module()
    model.layers = nn.ModuleList(_MoEBlock(16) for _ in range(2))
    groups = [[id(m) for m in g] for g in fp8_layer_groups(model)]
    expected = []
    for block in model.layers:
        expected.append([id(block.attn), id(block.router)])
        expected += [[id(layer)] for expert in block.experts for layer in expert]
    assert sorted(groups) == sorted(expected)


def test_o3_layers_without_blocks_are_groups_of_their_own():
    from lowprec.backends.msamp.fsdp_groups import fp8_layer_groups
    from lowprec.backends.msamp.linear import FP8Linear

    model = nn.Sequential(FP8Linear(16, 16, sharded_master=True), nn.GELU(), FP8Linear(16, 16, sharded_master=True),
                          FP8Linear(16, 16))  # the last is no O3 layer (no master weight): not grouped
    assert [[id(m) for m in g] for g in fp8_layer_groups(model)] == [[id(model[0])], [id(model[2])]]


def test_precomputed_scales_are_each_weights_own_rule_batched_over_margins():
    """`precompute_weight_scales` computes the scales of a mesh's weights as vectors (one per margin): each must be
    what `compute_scale` gives that weight alone, a NaN weight keeps its scale, and a margin is its weight's."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    from lowprec.backends.msamp.fsdp import FP8MasterWeight, precompute_weight_scales
    from lowprec.kernels.scaling import compute_scale

    E4M3 = torch.float8_e4m3fn

    torch.manual_seed(0)
    values = [torch.randn(8, 4) * 10 ** k for k in (-3, 0, 2)] + [torch.full((8, 4), float("nan")), torch.zeros(8, 4)]
    margins = [0, 2, 0, 1, 0]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        meshes = [init_device_mesh("cpu", (1,)), init_device_mesh("cpu", (1,))]  # equal meshes: one all-reduce
        masters = [FP8MasterWeight(v.half(), margin=m, scale=torch.tensor(0.5)) for v, m in zip(values, margins)]
        weights = [DTensor.from_local(m, meshes[i % 2], [Replicate()], run_check=False) for i, m in enumerate(masters)]
        masters = [w._local_tensor for w in weights]  # what FSDP2 holds (from_local may wrap a view)
        calls, all_reduce = [], dist.all_reduce
        dist.all_reduce = lambda *a, **k: calls.append(1) or all_reduce(*a, **k)
        try:
            assert precompute_weight_scales(weights) == len(values)
        finally:
            dist.all_reduce = all_reduce
        assert len(calls) == 1
    finally:
        dist.destroy_process_group()
    for master, value, margin in zip(masters, values, margins):
        expected = compute_scale(value.half().float().abs().amax(), E4M3, margin, previous=torch.tensor(0.5))
        assert master._precomputed and master._scale.shape == () and torch.equal(master._scale, expected)
    assert float(masters[3]._scale) == 0.5 and float(masters[4]._scale) == 0.5  # NaN and zeros keep the last scale


def test_a_blocks_o3_weights_are_cast_for_the_all_gather_in_one_call_with_each_weights_own_bytes(monkeypatch):
    # FSDP2 asks for each weight's E4M3 shard in turn; a block's weights are cast together at the first request
    # (one compiled call on CUDA instead of one per weight), and each gathers the bytes and scale its own cast gives
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lowprec.backends.msamp import fsdp, fsdp_groups
    from lowprec.backends.msamp.linear import FP8Linear

    calls = []
    real = fsdp._group_bytes
    monkeypatch.setattr(fsdp, "_group_bytes", lambda *a: calls.append(len(a[1])) or real(*a))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.q = FP8Linear(16, 24, bias=False, sharded_master=True)
            self.o = FP8Linear(24, 16, bias=False, sharded_master=True)

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Module()
        model.layers = nn.ModuleList([Block(), Block()])
        for m in model.modules():
            if isinstance(m, FP8Linear):
                m.weight._tensor.normal_(0, 0.3)  # FP8Linear's own weight is uninitialised
        layers = fsdp_groups.fully_shard_fp8_layers(model, mesh=init_device_mesh("cpu", (1,)))
        assert len(layers) == 4 and all(hasattr(layer, fsdp.GROUP_CAST_ATTR) for layer in layers)
        block = model.layers[0]

        def gathered(precompute: bool):
            if precompute:
                fsdp.precompute_weight_scales([layer.weight for layer in layers])
            block.q.unshard()
            out = [(layer.weight._data.view(torch.uint8).clone(), float(layer.weight._scale))
                   for layer in (block.q, block.o)]
            # the weight scale the layers report (FP8Linear.scales) is their gather's, set by the cast, not the forward
            assert [float(layer.scales[2]) for layer in (block.q, block.o)] == [scale for _, scale in out]
            block.q.reshard()
            return out

        for precompute in (False, True):
            calls.clear()
            grouped = gathered(precompute)
            assert calls == [2]  # both weights of the block in one call
            masters = [layer.weight._local_tensor for layer in (block.q, block.o)]
            for (data, scale), master in zip(grouped, masters):
                assert scale == float(master._scale)
                expected = fsdp._shard_bytes.eager(master._tensor, master._scale, master._tensor.shape[0])
                assert torch.equal(data, expected)
        with torch.no_grad():
            block.o.weight.mul_(2.0)  # a new master value: a new cast and scale, not the kept one
        calls.clear()
        after = gathered(precompute=True)
        assert calls == [2] and after[1][1] == grouped[1][1] / 2 and torch.equal(after[0][0], grouped[0][0])
        for layer in (block.q, block.o):
            delattr(layer, fsdp.GROUP_CAST_ATTR)  # each weight on its own: the same bytes
        calls.clear()
        alone = gathered(precompute=True)
        assert calls == [] and all(torch.equal(a[0], b[0]) and a[1] == b[1] for a, b in zip(alone, after))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("case", ["norms", "big_rest", "checkpointing", "size_policy"])
def test_o3_leaves_a_blocks_norms_to_the_root_only_where_they_are_all_it_holds(case):
    # a group of a block's norms alone costs FSDP2's hooks and collectives for a few thousand elements; a block with
    # more of its own (a BF16 Linear) keeps its group, and so does a block Accelerate will checkpoint
    from types import SimpleNamespace

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

    from lowprec.backends.msamp import fsdp_groups
    from lowprec.backends.msamp.communication import MSAMPCommunication
    from lowprec.backends.msamp.linear import FP8Linear

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(256)  # 512 parameters: under 1% of the block's
            self.q = FP8Linear(256, 256, bias=False, sharded_master=True)
            self.extra = nn.Linear(256, 16) if case == "big_rest" else nn.Identity()

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = nn.Module()
        model.layers = nn.ModuleList([Block(), Block()])
        fsdp_groups.fully_shard_fp8_layers(model, ("Block",), mesh=init_device_mesh("cpu", (1,)))
        policy = size_based_auto_wrap_policy if case == "size_policy" else transformer_auto_wrap_policy
        plugin = SimpleNamespace(auto_wrap_policy=policy, activation_checkpointing=case == "checkpointing",
                                 transformer_cls_names_to_wrap=["Block"])
        comm = MSAMPCommunication.__new__(MSAMPCommunication)
        comm.wrap_plugin = None
        comm._leave_blocks_to_the_root([model], plugin)
        left = case == "norms"
        assert plugin.transformer_cls_names_to_wrap == ([] if left else ["Block"])
        again = MSAMPCommunication.__new__(MSAMPCommunication)  # another backend's prepare meanwhile
        again.wrap_plugin = None
        again._leave_blocks_to_the_root([model], plugin)
        again.after_engine_prepare()
        assert plugin.transformer_cls_names_to_wrap == ["Block"]  # the user's list, not the emptied one
        comm.after_engine_prepare()
        assert plugin.transformer_cls_names_to_wrap == ["Block"]
        assert not hasattr(plugin, "_lowprec_transformer_cls_names_to_wrap")
        if left:  # a second model prepared with it whose blocks hold more: the list serves both, so it stays
            other = nn.Module()
            other.layers = nn.ModuleList([Block()])
            other.layers[0].extra = nn.Linear(256, 16)
            fsdp_groups.fully_shard_fp8_layers(other, ("Block",), mesh=init_device_mesh("cpu", (1,)))
            comm._leave_blocks_to_the_root([model, other], plugin)
            assert plugin.transformer_cls_names_to_wrap == ["Block"] and comm.wrap_plugin is None
    finally:
        dist.destroy_process_group()
