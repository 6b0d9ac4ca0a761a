"""lowprec.Accelerator with backend="te" on CPU: a stand-in TE (tests/backends/fake_te.py) and an assumed GPU.

What this covers: conversion at prepare(), every forward inside te.autocast (on in training, off in eval
unless asked), the optimizer stepping the TE modules' parameters, checkpoints (save_model into the plain
model, save_state / load_state of delayed-scaling state without pickle), and the errors prepare() raises.
"""

from __future__ import annotations

import copy
import pickle

import fake_te as fake
import pytest
import torch
from fake_te import fake_te  # noqa: F401  (fixture)
from torch import nn

from lowprec import Accelerator, BackendUnavailableError, FP8RecipeKwargs
from lowprec.planning.hardware import DeviceInfo

H100 = DeviceInfo("cuda", "H100", (9, 0))
B200 = DeviceInfo("cuda", "B200", (10, 0))
RECIPES = ["delayed", "current", "block", "mxfp8"]
DEVICE_FOR = {"delayed": H100, "current": H100, "block": H100, "mxfp8": B200}
TE_RECIPE_CLASS = {"delayed": "DelayedScaling", "current": "Float8CurrentScaling", "block": "Float8BlockScaling",
                   "mxfp8": "MXFP8BlockScaling"}


@pytest.fixture
def te_accelerator(fake_te, monkeypatch, fresh_accelerate_state):
    """Build lowprec.Accelerator(backend='te') on this CPU host planning for an assumed GPU."""
    device = {"value": H100}
    monkeypatch.setattr("lowprec.runtime.run_context.device_info", lambda *_a, **_k: device["value"])

    def make(recipe="current", gpu=None, **kwargs):
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        device["value"] = gpu or DEVICE_FOR[recipe]
        dynamo_plugin = kwargs.pop("dynamo_plugin", None)
        kwargs.setdefault("skip_first_last", False)
        kwargs.setdefault("skip_slow_shapes", False)
        return Accelerator(mixed_precision="fp8", kwargs_handlers=[FP8RecipeKwargs(backend="te", recipe=recipe,
                                                                                   **kwargs)],
                           dynamo_plugin=dynamo_plugin)

    return make


def small_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 16),
                         nn.Linear(16, 10))


def data(n: int = 64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 32, generator=g)
    return torch.utils.data.TensorDataset(x, torch.randn(n, 10, generator=g))


@pytest.mark.parametrize("recipe", RECIPES)
def test_prepare_converts_runs_in_te_autocast_and_trains(te_accelerator, recipe):
    accelerator = te_accelerator(recipe)
    model = small_model()
    reference = copy.deepcopy(model)
    loader = torch.utils.data.DataLoader(data(), batch_size=16)
    model, loader = accelerator.prepare(model, loader)
    inner = accelerator.unwrap_model(model)
    optimizer = accelerator.prepare(torch.optim.AdamW(inner.parameters(), lr=1e-2))
    plan = accelerator.precision_plan
    kept = {"delayed": {"5"}, "current": {"5"}, "block": {"0", "2", "4", "5"}, "mxfp8": {"4", "5"}}[recipe]
    assert {d.fqn for d in plan.skipped} == kept
    converted = {int(d.fqn): inner[int(d.fqn)] for d in plan.converted}
    assert all(type(m).__module__ == "lowprec.backends.te.modules" for m in converted.values())
    assert all(type(inner[int(n)]) is nn.Linear for n in kept)

    x, y = next(iter(loader))
    calls = len(fake.autocast_calls)
    loss = nn.functional.mse_loss(model(x).float(), y)
    accelerator.backward(loss)
    optimizer.step()
    for i, module in converted.items():
        assert not torch.equal(module.weight.detach(), reference[i].weight)
    if recipe == "block":  # no Linear fits 128x128 blocks: only the norm is TE's, and no FP8 context is entered
        assert len(fake.autocast_calls) == calls
        return
    assert len(fake.autocast_calls) == calls + 1 and fake.autocast_calls[-1]["enabled"] is True
    assert type(fake.autocast_calls[-1]["recipe"]).__name__ == TE_RECIPE_CLASS[recipe]
    assert all(m.fp8 for m in converted.values() if hasattr(m, "in_features"))

    model.eval()
    with torch.no_grad():
        model(x)
    assert fake.autocast_calls[-1]["enabled"] is False  # TE's and Accelerate's default: eval in high precision


