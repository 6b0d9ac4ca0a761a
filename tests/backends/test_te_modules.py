"""lowprec's TE modules (lowprec/backends/te/modules.py) on CPU: the pickle-free extra-state format, state dicts
that load into the original model, and `from_float` / `TEBackend.convert` against a stand-in TE
(tests/backends/fake_te.py), which computes in high precision.
"""

from __future__ import annotations

import copy
import json
import pickle

import fake_te as fake
import pytest
import torch
from fake_te import fake_te  # noqa: F401  (fixture)
from torch import nn

from lowprec import FP8RecipeKwargs, RunContext, build_plan, portable_state_dict
from lowprec.backends import create_backend
from lowprec.backends.te import modules as te_modules
from lowprec.backends.te.modules import MAGIC, decode_state, encode_state, from_float
from lowprec.planning.hardware import DeviceInfo

H100 = DeviceInfo("cuda", "H100", (9, 0))
B200 = DeviceInfo("cuda", "B200", (10, 0))


def delayed_state(dtype: torch.dtype = torch.float32, history: int = 16) -> dict:
    """A DelayedScaling checkpoint dict as TE builds it in get_extra_state."""
    g = torch.Generator().manual_seed(0)
    return {
        "recipe": fake.DelayedScaling(margin=1, fp8_format=fake.Format.HYBRID, amax_history_len=history),
        "scale_fwd": (torch.rand(3, generator=g) * 100).to(dtype),
        "amax_history_fwd": torch.rand(history, 3, generator=g).to(dtype),
        "scale_bwd": (torch.rand(2, generator=g) * 100).to(dtype),
        "amax_history_bwd": torch.rand(history, 2, generator=g).to(dtype),
        # What TE keeps there for a Linear: bools, ints, floats (fp8_max_* from the format), lists.
        "extra_fp8_variables": {"fp8_checkpoint": True, "num_gemms": 1, "fp8_max_fwd": 448.0, "fp8_max_bwd": 57344.0,
                                "global_fp8_buffer_pos_fwd_recompute": 3, "inf": float("inf"), "name": "fwd",
                                "ids": [1, [2, 3]]},
    }


def te_pickle_payload() -> torch.Tensor:
    """TE's own extra-state format: the state dict pickled into a byte tensor."""
    state = dict(delayed_state(), recipe=None)  # a plain recipe value: the stand-in's classes need it installed
    return torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)


class Refuse:
    """Stands in for the pickle module: any use is a test failure."""

    def __getattr__(self, name):
        raise AssertionError(f"pickle.{name} was used")


# ---- the extra-state format (no TE needed) ----------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_encode_decode_round_trip(dtype):
    state = delayed_state(dtype)
    payload = encode_state(state)
    assert payload.dtype == torch.uint8 and payload.dim() == 1
    decoded = decode_state(payload)
    for name in ("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd"):
        assert decoded[name].dtype == dtype and decoded[name].shape == state[name].shape
        assert torch.equal(decoded[name], state[name])
    assert decoded["extra_fp8_variables"] == state["extra_fp8_variables"]
    assert decoded["recipe"] == {"class": "DelayedScaling", "fp8_format": "HYBRID", "margin": 1,
                                 "amax_history_len": 16, "amax_compute_algo": "max", "reduce_amax": True}


def test_payload_is_a_json_header_and_raw_bytes():
    state = delayed_state()
    payload = bytes(encode_state(state).tolist())
    assert payload.startswith(MAGIC)
    size = int.from_bytes(payload[len(MAGIC):len(MAGIC) + 8], "little")
    header = json.loads(payload[len(MAGIC) + 8:len(MAGIC) + 8 + size])
    assert [t[0] for t in header["tensors"]] == ["scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd"]
    data = sum(state[name].numel() * 4 for name, _, _ in header["tensors"])
    assert len(payload) == len(MAGIC) + 8 + size + data


def test_tuples_in_extra_variables_come_back_as_tuples():
    extra = {"pair": (1, 2), "nested": [("fwd", (2, 3))]}
    decoded = decode_state(encode_state({"recipe": None, "extra_fp8_variables": extra}))
    assert decoded["extra_fp8_variables"] == extra


