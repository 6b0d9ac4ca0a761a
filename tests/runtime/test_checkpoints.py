"""runtime/checkpoints.py and `Accelerator.load_state` (runtime/sharded_checkpoints.py): a model or optimizer checkpoint
that does not fit what lowprec prepared is refused before anything changes, never half-loaded."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lowprec import Accelerator, FP8RecipeKwargs

pytest.importorskip("torchao")

CONFIGS = {"torchao": dict(backend="torchao"), "torchao-fp8-states": dict(backend="torchao", optimizer_states="fp8"),
           "msamp-O2": dict(backend="msamp", opt_level="O2")}
MODEL_CONFIGS = ["torchao", "msamp-O2"]  # optimizer_states changes no model entry


def make_model(layers: int = 3, seed: int = 0) -> nn.Sequential:
    """Linears of width 64 (32 in): one more layer adds keys and changes no shape of the others."""
    torch.manual_seed(seed)
    modules: list[nn.Module] = [nn.Linear(32, 64)]
    for _ in range(layers - 1):
        modules += [nn.GELU(), nn.Linear(64, 64)]
    return nn.Sequential(*modules)


def prepared(name: str, optimizer=torch.optim.AdamW, layers: int = 3, seed: int = 0, steps: int = 1):
    """A fresh Accelerator with `CONFIGS[name]`, a model and its optimizer prepared and stepped `steps` times (msamp's
    amax histories and the optimizers' states filled)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[FP8RecipeKwargs(skip_slow_shapes=False,
                                                                                      **CONFIGS[name])])
    model = make_model(layers, seed)
    kwargs = dict(lr=0.1, momentum=0.9) if optimizer is torch.optim.SGD else dict(lr=1e-2)
    model, opt = accelerator.prepare(model, optimizer(model.parameters(), **kwargs))
    for i in range(steps):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(i))
        accelerator.backward(model(x).float().pow(2).mean())
        opt.step()
        opt.zero_grad()
    return accelerator, model, opt


def snapshot(model: nn.Module, optimizer) -> tuple[dict, list, dict]:
    inner = getattr(optimizer, "optimizer", optimizer)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups]
    return ({k: v.clone() for k, v in model.state_dict().items()}, copy.deepcopy(groups),
            {i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
             for i, s in enumerate(inner.state.values())})


def assert_unchanged(before: tuple[dict, list, dict], model: nn.Module, optimizer) -> None:
    weights, groups, states = snapshot(model, optimizer)
    assert weights.keys() == before[0].keys()
    assert [k for k, v in before[0].items() if not torch.equal(weights[k], v)] == []
    assert groups == before[1]
    assert states.keys() == before[2].keys()
    for i, state in before[2].items():
        assert states[i].keys() == state.keys()
        assert all(torch.equal(states[i][k], v) if isinstance(v, torch.Tensor) else states[i][k] == v
                   for k, v in state.items())