@pytest.mark.parametrize("seeded", [True, False])
def test_delayed_first_step_is_seeded_through_prepare(te_accelerator, monkeypatch, seeded):
    """backends/te/first_scales.py through Accelerate: the first training step's casts (emulated by the stand-in)
    use scales from that step's tensors; LOWPREC_TE_FIRST_SCALES=0 leaves TE's initial 1."""
    monkeypatch.setattr(fake.emulation, "delayed_casts", True)
    monkeypatch.setenv("LOWPREC_TE_FIRST_SCALES", "1" if seeded else "0")
    accelerator = te_accelerator("delayed")
    model = accelerator.prepare(small_model())
    inner = accelerator.unwrap_model(model)
    converted = [inner[int(d.fqn)] for d in accelerator.precision_plan.converted if d.kind == "linear"]
    assert len(converted) == 3
    seen = {}
    hooks = [m.register_forward_pre_hook(lambda mod, args: seen.__setitem__(mod, args[0].detach())) for m in converted]
    x, y = data()[:16]
    accelerator.backward(nn.functional.mse_loss(model(x).float(), y))
    for h in hooks:
        h.remove()
    for module in converted:
        scales = module.fp8_meta["scaling_fwd"].scale, module.fp8_meta["scaling_bwd"].scale
        if seeded:
            torch.testing.assert_close(scales[0][0], 448.0 / seen[module].abs().amax().float())
            torch.testing.assert_close(scales[0][1], 448.0 / module.weight.detach().abs().amax().float())
            assert scales[1][0] != 1 and module._lowprec_first_scales == "done"
        else:
            assert torch.equal(scales[0], torch.ones(3)) and torch.equal(scales[1], torch.ones(2))


def test_no_te_autocast_where_no_linear_runs_in_fp8(te_accelerator):
    accelerator = te_accelerator("current", exclude=["0", "2"])  # the norm is still replaced by TE's
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.LayerNorm(64))
    model = accelerator.prepare(model)
    assert [d.fqn for d in accelerator.precision_plan.converted] == ["3"]
    calls = len(fake.autocast_calls)
    model(torch.randn(8, 32))
    assert len(fake.autocast_calls) == calls


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_optimizer_built_before_prepare_steps_the_te_parameters(te_accelerator, recipe):
    accelerator = te_accelerator(recipe)
    model = small_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    inner = accelerator.unwrap_model(model)
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert in_optimizer == {id(p) for p in inner.parameters()}
    before = inner[0].weight.detach().clone()
    accelerator.backward(model(torch.randn(8, 32)).float().square().mean())
    optimizer.step()
    assert not torch.equal(inner[0].weight.detach(), before)


@pytest.mark.parametrize("level, states", [("O1", (torch.float32, torch.float32)),
                                           ("O2", (torch.float8_e4m3fn, torch.float16))])
def test_levels_store_te_weights_in_fp16_and_their_gradients_in_fp8(te_accelerator, level, states):
    from lowprec.optim import LowBitAdamW

    accelerator = te_accelerator("current", opt_level=level)
    model = small_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    inner = accelerator.unwrap_model(model)
    linears = [m for m in inner.modules() if type(m).__name__ == "Linear" and m.__module__ != "torch.nn.modules.linear"]
    assert linears and all(m.weight.dtype == torch.float16 for m in linears)
    assert all(m.weight.dtype == torch.float32 for m in inner.modules() if type(m).__name__ == "LayerNorm")
    base = optimizer.optimizer
    assert type(base) is LowBitAdamW
    x, y = torch.randn(16, 32), torch.randn(16, 10)
    losses = []
    for _ in range(30):
        loss = (model(x).float() - y).square().mean()
        accelerator.backward(loss)
        assert all(m.weight.grad is None for m in linears)  # kept in FP8 outside .grad
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]
    state = base.state[linears[0].weight]
    assert (state["exp_avg"].dtype, state["exp_avg_sq"].dtype) == states
    plan = accelerator.precision_plan
    assert plan.tensor("weight").dtype.startswith("FP16 (") and plan.tensor("weight_grad").dtype.startswith("FP8")
    # the checkpoint loads into the plain model, weights back in FP32
    for m in inner.modules():
        if hasattr(m, "fp8_meta"):
            m.fp8_meta["recipe"] = fake.Float8CurrentScaling()  # what TE records in a forward
    plain = small_model(seed=1)
    plain.load_state_dict(accelerator.get_state_dict(model))
    assert torch.equal(plain[0].weight, linears[0].weight.float())


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_levels_train_a_transformers_llama(te_accelerator, level):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    accelerator = te_accelerator("current", opt_level=level)
    model = transformers.LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    inner = accelerator.unwrap_model(model)
    converted = accelerator.precision_plan.converted
    assert {d.kind for d in converted} == {"linear", "rmsnorm"}
    linears = [m for m in inner.modules()
               if type(m).__name__ == "Linear" and type(m).__module__ == "lowprec.backends.te.modules"]
    assert len(linears) == sum(d.kind == "linear" for d in converted)
    assert all(m.weight.dtype == torch.float16 for m in linears)
    assert all(m.weight.dtype == torch.float32 for m in inner.modules() if type(m).__name__ == "RMSNorm")
    tokens = (torch.randint(0, 128, (8, 1)) + torch.arange(16)) % 128  # each token the previous plus one
    losses = []
    for _ in range(25):
        loss = model(input_ids=tokens, labels=tokens).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.6 * losses[0], losses