def container_types(value):
    """The container type at every level: `==` alone would hide where a tuple became a list or a tagged dict."""
    if isinstance(value, dict):
        return ("dict", {k: container_types(v) for k, v in value.items()})
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, [container_types(v) for v in value])
    return type(value).__name__


def test_tuples_nested_in_dicts_come_back_as_tuples():
    # issue 16: tuples inside a dict came back as lists (encoder) or as {'__tuple__': [...]} (decoder)
    extra = {
        "layout": {"fwd": (3, 1), "bwd": {"shape": (2, 1), "ids": [(0, 1), (1, 2)]}},
        "pairs": [(1, 2), (3, (4, 5))],
        "groups": ({"name": "qkv", "dims": (64, 64)}, [({"k": (1,)},)]),
        "empty": {"t": (), "l": [], "d": {}},
    }
    decoded = decode_state(encode_state({"recipe": None, "extra_fp8_variables": extra}))["extra_fp8_variables"]
    assert decoded == extra
    assert container_types(decoded) == container_types(extra)


def test_nested_tuples_reach_the_modules_fp8_meta(fake_te):
    trained = converted_linear(0)
    fake.fill_delayed_state(trained, fake.DelayedScaling(amax_history_len=4))
    trained.fp8_meta["layout"] = ({"fwd": (3, 1)}, [(0, 1)])  # TE saves top-level tuples and lists only
    fresh = converted_linear(1)
    fresh.load_state_dict(trained.state_dict(), strict=True)
    assert fresh.fp8_meta["layout"] == ({"fwd": (3, 1)}, [(0, 1)])
    assert container_types(fresh.fp8_meta["layout"]) == container_types(trained.fp8_meta["layout"])


def test_a_sharded_load_gets_a_place_of_the_saved_size_and_the_saved_bytes_load(fake_te):
    # torch.distributed.checkpoint loads in place and refuses a size other than the saved one; a fresh module's
    # entry is empty (TE issue #1860). runtime/sharded_checkpoints.py tells each module the saved size for the load.
    trained = converted_linear(0)
    fake.fill_delayed_state(trained, fake.DelayedScaling(amax_history_len=4))
    saved = trained.state_dict()["_extra_state"]
    fresh = converted_linear(1)
    assert fresh.state_dict()["_extra_state"].numel() == 0 < saved.numel()
    fresh.loading_extra_state_bytes = saved.numel()
    place = fresh.state_dict()["_extra_state"]
    assert place.numel() == saved.numel() and not place.any()  # zeros, filled by the load
    trained.loading_extra_state_bytes = saved.numel()  # the live entry when it has that size already
    assert torch.equal(trained.state_dict()["_extra_state"], saved)
    place.copy_(saved)  # what DCP does in place
    fresh.loading_extra_state_bytes = None
    fresh.load_state_dict({**trained.state_dict(), "_extra_state": place}, strict=True)
    assert torch.equal(fresh.state_dict()["_extra_state"], saved)


@pytest.mark.parametrize(
    "extra,where,why",
    [
        ({"dtype": (1, torch.float32)}, "fp8_meta['dtype'][1]", "dtype is not one of bool, int, float, str, None"),
        ({"ids": [{"k": object()}]}, "fp8_meta['ids'][0]['k']", "object is not one of"),
        ({"by_gemm": ({0: 1.0},)}, "fp8_meta['by_gemm'][0]", "keys must be strings, and not '__tuple__' alone; got 0"),
        ({"tagged": [{"__tuple__": [1]}]}, "fp8_meta['tagged'][0]", "got '__tuple__'"),
    ],
    ids=["dtype", "object", "int-key", "tag-key"],
)
def test_encode_names_a_value_it_cannot_store(extra, where, why):
    with pytest.raises(TypeError) as err:
        encode_state({"recipe": None, "extra_fp8_variables": extra})
    assert str(err.value).startswith(f"cannot store {where} in a pickle-free TE checkpoint: ")
    assert why in str(err.value)


def payload_layout() -> tuple[torch.Tensor, int]:
    payload = encode_state(delayed_state())
    header_end = len(MAGIC) + 8 + int.from_bytes(bytes(payload[len(MAGIC):len(MAGIC) + 8].tolist()), "little")
    return payload, header_end


