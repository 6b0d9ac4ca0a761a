"""The plan's saved-activations section (lowprec/planning/activations.py): what each backend keeps of an FP8
Linear layer's input for backward, and the Linear inputs' bytes per token and block against BF16 AMP."""

from __future__ import annotations

import json

import pytest
from torch import nn

from lowprec import FP8RecipeKwargs, RunContext, build_plan
from lowprec.backends import create_backend
from lowprec.planning.hardware import DeviceInfo

H100 = DeviceInfo("cuda", "H100", (9, 0))
B200 = DeviceInfo("cuda", "B200", (10, 0))
D = 128
HOOKS = 1 + 1 / 128  # lowprec's FP8 storage: a byte per element and one per 128

# (backend, recipe, level, device) -> bytes per element an FP8 layer keeps of its input
CONFIGS = {
    ("torchao", "tensorwise", None, H100): 2.0,  # compiled layers (the default here): the graph keeps the input
    ("torchao", "rowwise", None, H100): 2.0,  # torchao's matmul saves input_hp: cast again along the other axis
    ("torchao", "rowwise_with_gw_hp", None, H100): 2.0,
    ("msamp", "delayed", "O2", H100): 1.0,  # FP8Linear saves its E4M3 cast
    ("msamp", "delayed", "O3", H100): 1.0,
    ("te", "delayed", None, H100): 1.0,
    ("te", "current", None, H100): 1.0,
    ("te", "block", None, H100): 1 + 4 / 128,  # an FP32 scale per 128
    ("te", "mxfp8", None, B200): 1 + 1 / 32,  # an E8M0 scale per 32
}


def blocks_model() -> nn.Module:
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up_proj = nn.Linear(D, 2 * D)
            self.down_proj = nn.Linear(2 * D, D)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([Block() for _ in range(3)])
            self.lm_head = nn.Linear(D, 64)  # outside the blocks: not in the per-block figure

    return Net()


def plan_of(model, key, **options):
    backend_name, recipe, level, device = key
    recipe_kwargs = FP8RecipeKwargs(backend=backend_name, recipe=recipe, opt_level=level, skip_slow_shapes=False,
                                    skip_first_last=False, **options)
    # O3 shards across ranks: planned under FSDP2
    context = RunContext(device=device, engine="fsdp2", world_size=2) if level == "O3" else RunContext(device=device)
    backend = create_backend(recipe_kwargs, context, require_package=False)
    return build_plan(model, recipe_kwargs, context=backend.context, backend=backend)


@pytest.mark.parametrize("key", list(CONFIGS), ids=lambda k: ":".join(x for x in k[:3] if x))
@pytest.mark.parametrize("activation_dtype", [None, "fp8"])
def test_linear_inputs_per_token_and_block(key, activation_dtype):
    plan = plan_of(blocks_model(), key, activation_dtype=activation_dtype)
    section = plan.activations
    fp8_bytes = CONFIGS[key]
    if activation_dtype == "fp8" and fp8_bytes == 2.0:
        fp8_bytes = HOOKS  # the high-precision copy torchao keeps is packed by the hooks
    # each block: up_proj saves D values per token, down_proj 2D
    assert section.linear_bytes_per_token == pytest.approx(3 * D * fp8_bytes)
    assert section.baseline_linear_bytes_per_token == pytest.approx(3 * D * 2.0)
    assert section.per == "in one Block of 3"
    assert ("FP8 E4M3" in section.fp8_linear_inputs) == (fp8_bytes < 2)
    assert ("activation_dtype='fp8'" in section.other_tensors) and (
        section.other_tensors.startswith("FP8 E4M3") == (activation_dtype == "fp8"))
    text = str(plan)
    assert "saved for backward (per token in one Block of 3):" in text and "all Linear inputs   estimated" in text
    assert json.loads(json.dumps(plan.to_dict()))["activations"]["linear_bytes_per_token"] == pytest.approx(
        section.linear_bytes_per_token)


@pytest.mark.parametrize("activation_dtype, kept_bytes", [(None, 2.0), ("fp8", HOOKS)])
def test_layers_kept_in_high_precision_save_autocasts_copy_or_the_hooks_fp8(activation_dtype, kept_bytes):
    plan = plan_of(blocks_model(), ("msamp", "delayed", "O2", H100), activation_dtype=activation_dtype,
                   exclude=["down_proj"])
    # up_proj in FP8 (1 byte x D), down_proj kept (2D values in BF16, or packed by the hooks)
    assert plan.activations.linear_bytes_per_token == pytest.approx(D * 1.0 + 2 * D * kept_bytes)
    assert plan.activations.kept_linear_inputs.startswith("BF16" if activation_dtype is None else "FP8 E4M3")


def test_torchao_tensorwise_with_eager_layers_saves_the_forwards_fp8_cast():
    plan = plan_of(blocks_model(), ("torchao", "tensorwise", None, H100), compile_fp8_layers=False)
    assert plan.activations.linear_bytes_per_token == pytest.approx(3 * D * 1.0)
    assert plan.activations.fp8_linear_inputs.startswith("FP8 E4M3, per-tensor scale (the forward's cast")


def test_a_model_without_a_block_list_is_counted_whole():
    model = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))
    plan = plan_of(model, ("te", "current", None, H100))
    assert plan.activations.per == "in the whole model (no block list found)"
    assert plan.activations.linear_bytes_per_token == pytest.approx(3 * D * 1.0)


def test_a_compiled_model_says_its_graph_decides():
    recipe = FP8RecipeKwargs(backend="torchao", skip_slow_shapes=False, activation_dtype="fp8")
    backend = create_backend(recipe, RunContext(device=H100, compiled=True), require_package=False)
    plan = build_plan(blocks_model(), recipe, context=backend.context, backend=backend)
    assert "compiled model: the tensors its graph saves for backward" in plan.activations.other_tensors


@pytest.mark.parametrize(("policy", "said"), [("fp8", None), ("bf16", "FP32 tensors (the residual stream under "
                                                                       "autocast) in BF16"),
                                               ("keep", "FP32 tensors (the residual stream under autocast) kept in "
                                                        "FP32")])
def test_the_plan_says_how_fp32_saved_tensors_are_stored(monkeypatch, policy, said):
    monkeypatch.setenv("LOWPREC_FP8_ACTIVATIONS_FP32", policy)
    plan = plan_of(blocks_model(), ("msamp", "delayed", "O2", H100), activation_dtype="fp8")
    others = plan.activations.other_tensors
    assert ("LOWPREC_FP8_ACTIVATIONS_FP32" in others) == (said is not None)
    if said:
        assert said in others
    # without FP8 activations the variable changes nothing, and the plan does not mention it
    assert "LOWPREC_FP8_ACTIVATIONS_FP32" not in plan_of(blocks_model(), ("msamp", "delayed", "O2", H100)
                                                         ).activations.other_tensors


def test_a_bad_fp32_policy_is_refused_when_planning(monkeypatch):
    monkeypatch.setenv("LOWPREC_FP8_ACTIVATIONS_FP32", "half")
    with pytest.raises(ValueError, match="LOWPREC_FP8_ACTIVATIONS_FP32='half' is not one of fp8, bf16, keep"):
        plan_of(blocks_model(), ("msamp", "delayed", "O2", H100), activation_dtype="fp8")