def test_eval_in_fp8_when_asked(te_accelerator):
    accelerator = te_accelerator("current", use_autocast_during_eval=True)
    model = accelerator.prepare(small_model())
    model.eval()
    with torch.no_grad():
        model(torch.randn(4, 32))
    assert fake.autocast_calls[-1]["enabled"] is True
    assert accelerator.unwrap_model(model)[0].fp8


def test_prepare_with_compile_and_delayed_scaling_is_an_error(te_accelerator):
    from accelerate.utils import TorchDynamoPlugin

    # refused when the Accelerator is built, before any model exists
    with pytest.raises(ValueError, match="recipe='current'"):
        te_accelerator("delayed", dynamo_plugin=TorchDynamoPlugin(backend="inductor"))


def test_te_without_a_recipe_under_compile_trains_with_current_scaling(te_accelerator):
    from accelerate.utils import TorchDynamoPlugin

    accelerator = te_accelerator(None, gpu=H100, dynamo_plugin=TorchDynamoPlugin(backend="inductor"))
    accelerator.prepare(small_model())
    assert accelerator.precision_plan.recipe == "current"


def test_a_compiled_d2048_model_under_te_speed_rules_is_the_plain_model(te_accelerator):
    from accelerate.utils import TorchDynamoPlugin

    accelerator = te_accelerator(None, gpu=H100, skip_slow_shapes=True,
                                 dynamo_plugin=TorchDynamoPlugin(backend="aot_eager"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 2048), nn.LayerNorm(2048), nn.Linear(2048, 2048))
    reference = copy.deepcopy(model)
    prepared = accelerator.prepare(model)
    plan = accelerator.precision_plan
    assert not plan.converted and {d.rule for d in plan.modules} == {"skip_slow_shapes"}
    inner = accelerator.unwrap_model(prepared, keep_torch_compile=False)
    assert [type(m) for m in inner] == [nn.Linear, nn.LayerNorm, nn.Linear]  # nothing of TE's
    calls = len(fake.autocast_calls)
    x = torch.randn(8, 256)
    torch.testing.assert_close(prepared(x).float(), reference(x), rtol=2e-2, atol=2e-2)  # BF16 autocast
    assert len(fake.autocast_calls) == calls


def test_prepare_mxfp8_on_hopper_is_an_error(te_accelerator):
    with pytest.raises(BackendUnavailableError, match="recipe 'mxfp8' needs sm_100"):
        te_accelerator("mxfp8", gpu=H100)


def test_saved_model_loads_into_the_plain_model(te_accelerator, tmp_path):
    from safetensors.torch import load_file

    accelerator = te_accelerator("delayed")
    model = accelerator.prepare(small_model())
    inner = accelerator.unwrap_model(model)
    for m in inner.modules():
        if hasattr(m, "fp8_meta") and hasattr(m, "in_features"):
            fake.fill_delayed_state(m, fake.DelayedScaling(amax_history_len=8))
    extra = [k for k, v in inner.state_dict().items() if k.endswith("._extra_state")]
    assert extra == ["0._extra_state", "2._extra_state", "3._extra_state", "4._extra_state"]

    portable = accelerator.get_state_dict(model)
    assert not any(k.endswith("_extra_state") for k in portable)
    accelerator.save_model(model, str(tmp_path / "m"))
    plain = small_model(seed=3)
    plain.load_state_dict(load_file(str(tmp_path / "m" / "model.safetensors")), strict=True)
    for name, tensor in plain.state_dict().items():
        torch.testing.assert_close(tensor, inner.state_dict()[name])