@pytest.mark.parametrize("cut,what", [
    ("header_size_only", "its JSON header"), ("inside_header", "its JSON header"),
    ("first_tensor", "tensor 'scale_fwd'"), ("last_byte", "tensor 'amax_history_bwd'"),
])
def test_decode_of_a_truncated_entry_says_so(cut, what):
    payload, header_end = payload_layout()
    end = {"header_size_only": len(MAGIC) + 8, "inside_header": header_end - 10, "first_tensor": header_end + 5,
           "last_byte": payload.numel() - 1}[cut]
    with pytest.raises(ValueError) as err:
        decode_state(payload[:end])
    assert str(err.value).startswith(f"lowprec TE extra state is truncated: {what} ends at byte ")
    assert str(err.value).endswith(f"the entry has {end}")


def test_decode_of_an_entry_with_trailing_bytes_says_so():
    payload, _ = payload_layout()
    longer = torch.cat([payload, torch.zeros(4, dtype=torch.uint8)])
    with pytest.raises(ValueError, match=rf"corrupt: its header describes {payload.numel()} bytes, the entry has "
                                         rf"{payload.numel() + 4}"):
        decode_state(longer)


def test_states_without_recipe_or_tensors():
    decoded = decode_state(encode_state({"recipe": None, "scale_fwd": torch.tensor([2.5]), "extra_fp8_variables": {}}))
    assert torch.equal(decoded["scale_fwd"], torch.tensor([2.5])) and decoded["recipe"] is None
    current = {"recipe": fake.Float8CurrentScaling(fp8_format=fake.Format.E4M3), "extra_fp8_variables": {"n": 1}}
    decoded = decode_state(encode_state(current))
    assert decoded == {"recipe": {"class": "Float8CurrentScaling", "fp8_format": "E4M3"},
                       "extra_fp8_variables": {"n": 1}}


@pytest.mark.parametrize(
    "payload",
    [
        torch.empty(0, dtype=torch.uint8),
        te_pickle_payload(),
        torch.frombuffer(bytearray(MAGIC[:-3]), dtype=torch.uint8),
        torch.arange(64, dtype=torch.uint8),
    ],
    ids=["empty", "te-pickle", "short", "other"],
)
def test_decode_recognises_only_its_own_format(payload):
    assert decode_state(payload) is None


def test_decode_never_unpickles(monkeypatch):
    payload = encode_state(delayed_state())
    monkeypatch.setattr(te_modules, "pickle", Refuse())
    assert torch.equal(decode_state(payload)["scale_fwd"], delayed_state()["scale_fwd"])


def test_payload_survives_weights_only_load_and_safetensors(tmp_path):
    from safetensors.torch import load_file, save_file

    state = {"proj.weight": torch.randn(4, 4), "proj._extra_state": encode_state(delayed_state()),
             "norm._extra_state": torch.empty(0, dtype=torch.uint8)}
    torch.save(state, tmp_path / "sd.pt")
    save_file(state, str(tmp_path / "sd.safetensors"))
    for loaded in (torch.load(tmp_path / "sd.pt", weights_only=True), load_file(str(tmp_path / "sd.safetensors"))):
        decoded = decode_state(loaded["proj._extra_state"])
        assert torch.equal(decoded["amax_history_bwd"], delayed_state()["amax_history_bwd"])
        assert loaded["norm._extra_state"].numel() == 0


# ---- portable state dicts (no TE needed) ----------------------------------------------------------------
class QuantizedWeight(torch.Tensor):
    """Stands in for TE's FP8-only weight (a tensor subclass defined in transformer_engine)."""

    __module__ = "transformer_engine.pytorch.tensor.float8_tensor"

    def dequantize(self):
        return self.as_subclass(torch.Tensor) * 2  # x2: shows that dequantize() produced the value