# ---- the model: missing and unexpected keys (ForeignBackendEntries) ---------------------------------------------
@pytest.mark.parametrize("name", MODEL_CONFIGS)
@pytest.mark.parametrize("change", ["missing key", "unexpected key", "one more layer"])
def test_a_checkpoint_with_other_keys_is_refused_before_anything_is_copied(fresh_accelerate_state, name, change):
    # torch raised on the keys only after copying every other tensor (msamp's amax histories too): half-loaded
    if change == "one more layer":
        accelerator, model, _ = prepared(name, layers=4, seed=1)
        state = {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
        named = "6.weight"
    accelerator, model, optimizer = prepared(name)
    inner = accelerator.unwrap_model(model)
    if change != "one more layer":  # every entry differs from the model's: any copy would show
        state = {k: v.clone() + 1 if v.is_floating_point() else v.clone() for k, v in inner.state_dict().items()}
        named = "4.bias" if change == "missing key" else "5.weight"
        if change == "missing key":
            del state[named]
        else:
            state[named] = torch.zeros(3)
    before = snapshot(inner, optimizer)
    with pytest.raises(ValueError, match=r"(?s)nothing was loaded:.*" + named.replace(".", r"\.")) as refused:
        inner.load_state_dict(state)
    assert isinstance(refused.value, RuntimeError)  # torch's type for these keys, for code that catches it
    assert_unchanged(before, inner, optimizer)


@pytest.mark.parametrize("name", MODEL_CONFIGS)
def test_a_non_strict_load_keeps_torchs_semantics(fresh_accelerate_state, name):
    accelerator, model, _ = prepared(name)
    inner = accelerator.unwrap_model(model)
    state = {k: v.clone() + 1 if v.is_floating_point() else v.clone() for k, v in inner.state_dict().items()}
    del state["4.bias"]
    state["5.weight"] = torch.zeros(3)
    bias = inner.state_dict()["4.bias"].clone()
    result = inner.load_state_dict(state, strict=False)
    assert result.missing_keys == ["4.bias"] and result.unexpected_keys == ["5.weight"]
    after = inner.state_dict()
    assert torch.equal(after["4.bias"], bias)
    assert all(torch.equal(after[k], v) for k, v in state.items() if k in after)


# ---- the optimizer (from_low_bit_states on torch's AdamW, LowBitAdamW's own load) and load_state ------------------
@pytest.mark.parametrize("name", list(CONFIGS))
def test_load_state_of_another_optimizer_is_refused_before_the_model_loads(tmp_path, fresh_accelerate_state, name):
    # the model was loaded, then the optimizer refused (LowBitAdamW: "nothing was loaded", false) or failed (torch's
    # AdamW: a bare KeyError 'step', SGD's groups left behind)
    accelerator, _, _ = prepared("torchao", optimizer=torch.optim.SGD, seed=5)
    accelerator.save_state(str(tmp_path / "sgd"))
    accelerator, model, optimizer = prepared(name)
    inner = accelerator.unwrap_model(model)
    before = snapshot(inner, optimizer)
    with pytest.raises(ValueError, match="nothing was loaded: optimizer.bin: .*not an Adam/AdamW checkpoint"):
        accelerator.load_state(str(tmp_path / "sgd"))
    assert_unchanged(before, inner, optimizer)
    accelerator.backward(model(torch.randn(16, 32)).float().pow(2).mean())
    optimizer.step()  # and it trains on


@pytest.mark.parametrize("name", list(CONFIGS))
def test_an_sgd_state_dict_is_refused_by_the_optimizer_before_anything_changes(fresh_accelerate_state, name):
    plain = make_model()
    sgd = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    plain(torch.randn(4, 32)).sum().backward()
    sgd.step()
    accelerator, model, optimizer = prepared(name)
    before = snapshot(accelerator.unwrap_model(model), optimizer)
    with pytest.raises(ValueError, match=r"load_state_dict: the state of parameter 0 has no step, exp_avg, "
                                         r"exp_avg_sq: not an Adam/AdamW checkpoint; nothing was loaded"):
        optimizer.load_state_dict(sgd.state_dict())
    assert_unchanged(before, accelerator.unwrap_model(model), optimizer)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_optimizer_states_of_another_shape_are_refused_naming_parameter_and_shapes(fresh_accelerate_state, name):
    # loaded without a word, then the first step failed on the sizes
    _, _, other = prepared(name, seed=5)
    state = copy.deepcopy(other.state_dict())
    for key in ("exp_avg", "exp_avg_sq"):
        state["state"][2][key] = state["state"][2][key][:48]  # 2.weight, (64, 64)
    accelerator, model, optimizer = prepared(name)
    before = snapshot(accelerator.unwrap_model(model), optimizer)
    with pytest.raises(ValueError, match=r"the exp_avg of parameter 2 has shape \(48, 64\) in the checkpoint, the "
                                         r"parameter \(64, 64\).*nothing was loaded"):
        optimizer.load_state_dict(state)
    assert_unchanged(before, accelerator.unwrap_model(model), optimizer)
    optimizer.load_state_dict(copy.deepcopy(other.state_dict()))  # one that fits still loads


def prepared_model_only(name: str, model: nn.Module):
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[FP8RecipeKwargs(skip_slow_shapes=False,
                                                                                      **CONFIGS[name])])
    return accelerator, accelerator.prepare(model)


@pytest.mark.parametrize("name", MODEL_CONFIGS)
@pytest.mark.parametrize("safe", [True, False])
def test_load_state_of_a_model_file_with_other_keys_is_refused_before_anything_loads(tmp_path, fresh_accelerate_state,
                                                                                      name, safe):
    # safetensors' load_model (Accelerate's for model.safetensors) loads non-strict and checks the keys after
    # copying: a checkpoint of a model with a layer fewer half-loaded, then raised
    accelerator, _ = prepared_model_only(name, make_model(layers=2, seed=5))
    accelerator.save_state(str(tmp_path / "short"), safe_serialization=safe)
    accelerator, model = prepared_model_only(name, make_model(layers=3))
    inner = accelerator.unwrap_model(model)
    before = {k: v.clone() for k, v in inner.state_dict().items()}
    with pytest.raises(ValueError, match=r"does not load into model 0, and nothing was loaded: .*\n  4.bias: in the "
                                         r"model, missing from the file"):
        accelerator.load_state(str(tmp_path / "short"))
    after = inner.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    accelerator.load_state(str(tmp_path / "short"), strict=False)  # what matches, as torch's strict=False
    assert torch.equal(inner.state_dict()["0.bias"], make_model(layers=2, seed=5)[0].bias)


@pytest.mark.parametrize("name", MODEL_CONFIGS)
def test_load_state_of_tied_weights_saved_once_loads(tmp_path, fresh_accelerate_state, name):
    # safetensors saves tensors sharing storage once: the other name is not missing
    def tied(seed):
        model = make_model(layers=3, seed=seed)
        model[4].weight = model[2].weight
        return model

    accelerator, _ = prepared_model_only(name, tied(5))
    accelerator.save_state(str(tmp_path / "tied"))
    accelerator, model = prepared_model_only(name, tied(0))
    accelerator.load_state(str(tmp_path / "tied"))
    inner = accelerator.unwrap_model(model)
    assert torch.equal(inner[4].weight, tied(5)[2].weight) and inner[4].weight is inner[2].weight