def test_save_state_and_load_state_restore_scales_without_pickle(te_accelerator, tmp_path):
    def setup(seed):
        accelerator = te_accelerator("delayed", amax_history_len=8)
        model = accelerator.prepare(small_model(seed))
        inner = accelerator.unwrap_model(model)
        accelerator.prepare(torch.optim.AdamW(inner.parameters(), lr=1e-2))
        linears = [m for m in inner.modules() if type(m).__name__ == "Linear" and hasattr(m, "fp8_meta")]
        return accelerator, inner, linears

    accelerator, model, linears = setup(0)
    for i, m in enumerate(linears):
        fake.fill_delayed_state(m, fake.DelayedScaling(margin=1, amax_history_len=8), seed=i)
    saved = [m.fp8_meta["scaling_fwd"].scale.clone() for m in linears]
    saved_history = [m.fp8_meta["scaling_bwd"].amax_history.clone() for m in linears]
    weights = {k: v.clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    accelerator.save_state(str(tmp_path / "ckpt"))

    accelerator, model, linears = setup(1)
    assert not any("scaling_fwd" in m.fp8_meta for m in linears)

    def refuse(*_a, **_k):
        raise AssertionError("extra state was unpickled")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pickle, "loads", refuse)
        accelerator.load_state(str(tmp_path / "ckpt"))
    assert len(linears) == 3
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())
    for m, scale, history in zip(linears, saved, saved_history, strict=True):
        assert torch.equal(m.fp8_meta["scaling_fwd"].scale, scale)
        assert torch.equal(m.fp8_meta["scaling_bwd"].amax_history, history)
        assert m.fp8_meta["recipe"] == fake.DelayedScaling(margin=1, amax_history_len=8)
        assert m.te_format_payloads == []  # lowprec's own format: nothing went through TE's pickle path


def test_tied_weights_survive_conversion(te_accelerator):
    accelerator = te_accelerator("current")
    torch.manual_seed(0)
    model = nn.ModuleDict({"embed": nn.Embedding(64, 32), "body": nn.Linear(32, 32),
                           "lm_head": nn.Linear(32, 64, bias=False)})
    model.lm_head.weight = model.embed.weight
    inner = accelerator.unwrap_model(accelerator.prepare(model))
    assert type(inner.body).__module__ == "lowprec.backends.te.modules"
    lm_head = next(d for d in accelerator.precision_plan.modules if d.fqn == "lm_head")
    # TE builds new parameters, so converting the head would untie it: it stays, and the plan says why
    assert not lm_head.convert and lm_head.reason.startswith("weight shared with 'embed'")
    assert type(inner.lm_head) is nn.Linear and inner.lm_head.weight is inner.embed.weight


def test_optimizer_prepared_in_a_later_call_updates_the_converted_weights(te_accelerator):
    # issue 16: TE conversion makes new Parameters; an optimizer prepared on its own afterwards kept
    # updating the discarded ones, silently
    accelerator = te_accelerator("current")
    model = small_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model = accelerator.prepare(model)
    optimizer = accelerator.prepare(optimizer)
    inner = accelerator.unwrap_model(model)
    live = {id(p) for p in inner.parameters()}
    assert all(id(p) in live for group in optimizer.param_groups for p in group["params"])
    before = [p.detach().clone() for p in inner.parameters()]
    for p in inner.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, inner.parameters()))


def test_a_state_dict_saved_before_fp8_ran_loads_after(te_accelerator):
    # TE's _extra_state is a blob whose length follows its contents (empty before the first FP8 forward): torch
    # hands it to set_extra_state, and lowprec's check of the checkpoint's shapes leaves it alone
    accelerator = te_accelerator("delayed", amax_history_len=8)
    inner = accelerator.unwrap_model(accelerator.prepare(small_model(0)))
    early = {k: v.clone() for k, v in inner.state_dict().items()}
    for i, module in enumerate(m for m in inner.modules() if type(m).__name__ == "Linear" and hasattr(m, "fp8_meta")):
        fake.fill_delayed_state(module, fake.DelayedScaling(margin=1, amax_history_len=8), seed=i)
    assert any(v.numel() != early[k].numel() for k, v in inner.state_dict().items() if k.endswith("_extra_state"))
    inner.load_state_dict(early)


@pytest.mark.parametrize("fields", [{}, {"opt_level": "O2"}, {"weight_grad_dtype": "bf16"},
                                    {"optimizer_in_backward": True}, {"activation_dtype": "fp8"}],
                         ids=["default", "O2", "bf16 grad store", "in backward", "act8"])
def test_a_finished_te_run_leaves_no_parameter_and_no_optimizer_alive(te_accelerator, fields):
    # what tests/runtime/test_released.py checks of the other backends: a weight hook holding its gradient store
    # kept te's O1/O2 models alive after their run until 2026-11-29
    import gc
    import weakref

    def run():
        accelerator = te_accelerator("current", **fields)
        model = small_model()
        model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        for _ in range(2):
            accelerator.backward(model(torch.randn(8, 32)).float().square().mean())
            optimizer.step()
            optimizer.zero_grad()
        assert optimizer.optimizer.state
        return [weakref.ref(p) for p in model.parameters()] + [weakref.ref(optimizer.optimizer)]

    refs = run()
    gc.collect()
    assert [type(r()).__name__ for r in refs if r() is not None] == []