def test_portable_state_dict_drops_te_entries_only():
    weight, bias, other = torch.randn(4, 4), torch.randn(4), torch.randn(3)
    state = {"layers.0.proj.weight": weight, "layers.0.proj.bias": bias,
             "layers.0.proj._extra_state": encode_state(delayed_state()),
             "norm._extra_state": torch.empty(0, dtype=torch.uint8), "_extra_state": torch.empty(0, dtype=torch.uint8),
             "head.my_extra_state": other, "step": 3}
    out = te_modules.portable_state_dict(state)
    assert list(out) == ["layers.0.proj.weight", "layers.0.proj.bias", "head.my_extra_state", "step"]
    assert out["layers.0.proj.weight"] is weight and out["head.my_extra_state"] is other
    assert "layers.0.proj._extra_state" in state  # the input is left as it was


def test_portable_state_dict_dequantises_fp8_only_weights():
    raw = torch.randn(4, 4)
    quantized = raw.as_subclass(QuantizedWeight)
    out = te_modules.portable_state_dict({"w": quantized, "b": raw})
    assert type(out["w"]) is torch.Tensor and torch.equal(out["w"], raw * 2)
    assert out["b"] is raw


def test_public_portable_state_dict_of_a_plain_model():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    out = portable_state_dict(model)
    assert list(out) == list(model.state_dict())
    assert all(torch.equal(out[k], v) for k, v in model.state_dict().items())


# ---- from_float (stand-in TE) ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("training", [True, False])
def test_from_float_linear(fake_te, dtype, bias, training):
    torch.manual_seed(0)
    module = nn.Linear(48, 32, bias=bias).to(dtype).train(training)
    new = from_float(module, "linear")
    assert type(new).__module__ == "lowprec.backends.te.modules" and isinstance(new, fake_te.Linear)
    assert (new.in_features, new.out_features, new.training) == (48, 32, training)
    assert new.weight.dtype == dtype and new.weight.device.type == "cpu" and new.weight.requires_grad
    assert torch.equal(new.weight, module.weight)
    assert (new.bias is None) is (not bias)
    if bias:
        assert torch.equal(new.bias, module.bias) and new.bias.dtype == dtype
    x = torch.randn(5, 48, dtype=dtype)
    torch.testing.assert_close(new(x), module(x))


def test_from_float_layernorm(fake_te):
    torch.manual_seed(0)
    module = nn.LayerNorm((4, 16), eps=1e-3)
    with torch.no_grad():
        module.weight.normal_()
        module.bias.normal_()
    new = from_float(module, "layernorm")
    assert isinstance(new, fake_te.LayerNorm) and type(new).__module__ == "lowprec.backends.te.modules"
    assert (new.normalized_shape, new.eps, new.zero_centered_gamma) == ((4, 16), 1e-3, False)
    assert torch.equal(new.weight, module.weight) and torch.equal(new.bias, module.bias)
    x = torch.randn(3, 4, 16)
    torch.testing.assert_close(new(x), module(x))


def rms_cases():
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return {
        "torch": (nn.RMSNorm(64), False, torch.finfo(torch.float32).eps),
        "torch_eps": (nn.RMSNorm(64, eps=1e-5), False, 1e-5),
        "llama": (LlamaRMSNorm(64, eps=1e-6), False, 1e-6),
        "gemma": (GemmaRMSNorm(64, eps=1e-6), True, 1e-6),
    }


@pytest.mark.parametrize("case", ["torch", "torch_eps", "llama", "gemma"])
def test_from_float_rmsnorm(fake_te, case):
    pytest.importorskip("transformers")
    module, zero_centered, eps = rms_cases()[case]
    with torch.no_grad():
        module.weight.copy_(torch.randn(64) * 0.3 + (0 if zero_centered else 1))
    new = from_float(module, "rmsnorm", zero_centered=zero_centered)
    assert isinstance(new, fake_te.RMSNorm) and not hasattr(new, "bias")
    assert (new.normalized_shape, new.zero_centered_gamma) == ((64,), zero_centered)
    assert new.eps == pytest.approx(eps, rel=1e-6)
    assert torch.equal(new.weight, module.weight)  # Gemma's w is TE's zero-centred gamma as it is
    x = torch.randn(3, 64)
    torch.testing.assert_close(new(x), module(x), rtol=1e-5, atol=1e-5)


def test_from_float_on_the_meta_device(fake_te):
    with torch.device("meta"):
        module = nn.Linear(64, 64)
    new = from_float(module, "linear")
    assert new.weight.is_meta and new.bias.is_meta


