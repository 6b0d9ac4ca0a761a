"""`PrecisionPlan`: the per-tensor table, bytes per parameter, rendering, execution and verification."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch import nn

from lowprec import BackendUnavailableError, FP8RecipeKwargs, PlanMismatchError, RunContext, build_plan, plan_for
from lowprec.planning.hardware import DeviceInfo, device_info
from lowprec.planning.plan import TENSOR_KINDS

RECIPES = ["tensorwise", "rowwise", "rowwise_with_gw_hp"]


def model(dtype: torch.dtype = torch.float32, d: int = 64) -> nn.Module:
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up_proj = nn.Linear(d, 2 * d)
            self.down_proj = nn.Linear(2 * d, d)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(32, d)
            self.layers = nn.ModuleList([nn.ModuleDict({"mlp": Block()}) for _ in range(3)])
            self.lm_head = nn.Linear(d, 32)

    return Net().to(dtype)


def recipe(**kwargs) -> FP8RecipeKwargs:
    # first and last kept (not the default): the plan's tests need both groups of modules
    return FP8RecipeKwargs(backend="torchao", **{"skip_slow_shapes": False, "skip_first_last": True, **kwargs})


@pytest.mark.parametrize("name", RECIPES)
def test_tensor_rows_for_every_kind(name):
    plan = plan_for(model(), recipe(recipe=name))
    assert [t.kind for t in plan.tensors] == list(TENSOR_KINDS)
    assert plan.tensor("gemm").dtype.startswith("FP8")
    assert plan.tensor("master_weight").dtype == "N/A"
    assert all(t.dtype for t in plan.tensors)


@pytest.mark.parametrize(
    "dtype,total,weight", [(torch.float32, 16, 4), (torch.bfloat16, 8, 2), (torch.float16, 8, 2)]
)
def test_bytes_per_param(dtype, total, weight):
    plan = plan_for(model(dtype), recipe())
    assert plan.model_state_bytes_per_param == total
    assert plan.bytes_per_param["weight"] == weight and plan.bytes_per_param["optimizer_states"] == 2 * weight
    assert plan.param_dtype == {torch.float32: "FP32", torch.bfloat16: "BF16", torch.float16: "FP16"}[dtype]
    assert plan.tensor("weight").dtype == plan.param_dtype


def test_param_dtype_is_the_majority_dtype():
    m = model(torch.bfloat16)
    m.lm_head.float()  # a small FP32 minority
    assert plan_for(m, recipe()).param_dtype == "BF16"


def test_str_has_table_and_both_module_groups():
    text = str(plan_for(model(), recipe(exclude=["down_proj"])))
    header = next(line for line in text.splitlines() if line.startswith("| level"))
    for column in TENSOR_KINDS.values():
        assert column in header
    assert "bytes/param" in header
    assert "BF16 AMP (baseline)" in text and "this plan (torchao:tensorwise)" in text
    assert "  FP8:" in text and "  kept in high precision:" in text
    assert "excluded by pattern 'down_proj'" in text
    assert "modules: 2 of 7 Linear layers in FP8" in text  # first up_proj and lm_head: skip_first_last


def test_str_groups_repeated_layers():
    text = str(plan_for(model(), recipe(skip_first_last=False)))
    assert "layers.*.mlp.up_proj x3" in text and "64->128" in text
    assert "layers.0.mlp.up_proj" not in text


def test_str_without_skips_has_no_kept_section():
    text = str(plan_for(model(), recipe(skip_first_last=False)))
    assert "kept in high precision" not in text


def test_no_fp8_module_is_noted():
    plan = plan_for(model(), recipe(exclude=["*"]))
    assert plan.converted == [] and plan.fp8_linear_param_fraction == 0.0
    assert plan.notes[0].startswith("no module runs in FP8")
    assert "no module runs in FP8" in str(plan)


def test_fp8_linear_param_fraction():
    plan = plan_for(model(), recipe(exclude=["lm_head", "down_proj"]))
    up = 64 * 128 + 128
    total = 3 * (up + 128 * 64 + 64) + (64 * 32 + 32)
    assert plan.fp8_linear_param_fraction == pytest.approx(2 * up / total)  # layers.0 is the first Linear


def test_to_dict_is_json_ready():
    plan = plan_for(model(), recipe(exclude=["lm_head"], module_filter_fn=lambda m, fqn: True))
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["backend"] == "torchao" and data["recipe"] == "tensorwise"
    assert [t["kind"] for t in data["tensors"]] == list(TENSOR_KINDS)
    assert len(data["modules"]) == 7
    assert data["model_state_bytes_per_param"] == 16
    lm_head = next(m for m in data["modules"] if m["fqn"] == "lm_head")
    assert lm_head["convert"] is False and lm_head["shape"] == [32, 64]


def test_meta_device_model():
    with torch.device("meta"):
        big = nn.Sequential(*(nn.Linear(8192, 8192) for _ in range(4))).to(torch.bfloat16)
    plan = plan_for(big, FP8RecipeKwargs(backend="torchao", skip_first_last=True))
    assert [d.fqn for d in plan.converted] == ["1", "2"]
    assert plan.model_state_bytes_per_param == 8
    assert all(p.is_meta for p in big.parameters())  # planning did not materialise anything


# ---- execution: hardware or emulation ------------------------------------------------------------------
def test_cpu_is_emulated():
    plan = plan_for(model(), recipe())
    assert plan.emulated and "emulated" in plan.execution and plan.device == "CPU"


@pytest.mark.parametrize("capability", ["9.0", "10.0", "8.9"])
def test_tensorwise_on_fp8_gpu_is_hardware(capability):
    plan = plan_for(model(), recipe(), capability=capability)
    assert not plan.emulated and plan.execution.startswith("hardware FP8")


@pytest.mark.parametrize("capability", ["8.0", "cpu"])
def test_no_fp8_hardware_is_emulated(capability):
    plan = plan_for(model(), recipe(), capability=capability)
    assert plan.emulated and "no FP8 tensor cores" in plan.execution


@pytest.mark.parametrize("name", ["rowwise", "rowwise_with_gw_hp"])
def test_rowwise_on_ada_is_emulated(name):
    plan = plan_for(model(), recipe(recipe=name), capability="8.9")
    assert plan.emulated and "needs sm_90" in plan.execution
    assert not plan_for(model(), recipe(recipe=name), capability="9.0").emulated


@pytest.mark.parametrize("capability,name", [("8.9", "rowwise"), ("8.0", "tensorwise"), (None, "tensorwise")])
def test_emulate_false_without_hardware_is_an_error(capability, name):
    with pytest.raises(BackendUnavailableError, match="emulate=False forbids emulation"):
        plan_for(model(), recipe(recipe=name, emulate=False), capability=capability)


def test_emulate_true_on_hardware_is_emulated():
    plan = plan_for(model(), recipe(emulate=True), capability="9.0")
    assert plan.emulated and "emulate=True" in plan.execution


def test_bad_capability():
    with pytest.raises(ValueError, match="capability='nine'"):
        plan_for(model(), recipe(), capability="nine")


def test_build_plan_with_context():
    context = RunContext(device=DeviceInfo("cuda", "H100", (9, 0)), engine="ddp", world_size=8)
    plan = build_plan(model(), recipe(), context=context)
    assert (plan.engine, plan.world_size, plan.emulated) == ("ddp", 8, False)
    assert "ddp x8 on H100 (sm_90)" in str(plan)


@pytest.mark.parametrize(("engine", "dtype", "baseline"), [("single", "BF16", 8), ("ddp", "BF16", 8),
                                                          ("fsdp2", "FP32", 16 / 2)])
def test_a_bf16_model_under_fsdp2_is_planned_on_the_fp32_masters_accelerate_makes(engine, dtype, baseline):
    # Accelerate upcasts every trainable parameter to FP32 under FSDP2 when mixed precision is on (always, for FP8);
    # FSDP2 shards all 16 bytes of them over the two ranks
    context = RunContext(device=DeviceInfo("cuda", "H100", (9, 0)), engine=engine, world_size=2)
    plan = build_plan(model().to(torch.bfloat16), FP8RecipeKwargs(backend="torchao"), context=context)
    assert (plan.param_dtype, plan.baseline_bytes_per_param) == (dtype, baseline)


@pytest.mark.parametrize(("engine", "world", "fields", "per_rank"), [
    ("fsdp2", 4, {}, 16 / 4),  # FSDP2 shards weight, gradient and both moments
    ("fsdp2", 1, {}, 16),
    ("ddp", 4, {}, 16),  # DDP keeps everything on every rank
    ("fsdp2", 2, {"optimizer_states": "bf16"}, (4 + 4 + 4) / 2),
])
def test_model_state_is_counted_per_rank_where_fsdp_shards_it(engine, world, fields, per_rank):
    # as gpu_engines.py measures it from the tensors on each rank (torchao under FSDP2 on two H200s: 8.00 bytes per
    # parameter, where the plan said 16 until 2026-11-29)
    context = RunContext(device=DeviceInfo("cuda", "H100", (9, 0)), engine=engine, world_size=world)
    plan = build_plan(model(), FP8RecipeKwargs(backend="torchao", **fields), context=context)
    assert plan.model_state_bytes_per_param == pytest.approx(per_rank)
    assert ("per rank" in plan.summary()) == (engine == "fsdp2" and world > 1)


def test_bad_engine():
    with pytest.raises(ValueError, match="RunContext.engine='zero3'"):
        RunContext(device=device_info("cpu"), engine="zero3")


# ---- verify --------------------------------------------------------------------------------------------
def planned(plan) -> set[str]:
    return {d.fqn for d in plan.converted}


def test_verify_passes_when_the_model_matches():
    # Written out from the model and the recipe, not read from the plan: skip_first_last keeps the first and
    # the last Linear, and every other one is 64-wide (fits the FP8 GEMMs).
    built_fp8 = {"layers.0.mlp.down_proj", "layers.1.mlp.up_proj", "layers.1.mlp.down_proj",
                 "layers.2.mlp.up_proj", "layers.2.mlp.down_proj"}
    m = model()
    plan = plan_for(m, recipe())
    modules = {id(mod): name for name, mod in m.named_modules()}
    plan.verify(m, lambda mod: modules[id(mod)] in built_fp8)


def test_verify_raises_when_a_planned_module_was_not_converted():
    m = model()
    plan = plan_for(m, recipe())
    modules = {id(mod): name for name, mod in m.named_modules()}
    with pytest.raises(PlanMismatchError) as err:
        plan.verify(m, lambda mod: modules[id(mod)] in planned(plan) - {"layers.1.mlp.up_proj"})
    assert "layers.1.mlp.up_proj: planned FP8, built high precision" in str(err.value)
    assert "layers.0.mlp.up_proj" not in str(err.value)


def test_verify_raises_for_every_unconverted_module():
    m = model()
    plan = plan_for(m, recipe())
    with pytest.raises(PlanMismatchError) as err:
        plan.verify(m, lambda mod: False)  # nothing converted, e.g. conversion silently skipped
    assert all(f"{name}: planned FP8" in str(err.value) for name in planned(plan))


def test_verify_raises_when_a_kept_module_was_converted():
    m = model()
    plan = plan_for(m, recipe())
    with pytest.raises(PlanMismatchError, match="lm_head: planned high precision, built FP8"):
        plan.verify(m, lambda mod: isinstance(mod, nn.Linear))


def test_verify_raises_when_a_module_is_missing():
    m = model()
    plan = plan_for(m, recipe())
    del m.lm_head
    with pytest.raises(PlanMismatchError, match="lm_head: planned but not found"):
        plan.verify(m, lambda mod: False)


# ---- few or no Linear layers in FP8 is stated, with what would convert them (issue 16) ----------------------
def four_linears() -> nn.Module:
    with torch.device("meta"):
        return nn.Sequential(*(nn.Linear(256, 256) for _ in range(4)))


def test_no_fp8_linear_on_hopper_names_each_rule_and_its_option():
    from lowprec.planning.hardware import assumed_device

    # Planned for an H100/H200: first/last kept, the two middle ones too small.
    plan = build_plan(four_linears(), FP8RecipeKwargs(backend="torchao", skip_first_last=True),
                      context=RunContext(device=assumed_device("9.0"), compiled=True))
    assert plan.shortfall() == [
        "no Linear layer (of 4) runs in FP8 on assumed GPU (sm_90): every GEMM stays in high precision. "
        "Kept in high precision:",
        "  - 2 Linear layers: first and last Linear layers (skip_first_last=True) -> skip_first_last=False converts "
        "them",
        "  - 2 Linear layers: FP8 slower than BF16 on Hopper (sm_90) for K=256 <= 4096 and N=256 <= 1024 "
        "(skip_slow_shapes=True) -> skip_slow_shapes=False converts them anyway (FP8, though slower at these shapes)",
    ]
    text = str(plan)
    assert "modules: 0 of 4 Linear layers in FP8 (0.0% of Linear parameters)\n  WARNING: no Linear layer (of 4)" in text
    assert json.loads(json.dumps(plan.to_dict()))["shortfall"] == plan.shortfall()


def test_a_small_share_in_fp8_is_stated_with_the_share():
    with torch.device("meta"):
        net = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 1024))
    plan = plan_for(net, recipe(), capability="cpu")
    assert len(plan.converted) == 2 and plan.fp8_linear_param_fraction < 0.5
    assert plan.shortfall()[0].startswith("only 2 of 4 Linear layers run in FP8 on CPU (10.5% of Linear parameters, "
                                          "under 50%)")
    assert "WARNING: only 2 of 4" in str(plan)


def test_exclusions_are_grouped_per_pattern_and_shapes_name_pad_inner_dim():
    with torch.device("meta"):
        net = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 40))
    lines = plan_for(net, recipe(exclude=["0", "1"], skip_first_last=False)).shortfall()
    assert lines[1:] == [
        "  - 1 Linear layer: excluded by pattern '0' -> remove '0' from exclude",
        "  - 1 Linear layer: excluded by pattern '1' -> remove '1' from exclude",
        "  - 1 Linear layer: out_features=40 not divisible by 16 (FP8 GEMM requirement; pad_inner_dim=True pads "
        "instead) -> pad_inner_dim=True pads them to what the FP8 GEMMs need",
    ]


def test_most_parameters_in_fp8_is_no_shortfall():
    plan = plan_for(four_linears(), FP8RecipeKwargs(backend="torchao", skip_first_last=True),
                    capability="cpu")  # no slow shapes measured
    assert [d.convert for d in plan.modules] == [False, True, True, False]  # exactly half: not "few"
    assert plan.shortfall() == [] and "WARNING" not in str(plan)
    assert plan_for(nn.Sequential(nn.ReLU()), recipe()).shortfall() == []  # no Linear at all: nothing to say


# ---- whole blocks kept in high precision (issue 30) ---------------------------------------------------------
def test_kept_blocks_share_lines_naming_the_blocks():
    text = str(plan_for(model(), recipe(skip_first_last=False, skip_first_blocks=2)))
    kept = text[text.index("  kept in high precision:"):].splitlines()[1:]
    assert [line.split() for line in kept] == [
        ["layers.{0-1}.mlp.up_proj", "x2", "64->128", "blocks", "0-1", "of", "layers", "(skip_first_blocks=2)"],
        ["layers.{0-1}.mlp.down_proj", "x2", "128->64", "blocks", "0-1", "of", "layers", "(skip_first_blocks=2)"],
    ]
    assert "layers.2.mlp.up_proj" in text  # the one block in FP8 keeps its own name
    assert "modules: 3 of 7 Linear layers in FP8" in text


def test_a_lone_kept_block_shows_its_own_reason():
    text = str(plan_for(model(), recipe(skip_first_last=False, skip_first_blocks=1, skip_last_blocks=1)))
    assert "in block 0 of layers (skip_first_blocks=1)" in text and "in block 2 of layers (skip_last_blocks=1)" in text
    assert "layers.0.mlp.up_proj " in text and "layers.2.mlp.down_proj " in text and "blocks " not in text


def test_shortfall_names_the_blocks_and_the_option():
    plan = plan_for(model(), recipe(skip_first_last=False, skip_first_blocks=2, skip_last_blocks=1))
    assert plan.shortfall()[1:] == [
        "  - 4 Linear layers: blocks 0-1 of layers (skip_first_blocks=2) -> skip_first_blocks=0 converts them",
        "  - 2 Linear layers: in block 2 of layers (skip_last_blocks=1) -> skip_last_blocks=0 converts them",
    ]


def test_plan_options_show_the_block_counts():
    assert {k: plan_for(model(), recipe()).options[k] for k in ("skip_first_blocks", "skip_last_blocks")} == {
        "skip_first_blocks": 0, "skip_last_blocks": 0}
    options = plan_for(model(), recipe(skip_last_blocks="2")).options
    assert (options["skip_first_blocks"], options["skip_last_blocks"]) == (0, 2)


@pytest.mark.parametrize("kwargs,message", [
    (dict(skip_first_blocks=2, skip_last_blocks=2), "skip_first_blocks=2 and skip_last_blocks=2 keep 4 blocks"),
    (dict(skip_last_blocks=1), None),
])
def test_block_errors_come_from_planning(kwargs, message):
    r = recipe(**kwargs)  # the recipe does not know the model: accepted
    if message is None:
        net = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
        message = "skip_last_blocks=1 keeps whole transformer blocks in high precision, but Sequential has no block"
    else:
        net = model()
    with pytest.raises(ValueError, match=message):
        build_plan(net, r)


def test_shortfall_counts_layers_not_only_reasons():
    # three layers for one reason and one for another, under one rule: the line says how many each covers
    model = nn.Sequential(nn.Linear(100, 64), nn.Linear(100, 64), nn.Linear(100, 64), nn.Linear(64, 100))
    plan = plan_for(model, FP8RecipeKwargs(backend="torchao", skip_slow_shapes=False), capability="9.0")
    line = next(line for line in plan.shortfall() if line.startswith("  - "))
    assert line == ("  - 4 Linear layers: in_features=100 not divisible by 16 (FP8 GEMM requirement; pad_inner_dim="
                    "True pads instead) (3 of them; the other 1 for 1 more reason like it) -> pad_inner_dim=True "
                    "pads them to what the FP8 GEMMs need"), line


def test_a_gpt2_plan_lists_its_conv1d_layers_as_kept():
    transformers = pytest.importorskip("transformers")
    from lowprec.planning.selection import CONV1D_REASON

    config = transformers.GPT2Config(n_layer=2, n_embd=256, n_head=4, vocab_size=512, n_positions=64)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config)
    plan = plan_for(model, FP8RecipeKwargs(backend="torchao", skip_slow_shapes=False), capability="9.0")
    conv1d = [m for m in plan.modules if m.reason == CONV1D_REASON]
    assert sorted(m.fqn for m in conv1d) == sorted(f"transformer.h.{i}.{n}" for i in range(2)
                                                   for n in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"))
    assert all(m.kind == "linear" and not m.convert and m.rule == "conv1d" for m in conv1d)
    assert {m.fqn: m.shape for m in conv1d}["transformer.h.0.attn.c_attn"] == (768, 256)  # (out, in), as a Linear's
    assert [m.fqn for m in plan.converted] == ["lm_head"]
    text = str(plan)
    assert "transformers Conv1D (GPT-2's Linear" in text
    assert any(line.startswith("  - 8 Linear layers: transformers Conv1D") for line in plan.shortfall())


# ---- the summary prepare() prints (issue 31) -------------------------------------------------------------
def test_summary_says_what_runs_in_fp8_where_and_its_memory():
    plan = plan_for(model(), recipe(), capability="9.0")
    assert plan.summary() == (
        "lowprec precision plan: backend torchao (TorchAO float8), recipe 'tensorwise', format HYBRID\n"
        "  where:  one process on assumed GPU (sm_90), hardware FP8\n"
        "  layers: 5 of 7 Linear layers in FP8 (79.9% of Linear parameters); model state 16 bytes/param "
        "(BF16 AMP baseline 16)\n"
        "  print(accelerator.precision_plan) for the full table"
    )


def test_summary_names_the_model_level_engine_emulation_and_norms():
    plan = plan_for(model(torch.bfloat16), recipe(opt_level="O2"), engine="ddp", world_size=2)  # this CPU
    lines = plan.summary(model="Net", full="print(plan)").splitlines()
    assert lines[0].startswith("lowprec precision plan for Net: backend torchao") and lines[0].endswith(
        ", memory level O2")
    assert lines[1] == "  where:  ddp x2 on CPU, emulated (FP8 numerics, high-precision matmuls, no speed-up)"
    assert f"model state {plan.model_state_bytes_per_param:.3g} bytes/param (BF16 AMP baseline 8)" in lines[2]
    assert lines[3] == "  print(plan) for the full table" and len(lines) == 4
    assert "norm layers" not in lines[2]  # torchao replaces none: no count of them
    plan.modules.append(dataclasses.replace(plan.modules[0], fqn="norm", kind="norm", convert=True))
    assert plan.summary().splitlines()[2].split(";")[0].endswith(", 1 of 1 norm layers replaced")


@pytest.mark.parametrize("engine, hosts, noted", [("ddp", 1, True), ("fsdp2", 1, True), ("ddp", 2, False),
                                                  ("fsdp2", 2, False)])
def test_fp8_gradient_communication_on_one_host_is_noted_as_slower(engine, hosts, noted):
    # measured on one NVLink host: FP8 gradients halve the bytes but not the time; the plan says so where it applies
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    recipe = FP8RecipeKwargs(backend="torchao", grad_comm_dtype="fp8", skip_first_last=False, skip_slow_shapes=False)
    plan = build_plan(model, recipe, context=RunContext(device=device_info("cpu"), engine=engine, world_size=2,
                                                        hosts=hosts))
    said = [note for note in plan.notes if note.startswith("grad_comm_dtype='fp8' on one host")]
    assert bool(said) == noted and (not said or "grad_comm_dtype='bf16' is faster there" in said[0])
    quiet = build_plan(model, dataclasses.replace(recipe, grad_comm_dtype="bf16"),
                       context=RunContext(device=device_info("cpu"), engine=engine, world_size=2))
    assert not any(note.startswith("grad_comm_dtype=") for note in quiet.notes)
