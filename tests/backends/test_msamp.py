"""lowprec.Accelerator with backend="msamp" (MS-AMP levels O1/O2, native) on CPU, where FP8 is emulated.

What this covers: the precision plan (level, formats, bytes per parameter) against what prepare()
actually builds; training an MLP and a tiny Llama against FP32; the optimizer swap to LowBitAdam(W);
clip_grad_norm_ over the FP8 weight gradients; gradient accumulation; checkpoints (save_state /
load_state, get_state_dict into the plain model); and the errors for what cannot be honoured.

Reference points: DESIGN.md's precision table (O1: FP16 weight, FP8 grad, FP32+FP32 states = 11
bytes/param; O2: FP8+FP16 states = 6) and reference/msamp.md §2 (msamp.initialize semantics).
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from accelerate.state import AcceleratorState, GradientState
from torch import nn

from lowprec import Accelerator, BackendUnavailableError, FP8RecipeKwargs, RunContext, build_plan
from lowprec.backends import create_backend
from lowprec.backends.msamp.linear import FP8Linear
from lowprec.optim import LowBitAdam, LowBitAdamW
from lowprec.planning.hardware import device_info

pytestmark = pytest.mark.filterwarnings("ignore:lowprec. msamp runs emulated")

CPU = RunContext(device=device_info("cpu"))
WEIGHT_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# DESIGN.md / reference/msamp.md §2: the optimizer-state dtypes msamp.initialize sets per level.
STATE_DTYPES = {"O1": (torch.float32, torch.float32), "O2": (torch.float8_e4m3fn, torch.float16)}
LEVEL_COMBOS = [("O1", "fp16"), ("O1", "bf16"), ("O2", "fp16"), ("O2", "bf16")]


def sqnr(reference: torch.Tensor, value: torch.Tensor) -> float:
    reference, value = reference.detach().float(), value.detach().float()
    return (20 * torch.log10(reference.norm() / (reference - value).norm())).item()


def make_accelerator(level: str | None = "O2", *, gas: int = 1, **recipe) -> Accelerator:
    """A fresh Accelerator (Accelerate's state is process-wide, so reset it first)."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    recipe.setdefault("skip_first_last", False)
    recipe.setdefault("skip_slow_shapes", False)
    return Accelerator(mixed_precision="fp8", gradient_accumulation_steps=gas,
                       kwargs_handlers=[FP8RecipeKwargs(backend="msamp", opt_level=level, **recipe)])


def mlp(seed: int = 0, bias: bool = True) -> nn.Sequential:
    """Three FP8-eligible Linear layers and a LayerNorm (a parameter that stays high precision)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64, bias=bias), nn.GELU(), nn.Linear(64, 64, bias=bias), nn.LayerNorm(64),
                         nn.Linear(64, 16, bias=bias))


def data(n: int = 64, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 32, generator=g), torch.randn(n, 16, generator=g)


def mse(model, x, y):
    return nn.functional.mse_loss(model(x).float(), y)


def fp8_layers(model: nn.Module) -> list[FP8Linear]:
    return [m for m in model.modules() if isinstance(m, FP8Linear)]


def all_grads(model: nn.Module) -> list[torch.Tensor]:
    """Every gradient as its true value: FP8 weight gradients dequantised, the rest from .grad."""
    fp8_weights = {id(m.weight): m for m in fp8_layers(model)}
    out = []
    for p in model.parameters():
        layer = fp8_weights.get(id(p))
        grad = layer.weight_grad() if layer is not None else p.grad
        if grad is not None:
            out.append(grad.float())
    return out


def total_norm(grads, norm_type: float) -> float:
    flat = torch.cat([g.reshape(-1) for g in grads])
    return torch.linalg.vector_norm(flat, norm_type).item()


def measured_bytes_per_param(model: nn.Module, optimizer) -> float:
    """Bytes of weight + gradient + Adam moments per parameter, read off the built objects."""
    inner = getattr(optimizer, "optimizer", optimizer)
    total = count = 0
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            count += p.numel()
            total += p.numel() * p.element_size()
            grad = module.fp8_grad_data if isinstance(module, FP8Linear) and name == "weight" else p.grad
            total += grad.numel() * grad.element_size()
            state = inner.state[p]
            total += sum(state[k].numel() * state[k].element_size() for k in ("exp_avg", "exp_avg_sq"))
    return total / count


# ---- the plan and what prepare() builds ----------------------------------------------------------


@pytest.mark.parametrize("level", [None, "O1", "O2"])
@pytest.mark.parametrize("weight_dtype", ["fp16", "bf16"])
def test_plan_matches_what_prepare_builds(fresh_accelerate_state, level, weight_dtype):
    accelerator = make_accelerator(level, weight_dtype=weight_dtype)
    model = mlp()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    plan = accelerator.precision_plan
    assert (plan.backend, plan.recipe, plan.fp8_format) == ("msamp", "delayed", "HYBRID")
    # None resolves to a concrete level (the backend's default); the plan must name the one in force.
    assert plan.opt_level in ("O1", "O2") if level is None else plan.opt_level == level
    assert plan.options["opt_level"] == plan.opt_level
    assert plan.options["amax_history_len"] == 16  # MS-AMP's window for inputs and output gradients
    assert plan.options["weight_dtype"] == weight_dtype

    # DESIGN.md's row for the level: FP8 GEMM, 16-bit weight, no master weight, FP8 weight grad.
    wname = {"fp16": "FP16", "bf16": "BF16"}[weight_dtype]
    assert plan.tensor("gemm").dtype.startswith("FP8")
    assert plan.tensor("weight").dtype.startswith(wname)
    assert plan.tensor("master_weight").dtype == "N/A"
    assert plan.tensor("weight_grad").dtype.startswith("FP8 E4M3")
    assert plan.tensor("optimizer_states").dtype == {"O1": "FP32+FP32", "O2": "FP8 E4M3+FP16"}[plan.opt_level]

    inner = accelerator.unwrap_model(model)
    assert [d.fqn for d in plan.converted] == ["0", "2", "4"]
    assert all(isinstance(inner[int(d.fqn)], FP8Linear) for d in plan.converted)
    assert all(inner[int(d.fqn)].weight.dtype == WEIGHT_DTYPES[weight_dtype] for d in plan.converted)
    assert inner[3].weight.dtype == torch.float32  # LayerNorm untouched

    inner_opt = optimizer.optimizer
    assert type(inner_opt) is LowBitAdamW
    params = {id(p) for g in inner_opt.param_groups for p in g["params"]}
    assert params == {id(p) for p in inner.parameters()}  # remapped onto the new FP8Linear weights
    x, y = data()
    accelerator.backward(mse(model, x, y))
    optimizer.step()
    m_dtype, v_dtype = STATE_DTYPES[plan.opt_level]
    for p in inner.parameters():  # MS-AMP: the level's dtypes for every parameter, not only FP8 weights
        state = inner_opt.state[p]
        assert (state["exp_avg"].dtype, state["exp_avg_sq"].dtype) == (m_dtype, v_dtype)


@pytest.mark.parametrize("level,expected", [("O1", 11.0), ("O2", 6.0)])
def test_bytes_per_param_of_an_all_fp8_model_is_the_design_table(fresh_accelerate_state, level, expected):
    """Only FP8 Linear weights: O1 = 2 (FP16 weight) + 1 (FP8 grad) + 4 + 4; O2 = 2 + 1 + 1 + 2."""
    model = nn.Sequential(nn.Linear(32, 64, bias=False), nn.Linear(64, 16, bias=False))
    recipe = FP8RecipeKwargs(backend="msamp", opt_level=level, skip_first_last=False, skip_slow_shapes=False)
    assert build_plan(model, recipe, context=CPU).model_state_bytes_per_param == expected

    accelerator = make_accelerator(level)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    accelerator.backward(model(torch.randn(16, 32)).float().square().mean())
    optimizer.step()
    assert measured_bytes_per_param(accelerator.unwrap_model(model), optimizer) == expected


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_planned_bytes_per_param_match_the_built_model_with_biases(fresh_accelerate_state, level):
    accelerator = make_accelerator(level)
    model = mlp()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    x, y = data()
    accelerator.backward(mse(model, x, y))
    optimizer.step()
    measured = measured_bytes_per_param(accelerator.unwrap_model(model), optimizer)
    assert measured == pytest.approx(accelerator.precision_plan.model_state_bytes_per_param, rel=1e-6)


def test_adam_becomes_low_bit_adam_with_hyper_parameters(fresh_accelerate_state):
    accelerator = make_accelerator("O2")
    model = mlp()
    groups = [{"params": [p for p in model.parameters() if p.ndim == 2], "weight_decay": 0.1},
              {"params": [p for p in model.parameters() if p.ndim == 1], "weight_decay": 0.0}]
    model, optimizer = accelerator.prepare(model, torch.optim.Adam(groups, lr=2e-3, betas=(0.8, 0.99), eps=1e-6))
    inner_opt = optimizer.optimizer
    assert type(inner_opt) is LowBitAdam  # Adam (L2) stays Adam, not AdamW
    assert [g["weight_decay"] for g in inner_opt.param_groups] == [0.1, 0.0]
    assert all(g["lr"] == 2e-3 and g["betas"] == (0.8, 0.99) and g["eps"] == 1e-6 for g in inner_opt.param_groups)


# ---- training ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("level,weight_dtype", LEVEL_COMBOS)
def test_mlp_trains_close_to_fp32(fresh_accelerate_state, level, weight_dtype):
    x, y = data()
    steps, lr = 60, 3e-3
    reference = mlp()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=lr)
    ref_losses = []
    for _ in range(steps):
        loss = mse(reference, x, y)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())

    accelerator = make_accelerator(level, weight_dtype=weight_dtype)
    model = mlp()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=lr))
    losses = []
    for _ in range(steps):
        loss = mse(model, x, y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert abs(losses[0] - ref_losses[0]) < 0.02 * ref_losses[0]  # same model, FP8 forward
    assert losses[-1] < 0.15 * losses[0]
    # FP8 GEMMs, 16-bit weights without masters and (O2) FP8/FP16 moments cost some accuracy, not training.
    assert losses[-1] < 1.35 * ref_losses[-1] + 0.01, (losses[-1], ref_losses[-1])
    assert all(math.isfinite(v) for v in losses)


@pytest.mark.parametrize("level,weight_dtype", LEVEL_COMBOS)
def test_tiny_llama_trains_close_to_fp32(fresh_accelerate_state, level, weight_dtype):
    transformers = pytest.importorskip("transformers")

    def llama():
        torch.manual_seed(0)
        config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                          max_position_embeddings=64, tie_word_embeddings=False)
        return transformers.LlamaForCausalLM(config)

    ids = torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(0))
    steps, lr = 30, 3e-3
    reference = llama()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=lr)
    for _ in range(steps):
        ref_loss = reference(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        ref_opt.step()
        ref_opt.zero_grad()

    accelerator = make_accelerator(level, weight_dtype=weight_dtype)
    model = llama()
    n_linear = sum(isinstance(m, nn.Linear) for m in model.modules())
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=lr))
    assert len(fp8_layers(model)) == n_linear == 15  # q,k,v,o,gate,up,down x 2 layers + lm_head
    assert not accelerator.precision_plan.skipped
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.2 * losses[0]
    assert losses[-1] < 1.35 * ref_loss.item() + 0.05, (losses[-1], ref_loss.item())


# ---- clipping -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_clip_grad_norm_returns_the_true_total_norm(fresh_accelerate_state, norm_type, level):
    x, y = data()
    reference = mlp()
    mse(reference, x, y).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9, norm_type).item()

    accelerator = make_accelerator(level)
    model = mlp()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    accelerator.backward(mse(model, x, y))
    inner = accelerator.unwrap_model(model)
    direct = total_norm(all_grads(inner), norm_type)
    norm = accelerator.clip_grad_norm_(model.parameters(), 1e9, norm_type)
    # The true (dequantised) norm of what is stored, FP8 weight grads included ...
    assert norm.item() == pytest.approx(direct, rel=1e-5)
    # ... and within FP8 error of the FP32 model's norm (measured: ~1%).
    assert norm.item() == pytest.approx(ref_norm, rel=0.05)
    # A max_norm above the norm changes nothing.
    assert total_norm(all_grads(inner), norm_type) == pytest.approx(direct, rel=1e-6)


def test_clipping_limits_what_the_optimizer_sees(fresh_accelerate_state):
    x, y = data()
    accelerator = make_accelerator("O1")  # FP32 moments: exp_avg after step 1 is exactly (1 - beta1) * grad
    model = mlp()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    inner = accelerator.unwrap_model(model)
    accelerator.backward(mse(model, x, y))
    before = [g.clone() for g in all_grads(inner)]
    norm = accelerator.clip_grad_norm_(model.parameters(), 1e9).item()
    max_norm = norm / 10
    # a max_norm above the norm changes nothing; then clip with the real limit
    assert total_norm(all_grads(inner), 2) == pytest.approx(norm, rel=1e-6)
    returned = accelerator.clip_grad_norm_(model.parameters(), max_norm).item()
    assert returned == pytest.approx(norm, rel=1e-6)  # the norm before clipping, as torch returns it
    after = all_grads(inner)
    assert total_norm(after, 2) == pytest.approx(max_norm, rel=1e-4)
    for b, a in zip(before, after):  # one common factor for FP8 and .grad gradients alike
        torch.testing.assert_close(a, b * (max_norm / norm), rtol=1e-4, atol=1e-9)

    optimizer.step()
    beta1 = optimizer.optimizer.param_groups[0]["betas"][0]
    moments = [optimizer.optimizer.state[p]["exp_avg"] / (1 - beta1) for p in inner.parameters()]
    assert total_norm(moments, 2) == pytest.approx(max_norm, rel=1e-4)


def test_frozen_linear_stays_out_of_the_gradient_norm(fresh_accelerate_state):
    x, y = data()
    reference = mlp()
    reference[0].weight.requires_grad_(False)
    mse(reference, x, y).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9).item()

    accelerator = make_accelerator("O1")
    model = mlp()
    model[0].weight.requires_grad_(False)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad]))
    accelerator.backward(mse(model, x, y))
    norm = accelerator.clip_grad_norm_(model.parameters(), 1e9).item()
    assert norm == pytest.approx(ref_norm, rel=0.02)


# ---- gradient accumulation -------------------------------------------------------------------------


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_accumulate_matches_a_four_times_larger_batch(fresh_accelerate_state, level):
    x, y = data(256)
    steps = 3

    big = make_accelerator(level)
    model_b = mlp()
    model_b, opt_b = big.prepare(model_b, torch.optim.AdamW(model_b.parameters(), lr=3e-3))
    inner_b = big.unwrap_model(model_b)
    big_losses, big_grads = [], []
    for _ in range(steps):
        loss = mse(model_b, x, y)
        big.backward(loss)
        big_grads.append([g.clone() for g in all_grads(inner_b)])
        opt_b.step()
        opt_b.zero_grad()
        big_losses.append(loss.item())

    acc = make_accelerator(level, gas=4)  # a new Accelerator resets the shared GradientState: run after `big`
    model = mlp()
    model, optimizer = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=3e-3))
    inner = acc.unwrap_model(model)
    for s in range(steps):
        loss_sum = 0.0
        for k in range(4):
            with acc.accumulate(model):
                weights = [p.detach().clone() for p in inner.parameters()]
                loss = mse(model, x[64 * k:64 * (k + 1)], y[64 * k:64 * (k + 1)])
                acc.backward(loss)  # Accelerate divides by gradient_accumulation_steps: mean over the big batch
                loss_sum += loss.item()
                if k == 3:
                    grads = [g.clone() for g in all_grads(inner)]
                optimizer.step()
                optimizer.zero_grad()
                if k < 3:  # no step and no zero_grad inside the window: FP8 gradients keep accumulating
                    assert all(torch.equal(a, b) for a, b in zip(weights, inner.parameters())), (s, k)
        # one delayed-scaling update per optimizer step, not per micro-batch
        assert all(int(layer.fp8_meta_steps) == s + 1 for layer in fp8_layers(inner))
        assert loss_sum / 4 == pytest.approx(big_losses[s], rel=2e-3)
        for g_acc, g_big in zip(grads, big_grads[s]):
            assert sqnr(g_big, g_acc) > 18, s  # different micro-batch scales and roundings: FP8-level agreement
    for p_acc, p_big in zip(inner.parameters(), inner_b.parameters()):
        assert sqnr(p_big, p_acc) > 30


# ---- checkpoints ---------------------------------------------------------------------------------------


def _train(accelerator, model, optimizer, steps, start=0):
    x, y = data()
    losses = []
    for i in range(start, start + steps):
        loss = mse(model, x * (1 + i % 3), y)  # varying magnitudes, so the amax windows matter
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("level,weight_dtype", LEVEL_COMBOS)
def test_save_state_load_state_resumes_the_model_exactly(fresh_accelerate_state, tmp_path, level, weight_dtype):
    """Bit-exact: CPU is deterministic and the checkpoint holds the 16-bit weights and every FP8 scaling
    buffer as they are, so the next forward is the same computation. Window 4, so the delayed (not
    in-time) scales are in use when saving."""
    kwargs = dict(weight_dtype=weight_dtype, amax_history_len=4)
    accelerator = make_accelerator(level, **kwargs)
    model = mlp()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=3e-3))
    _train(accelerator, model, optimizer, 6)
    accelerator.save_state(str(tmp_path))
    saved = {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    next_loss = _train(accelerator, model, optimizer, 1, start=6)

    resumed = make_accelerator(level, **kwargs)
    model2 = mlp(seed=5)
    model2, optimizer2 = resumed.prepare(model2, torch.optim.AdamW(model2.parameters(), lr=3e-3))
    resumed.load_state(str(tmp_path))
    inner2 = resumed.unwrap_model(model2)
    state2 = inner2.state_dict()
    assert set(state2) == set(saved)
    for key, value in saved.items():
        assert torch.equal(state2[key], value), key
    assert all(not layer.in_time() for layer in fp8_layers(inner2))
    assert _train(resumed, model2, optimizer2, 1, start=6) == next_loss


@pytest.mark.parametrize("level,weight_dtype", LEVEL_COMBOS)
def test_save_state_load_state_restores_the_optimizer_exactly(fresh_accelerate_state, tmp_path, level,
                                                               weight_dtype):
    kwargs = dict(weight_dtype=weight_dtype, amax_history_len=4)
    accelerator = make_accelerator(level, **kwargs)
    model = mlp()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=3e-3))
    _train(accelerator, model, optimizer, 6)
    accelerator.save_state(str(tmp_path))
    saved = copy.deepcopy(optimizer.optimizer.state_dict())
    continued = _train(accelerator, model, optimizer, 3, start=6)

    resumed = make_accelerator(level, **kwargs)
    model2 = mlp(seed=5)
    model2, optimizer2 = resumed.prepare(model2, torch.optim.AdamW(model2.parameters(), lr=3e-3))
    resumed.load_state(str(tmp_path))
    loaded = optimizer2.optimizer.state_dict()
    for index, state in saved["state"].items():
        for key, value in state.items():
            assert value.dtype == loaded["state"][index][key].dtype, (index, key)
            assert torch.equal(value, loaded["state"][index][key]), (index, key)
    assert _train(resumed, model2, optimizer2, 3, start=6) == continued


@pytest.mark.parametrize("weight_dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
def test_get_state_dict_loads_into_the_plain_model(fresh_accelerate_state, weight_dtype, model_dtype):
    original = mlp().to(model_dtype)
    accelerator = make_accelerator("O2", weight_dtype=weight_dtype)
    model = copy.deepcopy(original)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    x, y = data()
    x = x.to(model_dtype)
    _train(accelerator, model, optimizer, 2)

    portable = accelerator.get_state_dict(model)  # unwrap=True: what save_model writes
    plain = mlp(seed=9).to(model_dtype)
    assert set(portable) == set(plain.state_dict())  # no fp8_meta_* buffers
    assert {k: v.dtype for k, v in portable.items()} == {k: v.dtype for k, v in original.state_dict().items()}
    plain.load_state_dict(portable, strict=True)
    inner = accelerator.unwrap_model(model)
    for layer_index in (0, 2, 4):
        expected = inner[layer_index].weight.detach().to(model_dtype)
        assert torch.equal(plain[layer_index].weight, expected)
    assert not torch.equal(plain[0].weight, original[0].weight)  # it is the trained weight
    with torch.no_grad():
        y_plain, y_fp8 = plain(x), inner(x)
    assert sqnr(y_plain, y_fp8) > 20  # the same network, FP8 GEMMs vs high precision


def test_root_linear_is_converted_and_exported(fresh_accelerate_state):
    accelerator = make_accelerator("O1")
    model = nn.Linear(32, 16)
    reference = copy.deepcopy(model)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    assert isinstance(accelerator.unwrap_model(model), FP8Linear)
    accelerator.backward(model(torch.randn(8, 32)).float().square().mean())
    optimizer.step()
    portable = accelerator.get_state_dict(model)
    reference.load_state_dict(portable, strict=True)
    assert portable["weight"].dtype == torch.float32


# ---- prepare() paths and errors --------------------------------------------------------------------


def test_model_prepared_without_optimizer_warns_and_a_later_optimizer_works(fresh_accelerate_state, monkeypatch):
    monkeypatch.setattr("lowprec.runtime.notices._warned", set())  # the warning is once per process
    accelerator = make_accelerator("O2")
    with pytest.warns(UserWarning, match="optimizer"):
        model = accelerator.prepare(mlp())
    inner = accelerator.unwrap_model(model)
    optimizer = accelerator.prepare(torch.optim.AdamW(inner.parameters(), lr=1e-2))
    assert type(optimizer.optimizer) is LowBitAdamW
    before = inner[0].weight.detach().clone()
    x, y = data()
    accelerator.backward(mse(model, x, y))
    optimizer.step()
    assert not torch.equal(inner[0].weight, before)  # the FP8 weight gradient reached the optimizer
    assert all(int(layer.fp8_meta_steps) == 1 for layer in fp8_layers(inner))  # post-step hook installed


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
def test_lr_scheduler_drives_the_replacement_optimizer(fresh_accelerate_state):
    accelerator = make_accelerator("O1")
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    x, y = data()
    accelerator.backward(mse(model, x, y))
    optimizer.step()
    scheduler.step()
    assert optimizer.optimizer.param_groups[0]["lr"] == pytest.approx(5e-3)


def test_lr_scheduler_built_before_prepare_does_not_warn(fresh_accelerate_state):
    accelerator = make_accelerator("O1")
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    x, y = data()
    accelerator.backward(mse(model, x, y))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer.step()
        scheduler.step()
    assert not [w for w in caught if "overridden" in str(w.message)]


def test_sgd_is_refused_naming_what_to_use(fresh_accelerate_state):
    accelerator = make_accelerator("O1")
    model = mlp()
    with pytest.raises(ValueError, match=r"SGD") as info:
        accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert "torch.optim.AdamW" in str(info.value) and "torch.optim.Adam" in str(info.value)


def test_refused_optimizer_leaves_the_model_untouched(fresh_accelerate_state):
    accelerator = make_accelerator("O1")
    model = mlp()
    weight = model[0].weight.detach().clone()
    with pytest.raises(ValueError):
        accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert type(model[0]) is nn.Linear
    assert torch.equal(model[0].weight, weight)


def test_o3_on_one_process_is_refused_by_the_accelerator_naming_o2():
    with pytest.raises(BackendUnavailableError, match=r"opt_level='O3'.*runs under FSDP2.*opt_level='O2'"):
        Accelerator(kwargs_handlers=[FP8RecipeKwargs(backend="msamp", opt_level="O3")])


@pytest.mark.parametrize("value", ["fp8", "fp64", "int8"])
def test_bad_weight_dtype_lists_accepted_values(value):
    with pytest.raises(ValueError, match=r"weight_dtype=.*'fp32', 'fp16', 'bf16'"):
        FP8RecipeKwargs(backend="msamp", weight_dtype=value)


@pytest.mark.parametrize("alias,expected", [("bfloat16", "bf16"), ("half", "fp16"), (torch.float16, "fp16"),
                                            ("BF16", "bf16")])
def test_weight_dtype_aliases(alias, expected):
    assert FP8RecipeKwargs(backend="msamp", weight_dtype=alias).weight_dtype == expected


def test_weight_dtype_from_environment(fresh_accelerate_state, monkeypatch):
    monkeypatch.setenv("ACCELERATE_FP8_WEIGHT_DTYPE", "bf16")
    accelerator = make_accelerator("O1")
    model = mlp()
    model, _ = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    assert all(layer.weight.dtype == torch.bfloat16 for layer in fp8_layers(model))
    assert accelerator.precision_plan.tensor("weight").dtype.startswith("BF16")
    # an explicit argument wins over the environment
    assert FP8RecipeKwargs(backend="msamp", weight_dtype="fp16").weight_dtype == "fp16"

    monkeypatch.setenv("ACCELERATE_FP8_WEIGHT_DTYPE", "fp8")
    with pytest.raises(ValueError, match="ACCELERATE_FP8_WEIGHT_DTYPE"):
        FP8RecipeKwargs(backend="msamp")
    monkeypatch.setenv("ACCELERATE_FP8_WEIGHT_DTYPE", "bf16")
    assert FP8RecipeKwargs(backend="torchao").weight_dtype == "bf16"
    # a value the backend cannot honour names the variable it came from
    monkeypatch.setenv("ACCELERATE_FP8_WEIGHT_GRAD_DTYPE", "bf16")
    with pytest.raises(ValueError, match=r"weight_grad_dtype='bf16'.*ACCELERATE_FP8_WEIGHT_GRAD_DTYPE"):
        FP8RecipeKwargs(backend="msamp")


@pytest.mark.parametrize("engine", ["fsdp2", "deepspeed", "fsdp1"])
def test_sharded_engines_are_refused(engine):
    recipe = FP8RecipeKwargs(backend="msamp", opt_level="O2")
    with pytest.raises((BackendUnavailableError, ValueError), match=rf"{engine}.*not supported"):
        create_backend(recipe, RunContext(device=device_info("cpu"), engine=engine, world_size=2))
    backend = create_backend(recipe, RunContext(device=device_info("cpu"), engine="ddp", world_size=2))
    assert backend.opt_level == "O2"


def test_modules_that_do_not_fit_fp8_gemms_stay_high_precision(fresh_accelerate_state):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(30, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 10))
    reference = copy.deepcopy(model)
    accelerator = make_accelerator("O2")
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    plan = accelerator.precision_plan
    reasons = {d.fqn: d.reason for d in plan.skipped}
    assert set(reasons) == {"0", "4"}
    assert "in_features=30" in reasons["0"] and "16" in reasons["0"]
    assert "out_features=10" in reasons["4"] and "16" in reasons["4"]
    inner = accelerator.unwrap_model(model)
    assert type(inner[0]) is nn.Linear and type(inner[4]) is nn.Linear and isinstance(inner[2], FP8Linear)

    x, y = torch.randn(32, 30), torch.randn(32, 10)
    nn.functional.mse_loss(reference(x), y).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9).item()
    before = [p.detach().clone() for p in inner.parameters()]
    accelerator.backward(nn.functional.mse_loss(model(x).float(), y))
    assert accelerator.clip_grad_norm_(model.parameters(), 1e9).item() == pytest.approx(ref_norm, rel=0.05)
    optimizer.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, inner.parameters()))


def test_mha_projection_and_tied_head_are_not_converted(fresh_accelerate_state):
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(128, 64)
            self.attn = nn.MultiheadAttention(64, 4, batch_first=True)
            self.proj = nn.Linear(64, 64)
            self.head = nn.Linear(64, 128, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, ids):
            h = self.embed(ids)
            h = self.attn(h, h, h, need_weights=False)[0]
            return self.head(self.proj(h))

    accelerator = make_accelerator("O2")
    model = Tied()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    inner = accelerator.unwrap_model(model)
    plan = accelerator.precision_plan
    assert [d.fqn for d in plan.converted] == ["proj"]
    assert "shared" in {d.fqn: d.reason for d in plan.skipped}["head"]
    assert type(inner.attn.out_proj) is not FP8Linear
    assert inner.head.weight is inner.embed.weight  # still tied
    ids = torch.randint(0, 128, (2, 16))
    loss = nn.functional.cross_entropy(model(ids).float().reshape(-1, 128), ids.reshape(-1))
    accelerator.backward(loss)
    optimizer.step()
    assert inner.head.weight is inner.embed.weight


def test_model_zero_grad_clears_the_fp8_weight_gradients(fresh_accelerate_state):
    # Training loops that call model.zero_grad() (not optimizer.zero_grad()) must not accumulate
    # FP8 weight gradients across steps: the FP8 gradient is not a .grad that nn.Module clears.
    accelerator = make_accelerator("O2")
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    accelerator.backward(model(torch.randn(8, 64)).float().square().mean())
    inner = accelerator.unwrap_model(model)
    assert inner[0].weight_grad() is not None
    model.zero_grad()
    assert inner[0].weight_grad() is None and inner[2].weight_grad() is None


def test_plan_without_converted_layers_shows_no_fp8_weights():
    # every Linear kept (here by exclude): the rows must not claim FP16 weights or FP8 weight gradients
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
    recipe = FP8RecipeKwargs(backend="msamp", exclude=["0", "2"])
    plan = build_plan(model, recipe, context=RunContext(device=device_info("cpu")))
    rows = {t.kind: t.dtype for t in plan.tensors}
    assert not plan.converted
    assert (rows["gemm"], rows["weight"], rows["weight_grad"]) == ("FP32", "FP32", "FP32")
    assert rows["optimizer_states"] == "FP8 E4M3+FP16"  # the level's low-bit Adam still runs
    assert plan.bytes_per_param == {"weight": 4, "weight_grad": 4, "master_weight": 0, "optimizer_states": 3}


@pytest.mark.parametrize("engine,compiled,compile_fp8_layers,eager_layers", [
    ("single", False, None, False),  # layers compiled one by one: the plan says so instead
    ("single", False, False, True), ("single", True, None, False), ("ddp", False, None, False),
    ("ddp", False, False, True), ("ddp", True, None, False),
    ("fsdp2", False, None, True), ("fsdp2", False, False, True), ("fsdp2", False, True, False),  # O3: eager default
    ("fsdp2", True, None, False),  # compiled whole: nothing to say about the layers
])
def test_eager_fp8_layers_are_named_with_what_they_cost(engine, compiled, compile_fp8_layers, eager_layers):
    from lowprec import RunContext
    from lowprec.backends import create_backend
    from lowprec.backends.msamp import EAGER_LAYERS_NOTE, O3_FSDP2_EAGER_NOTE
    from lowprec.planning.hardware import assumed_device, device_info
    from lowprec.runtime.planner import build_plan

    level = "O3" if engine == "fsdp2" else "O2"
    note = O3_FSDP2_EAGER_NOTE if engine == "fsdp2" else EAGER_LAYERS_NOTE
    recipe = FP8RecipeKwargs(backend="msamp", opt_level=level, compile_fp8_layers=compile_fp8_layers)
    context = RunContext(device=assumed_device("9.0"), engine=engine, world_size=1 if engine == "single" else 2,
                         compiled=compiled)
    backend = create_backend(recipe, context, require_package=False)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4096, 4096), nn.Linear(4096, 4096))
    plan = build_plan(model, recipe, context=context, backend=backend)
    assert len(plan.converted) == 2
    assert (note in plan.notes) is eager_layers
    assert any("FP8 layers is compiled" in n for n in plan.notes) is not (eager_layers or compiled)
    assert not any("compile the model" in n and n != EAGER_LAYERS_NOTE for n in plan.notes)
    cpu = RunContext(device=device_info("cpu"), engine=engine, world_size=context.world_size, compiled=compiled)
    assert note not in build_plan(model, recipe, context=cpu).notes  # emulated: no speed to lose


# ---- reduce_amax -------------------------------------------------------------------------------------
@pytest.mark.parametrize("value,expected", [(None, True), (False, False)])
@pytest.mark.parametrize("engine,world_size", [("single", 1), ("ddp", 2), ("deepspeed", 2)])
def test_plan_says_whether_amaxes_are_reduced(value, expected, engine, world_size):
    """The option in force (None: on) is in the plan's options; with more than one rank the GEMM row says
    whether the delayed scales' amaxes are all-reduced or each rank's own."""
    level = "O3" if engine == "deepspeed" else "O2"
    recipe = FP8RecipeKwargs(backend="msamp", opt_level=level, reduce_amax=value)
    context = RunContext(device=device_info("cpu"), engine=engine, world_size=world_size)
    plan = build_plan(mlp(), recipe, context=context)
    assert plan.options["reduce_amax"] is expected
    scaling = plan.tensor("gemm").scaling
    reduced = "their amaxes all-reduced (MAX) across ranks once per step" in scaling
    own = "each rank's own amaxes (reduce_amax=False)" in scaling
    assert (reduced, own) == ((expected, not expected) if world_size > 1 else (False, False))


@pytest.mark.parametrize("engine,value,expected", [
    ("single", None, False), ("ddp", None, True), ("ddp", False, False), ("deepspeed", None, True),
    ("deepspeed", True, True)])
def test_amaxes_are_reduced_under_data_parallel_engines_only(engine, value, expected):
    """reduce_amax in force, and a data-parallel engine: a model prepared for one process never joins a
    collective, even where a process group exists (as a reference run on rank 0 of a job does)."""
    level = "O3" if engine == "deepspeed" else "O2"
    context = RunContext(device=device_info("cpu"), engine=engine, world_size=1 if engine == "single" else 2)
    backend = create_backend(FP8RecipeKwargs(backend="msamp", opt_level=level, reduce_amax=value), context)
    assert backend.reduce_amax is (value is not False)
    assert backend.amax_reduction is expected


@pytest.mark.parametrize("engine,reductions", [("single", 0), ("ddp", 1)])
def test_amaxes_are_reduced_once_per_step_before_the_scales_are_updated(monkeypatch, engine, reductions):
    """The post-step hook all-reduces every layer's amaxes in one call, before the scale update reads them,
    under DDP; a model prepared for one process makes no call, which on a rank of a process group the other
    ranks would never join (a hang, as a rank-0-only reference run in a two-rank job showed)."""
    from lowprec.backends.msamp import communication

    context = RunContext(device=device_info("cpu"), engine=engine, world_size=1 if engine == "single" else 2)
    backend = create_backend(FP8RecipeKwargs(backend="msamp", opt_level="O2", skip_first_last=False,
                                             skip_slow_shapes=False), context)
    model = mlp()
    model = backend.convert(model, build_plan(model, backend.recipe, context=context, backend=backend))
    calls = []
    monkeypatch.setattr(communication, "all_reduce_amaxes", lambda layers: calls.append(
        (list(layers), [layer.amax_history[:, 0].clone() for layer in layers])))
    hook = backend.post_optimizer_step(model)
    x, y = data()
    mse(model, x, y).backward()
    current = [layer.amax_history[:, 0].clone() for layer in fp8_layers(model)]
    hook()
    assert len(calls) == reductions
    if reductions:
        layers, seen = calls[0]
        assert layers == fp8_layers(model) and len(layers) == 3
        assert all(torch.equal(a, b) and (a > 0).all() for a, b in zip(seen, current))  # before the update


def _train_digest(accelerator, steps: int = 6) -> list[str]:
    """Per step: every parameter, FP8 weight gradient, scale and amax window, as exact bytes."""
    x, y = data()
    model = mlp()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=3e-3))
    out = []
    for _ in range(steps):
        accelerator.backward(mse(model, x, y))
        optimizer.step()
        tensors = [t for m in fp8_layers(model) for t in (m.amax_history, *m.scale_buffers(), m.fp8_grad_data)]
        out.append([t.detach().clone() for t in [*model.parameters(), *tensors]])
        optimizer.zero_grad()
    return out


def test_one_process_results_do_not_depend_on_reduce_amax(fresh_accelerate_state):
    """On one process the reduction is a no-op: training with reduce_amax on (the default) is bitwise the
    training with it off, which runs exactly the code of before the option existed. A window of 2 puts the
    delayed scales in use from step 2."""
    runs = [_train_digest(make_accelerator("O2", amax_history_len=2, reduce_amax=value)) for value in (None, False)]
    for step, (a, b) in enumerate(zip(*runs)):
        assert len(a) == len(b)
        assert all(torch.equal(p, q) for p, q in zip(a, b)), step


def _layers_with_stored_grads() -> list[FP8Linear]:
    """Two layers whose stored FP8 gradients are all 1 and all 2 (squared norms 256 and 1024), flagged present."""
    from lowprec.kernels.scaling import compute_scale, quantize

    layers = [FP8Linear(16, 16, emulate=True) for _ in range(2)]
    for i, layer in enumerate(layers):
        g = torch.full((16, 16), float(i + 1))
        scale = compute_scale(g.abs().amax(), torch.float8_e4m3fn)
        layer.fp8_grad_data.copy_(quantize(g, scale, torch.float8_e4m3fn))
        layer.fp8_grad_scale.copy_(scale)
        layer.fp8_grad_valid.fill_(1.0)
    return layers


@pytest.mark.parametrize("engine_norm, clipped", [(0.0, True), (torch.tensor(3.0), True), (None, True),
                                                  (torch.tensor(float("nan")), False), (float("inf"), False)])
def test_o3_under_zero_clips_by_the_norm_over_every_gradient_on_the_device(engine_norm, clipped):
    # ZeroFP8Weights._clip: the FP8 gradients' scales divided by max_norm / total, total over the FP8 gradients
    # and DeepSpeed's norm of the rest (a tensor stays a tensor: no host sync); a non-finite total clips nothing
    from lowprec.backends.msamp.zero import ZeroFP8Weights

    layers = _layers_with_stored_grads()
    before = [float(layer.fp8_grad_scale) for layer in layers]
    zero = ZeroFP8Weights.__new__(ZeroFP8Weights)
    zero.layers, zero.owners, zero.rank, zero.world_size, zero.group = layers, [0, 0], 0, 1, None
    zero._clip(1.0, 0.0 if engine_norm is None else engine_norm)
    own = math.sqrt(16 * 16 * (1 + 4))
    other = 0.0 if engine_norm is None else float(engine_norm)
    coef = 1.0 / (math.sqrt(own**2 + other**2) + 1e-6) if clipped else 1.0
    for layer, scale in zip(layers, before):
        assert float(layer.fp8_grad_scale) == pytest.approx(scale / coef, rel=1e-6)


def test_o3_under_zero_clips_by_the_owners_norms_summed_over_the_ranks(monkeypatch):
    # each layer's mean is on its owner only: a rank adds the squared norms of the layers it owns, and one
    # all-reduce (SUM) adds the other ranks' (here rank 1 owns layer 1, whose squared norm the fake collective adds)
    from lowprec.backends.msamp import zero as zero_module

    layers = _layers_with_stored_grads()
    # layers[1] is rank 1's: rank 0's copy of it (values 2, still flagged) must stay out of rank 0's sum
    reduced = []

    def all_reduce(tensor, op=None, group=None):
        reduced.append(float(tensor))
        tensor.add_(16 * 16 * 4.0)  # rank 1's owned layer: 256 values of 2

    monkeypatch.setattr(zero_module.dist, "all_reduce", all_reduce)
    before = float(layers[0].fp8_grad_scale)
    zero = zero_module.ZeroFP8Weights.__new__(zero_module.ZeroFP8Weights)
    zero.layers, zero.owners, zero.rank, zero.world_size, zero.group = layers, [0, 1], 0, 2, None
    zero._clip(1.0, 0.0)
    assert reduced == [16 * 16 * 1.0]  # rank 0 sent its own layer's squared norm only
    coef = 1.0 / (math.sqrt(16 * 16 * (1 + 4)) + 1e-6)
    assert float(layers[0].fp8_grad_scale) == pytest.approx(before / coef, rel=1e-6)