@pytest.mark.parametrize("kind", ["linear", "layernorm"])
def test_from_float_keeps_frozen_parameters_frozen(fake_te, kind):
    module = nn.Linear(32, 32) if kind == "linear" else nn.LayerNorm(32)
    module.requires_grad_(False)
    new = from_float(module, kind)
    assert {n: p.requires_grad for n, p in new.named_parameters()} == {"weight": False, "bias": False}


# ---- TEBackend.convert: the plan decides, from_float builds ---------------------------------------------
def te_convert(model: nn.Module, recipe: str = "current", device: DeviceInfo = H100, **kwargs):
    kwargs.setdefault("skip_first_last", False)
    kwargs.setdefault("skip_slow_shapes", False)
    r = FP8RecipeKwargs(backend="te", recipe=recipe, **kwargs)
    context = RunContext(device=device)
    backend = create_backend(r, context)
    plan = build_plan(model, r, context=context, backend=backend)
    new = backend.convert(model, plan)
    plan.verify(new, backend.is_converted)
    return new, plan, backend


def mixed_model(seed: int = 0) -> nn.Sequential:
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    torch.manual_seed(seed)
    gemma = GemmaRMSNorm(256)
    with torch.no_grad():
        gemma.weight.normal_(0, 0.3)
    return nn.Sequential(nn.Linear(128, 256), nn.LayerNorm(256), nn.Linear(256, 256, bias=False), gemma,
                         nn.Linear(256, 100), nn.RMSNorm(100), nn.Linear(100, 128))


@pytest.mark.parametrize("recipe,device", [("delayed", H100), ("current", H100), ("block", H100), ("mxfp8", B200)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_convert_keeps_weights_dtypes_and_outputs(fake_te, recipe, device, dtype):
    pytest.importorskip("transformers")
    reference = mixed_model().to(dtype)
    model, plan, backend = te_convert(copy.deepcopy(reference), recipe, device)
    skipped = {d.fqn: d.reason for d in plan.skipped}
    assert set(skipped) == {"4", "6"}  # 100 features fit no recipe; each decided on its own
    assert all(type(model[int(i)]) is nn.Linear for i in skipped)
    assert [backend.is_converted(m) for m in model] == [True, True, True, True, False, True, False]
    assert model[3].zero_centered_gamma and not model[5].zero_centered_gamma
    for name, tensor in reference.state_dict().items():
        assert model.state_dict()[name].dtype == dtype
        assert torch.equal(model.state_dict()[name], tensor), name
    x = torch.randn(4, 128, dtype=dtype)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(model(x), reference(x), **tol)


def test_convert_swaps_a_module_registered_twice_once(fake_te):
    shared = nn.Linear(64, 64)
    model = nn.ModuleDict({"a": shared, "b": shared, "c": nn.Linear(64, 64)})
    model, plan, _ = te_convert(model)
    assert model["a"] is model["b"] and model["a"] is not shared and model["c"] is not model["a"]
    assert [d.fqn for d in plan.converted] == ["a", "c"]


def test_convert_of_a_bare_linear_returns_the_new_root(fake_te):
    layer = nn.Linear(64, 64)
    model, plan, backend = te_convert(layer)
    assert model is not layer and backend.is_converted(model)
    assert [d.fqn for d in plan.converted] == ["<root>"]


def test_convert_follows_the_module_filter_and_skips(fake_te):
    model = nn.ModuleDict({"keep": nn.Linear(64, 64), "fp8": nn.Linear(64, 64), "odd": nn.Linear(64, 40)})
    model, plan, backend = te_convert(model, exclude=["keep"])
    assert {d.fqn: d.convert for d in plan.modules} == {"keep": False, "fp8": True, "odd": False}
    assert type(model["keep"]) is nn.Linear and type(model["odd"]) is nn.Linear
    assert backend.is_converted(model["fp8"])


# ---- extra state through the modules (stand-in TE) ---------------------------------------------------------
def converted_linear(seed: int = 0):
    torch.manual_seed(seed)
    return from_float(nn.Linear(32, 32), "linear")


def test_checkpoint_without_pickle_restores_delayed_scaling(fake_te, tmp_path, monkeypatch):
    trained = converted_linear(0)
    recipe = fake.DelayedScaling(margin=2, fp8_format=fake.Format.E4M3, amax_history_len=8,
                                 amax_compute_algo="most_recent")
    fake.fill_delayed_state(trained, recipe, seed=1)
    state = trained.state_dict()
    assert decode_state(state["_extra_state"]) is not None  # lowprec's format, not TE's pickle
    torch.save(state, tmp_path / "ckpt.pt")

    fresh = converted_linear(1)
    monkeypatch.setattr(te_modules, "pickle", Refuse())
    fresh.load_state_dict(torch.load(tmp_path / "ckpt.pt", weights_only=True), strict=True)
    assert fresh.fp8_meta["recipe"] == recipe
    for key in ("scaling_fwd", "scaling_bwd"):
        assert torch.equal(fresh.fp8_meta[key].scale, trained.fp8_meta[key].scale)
        assert torch.equal(fresh.fp8_meta[key].amax_history, trained.fp8_meta[key].amax_history)
    meta = fresh.fp8_meta
    assert (meta["num_gemms"], meta["fp8_max_fwd"], meta["fp8_max_bwd"], meta["fp8_checkpoint"]) == (1, 448.0, 57344.0,
                                                                                                   True)
    assert torch.equal(fresh.weight, trained.weight)
    assert fresh.te_format_payloads == []  # nothing was handed to TE's (pickle-gated) loader


def test_scales_are_saved_after_an_eval_forward(fake_te):
    """TE clears fp8_checkpoint in a forward without FP8; the scales learned so far must still be saved."""
    module = converted_linear()
    fake.fill_delayed_state(module, fake.DelayedScaling(amax_history_len=4))
    module.fp8_meta["fp8_checkpoint"] = False
    decoded = decode_state(module.get_extra_state())
    assert torch.equal(decoded["scale_fwd"], module.fp8_meta["scaling_fwd"].scale)
    assert module.fp8_meta["fp8_checkpoint"] is False  # put back as it was


def test_module_without_fp8_state_saves_an_empty_entry(fake_te):
    module = converted_linear()
    assert module.state_dict()["_extra_state"].numel() == 0
    converted_linear(1).load_state_dict(module.state_dict(), strict=True)


def test_current_scaling_state_restores_its_recipe(fake_te):
    module = converted_linear()
    module.fp8_meta.update(recipe=fake.Float8CurrentScaling(fp8_format=fake.Format.E4M3), fp8_checkpoint=True)
    fresh = converted_linear(1)
    fresh.load_state_dict(module.state_dict(), strict=True)
    assert fresh.fp8_meta["recipe"] == fake.Float8CurrentScaling(fp8_format=fake.Format.E4M3)


def test_te_format_payloads_go_to_te_untouched(fake_te, monkeypatch):
    te_payload = te_pickle_payload()
    module = converted_linear()
    monkeypatch.setattr(te_modules, "pickle", Refuse())
    module.load_state_dict({"weight": module.weight.detach(), "bias": module.bias.detach(),
                            "_extra_state": te_payload}, strict=True)
    assert len(module.te_format_payloads) == 1 and torch.equal(module.te_format_payloads[0], te_payload)
    assert "scaling_fwd" not in module.fp8_meta


def test_plain_checkpoint_loads_into_the_converted_model(fake_te):
    plain = nn.Sequential(nn.Linear(32, 32), nn.LayerNorm(32), nn.RMSNorm(32))
    for p in plain.parameters():
        nn.init.normal_(p)
    model, _, backend = te_convert(copy.deepcopy(plain))
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    state = plain.state_dict()
    keys = list(state)
    model.load_state_dict(state, strict=True)
    assert list(state) == keys  # the caller's dict is not changed
    assert all(backend.is_converted(m) for m in model)
    for name, tensor in state.items():
        assert torch.equal(model.state_dict()[name], tensor)


def test_converted_checkpoint_loads_into_the_original_model(fake_te):
    original = nn.Sequential(nn.Linear(32, 32), nn.LayerNorm(32), nn.RMSNorm(32), nn.Linear(32, 8))
    model, _, _ = te_convert(copy.deepcopy(original))
    fake.fill_delayed_state(model[0], fake.DelayedScaling(amax_history_len=4))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    state = model.state_dict()
    assert [k for k in state if k.endswith("_extra_state")] == ["0._extra_state", "1._extra_state", "2._extra_state"]
    fresh = copy.deepcopy(original)
    fresh.load_state_dict(portable_state_dict(model), strict=True)
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(tensor, state[name])
    with pytest.raises(RuntimeError, match="Unexpected key"):
        copy.deepcopy(original).load_state_dict(state, strict=True)  # why the portable form is needed


# ---- an overflow stays visible (guard.py; the stand-in saturates as TE's casts do) --------------------------
NON_FINITE = [float("inf"), float("-inf"), float("nan")]


def _linear_pair(fake_te, bias=True):
    torch.manual_seed(0)
    module = nn.Linear(16, 8, bias=bias)
    plain = fake_te.Linear(16, 8, bias=bias, device="cpu")
    plain.load_state_dict(module.state_dict(), strict=False)  # TE's own Linear also wants an _extra_state
    return plain, from_float(module, "linear")


@pytest.mark.parametrize("value", NON_FINITE)
def test_a_non_finite_input_gives_a_non_finite_output(fake_te, value):
    plain, ours = _linear_pair(fake_te)
    x = torch.randn(4, 16)
    x[1, 3] = value
    with fake_te.autocast(enabled=True):
        plain_finite = bool(torch.isfinite(plain(x)).all())
        y = ours(x)
    assert plain_finite is (value == value)  # the stand-in, as TE, turns inf into a finite +-448; NaN it keeps
    assert torch.isnan(y[1]).all() and torch.isfinite(y[[0, 2, 3]]).all()
    # finite rows are TE's result exactly: the guard changes no finite value
    with fake_te.autocast(enabled=True):
        torch.testing.assert_close(y[[0, 2, 3]], plain(x[[0, 2, 3]]), rtol=0, atol=0)


@pytest.mark.parametrize("value", NON_FINITE)
def test_a_non_finite_output_gradient_gives_non_finite_gradients(fake_te, value):
    plain, ours = _linear_pair(fake_te)
    x = torch.randn(4, 16, requires_grad=True)
    grads = {}
    for name, layer in (("plain", plain), ("ours", ours)):
        x.grad = None
        with fake_te.autocast(enabled=True):
            y = layer(x)
        g = torch.randn_like(y)
        g[2, 5] = value
        y.backward(g)
        grads[name] = (x.grad.clone(), layer.weight.grad.clone(), layer.bias.grad.clone())
    if value == value:  # inf: the stand-in saturates it, so the test can tell the guard's work from TE's
        assert all(torch.isfinite(t).all() for t in grads["plain"])
    dx, dw, db = grads["ours"]
    assert torch.isnan(dx[2]).all() and torch.isfinite(dx[[0, 1, 3]]).all()
    assert torch.isnan(dw[5]).all() and torch.isnan(db[5]) and torch.isfinite(db[torch.arange(8) != 5]).all()


def test_the_guard_leaves_finite_values_and_gradients_exact():
    from lowprec.backends.te.guard import guard_input, guard_output_grad

    x = torch.tensor([1.5, -0.0, 0.0, 1e-40, -3e38, float("inf"), float("-inf"), float("nan")], requires_grad=True)
    y = guard_input(x)
    assert torch.equal(y[:5], x[:5]) and torch.signbit(y[1]) and torch.isnan(y[5:]).all()
    g = torch.arange(8.0)
    y.backward(g)
    assert torch.equal(x.grad, g)  # identity backward: no mask saved, no gradient changed
    z = torch.tensor([2.0, 3.0], requires_grad=True)
    out = guard_output_grad(z)
    assert torch.equal(out, z)
    out.backward(torch.tensor([float("inf"), 4.0]))
    assert torch.isnan(z.grad[0]) and z.grad[1] == 4.0
    # tensors that need no gradient pass the forward guard too; integer tensors are left alone
    assert torch.isnan(guard_input(torch.tensor([float("inf")]))).all()
    ids = torch.tensor([1, 2])
    assert guard_input(ids) is ids and guard_output_grad(ids) is ids
