"""`weight_dtype` / `weight_grad_dtype` and the levels O1/O2 over them, end to end through
`lowprec.Accelerator` on a small `transformers` Llama.

torchao (emulated on CPU) realises the knobs through the base adapter (weights cast in place,
gradients in `GradStore`s); msamp through its own FP8Linear. TE runs the base-adapter code too: its
levels test is in tests/backends/test_te_accelerator.py (it needs the TE stand-in). The reference for
"trains" is the same model and data with FP32 weights, gradients and states.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lowprec import Accelerator, BackendUnavailableError, FP8RecipeKwargs, RunContext, build_plan
from lowprec.backends import create_backend
from lowprec.optim import LowBitAdam, LowBitAdamW
from lowprec.planning.hardware import device_info
from lowprec.planning.plan import PlanMismatchError

pytest.importorskip("torchao")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")

BACKENDS = ["torchao", "msamp"]
LEVEL_STATES = {"O1": (torch.float32, torch.float32), "O2": (torch.float8_e4m3fn, torch.float16)}
VOCAB, SEQ = 128, 16


def reset():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def llama(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                      tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(config)


def batches(n: int = 8, batch: int = 4):
    g = torch.Generator().manual_seed(0)
    # a learnable sequence: each token is the previous one plus one
    start = torch.randint(0, VOCAB, (n * batch, 1), generator=g)
    tokens = (start + torch.arange(SEQ)) % VOCAB
    return list(tokens.split(batch))


def accelerator(accumulation: int = 1, **recipe) -> Accelerator:
    reset()
    recipe.setdefault("skip_first_last", False)
    recipe.setdefault("skip_slow_shapes", False)
    return Accelerator(mixed_precision="fp8", kwargs_handlers=[FP8RecipeKwargs(**recipe)],
                       gradient_accumulation_steps=accumulation)


def train(acc: Accelerator, steps: int = 24, clip: float | None = 1.0, optimizer=torch.optim.AdamW):
    model = llama()
    opt = optimizer(model.parameters(), lr=3e-3)
    model, opt = acc.prepare(model, opt)
    data = batches()
    losses = []
    for i in range(steps):
        tokens = data[i % len(data)]
        with acc.accumulate(model):
            loss = model(input_ids=tokens, labels=tokens).loss
            acc.backward(loss)
            if clip is not None and acc.sync_gradients:
                acc.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    return model, opt, losses


def linear_weights(acc: Accelerator, model: nn.Module) -> list[nn.Parameter]:
    backend = acc._lowprec[-1][1]
    return [m.weight for m in acc.unwrap_model(model).modules() if backend.converted_kind(m) == "linear"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_levels_train_a_llama_as_the_table_says(backend, level):
    acc = accelerator(backend=backend, opt_level=level)
    model, opt, losses = train(acc)
    weights = linear_weights(acc, model)
    assert weights and all(w.dtype == torch.float16 for w in weights)  # FP16 weights, no master copy
    assert all(w.grad is None for w in weights)  # weight gradients live in FP8, not in .grad
    base = opt.optimizer
    assert type(base) is LowBitAdamW
    state = base.state[weights[0]]
    assert (state["exp_avg"].dtype, state["exp_avg_sq"].dtype) == LEVEL_STATES[level]
    plan = acc.precision_plan
    assert plan.tensor("weight").dtype.startswith("FP16 (")
    assert plan.tensor("master_weight").dtype == "N/A"
    assert plan.tensor("weight_grad").dtype.startswith("FP8 E4M3 (")
    # the table's 11 (O1) and 6 (O2) bytes/param for the converted share; embeddings and norms stay FP32
    share = plan.fp8_param_share
    expected = share * (2 + 1) + (1 - share) * 8 + (8 if level == "O1" else 3)
    assert plan.model_state_bytes_per_param == pytest.approx(expected, rel=1e-6)
    assert sum(losses[-4:]) / 4 < 0.6 * sum(losses[:4]) / 4, losses


@pytest.mark.parametrize("recipe", [dict(backend="torchao", opt_level="O1"), dict(backend="torchao", opt_level="O2"),
                                    dict(backend="torchao", weight_grad_dtype="fp8"),
                                    dict(backend="msamp", opt_level="O1"), dict(backend="msamp", opt_level="O2")])
def test_a_frozen_linear_runs_in_fp8_without_a_gradient_store(recipe):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 16))
    model[2].requires_grad_(False)
    acc = accelerator(**recipe)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, opt = acc.prepare(model, opt)
    backend, plan = acc._lowprec[-1][1], acc.precision_plan
    frozen = model[2].weight.detach().clone()
    assert len(plan.converted) == 3 and backend.is_converted(model[2])  # its GEMMs still run in FP8
    assert {d.fqn: d.reason for d in plan.modules}["2"] == "FP8, frozen (requires_grad=False): no gradient to store"
    assert "frozen (requires_grad=False)" in str(plan)
    assert [s.weight for s in backend.grad_stores] == [model[0].weight, model[4].weight]
    if recipe["backend"] == "msamp":  # DDP broadcasts the frozen weight, never the layer's rank-local FP8 state
        ignored = model._ddp_params_and_buffers_to_ignore
        assert "2.weight" not in ignored and "2.fp8_meta_scale_input" in ignored and "0.weight" in ignored
    trained = model[0].weight.detach().clone()
    acc.backward(model(torch.randn(16, 32)).float().pow(2).mean())
    opt.step()
    assert torch.equal(model[2].weight, frozen) and model[2].weight.grad is None
    assert not torch.equal(model[0].weight, trained)


@pytest.mark.parametrize("backend", BACKENDS)
def test_levels_train_like_fp32(backend):
    _, _, fp32 = train(accelerator(backend="torchao"))
    _, _, o2 = train(accelerator(backend=backend, opt_level="O2"))
    # FP16 weights, FP8 gradients and FP8/FP16 states: the curve follows FP32's within 15% at the end
    assert abs(sum(o2[-4:]) - sum(fp32[-4:])) / sum(fp32[-4:]) < 0.15, (o2, fp32)


@pytest.mark.parametrize("knobs, weight, store", [
    (dict(weight_dtype="bf16"), torch.bfloat16, None),  # BF16 weights, BF16 gradients in .grad
    (dict(weight_grad_dtype="fp8"), torch.float32, torch.float8_e4m3fn),  # FP32 weights, FP8 gradients
    (dict(weight_dtype="fp16", weight_grad_dtype="bf16"), torch.float16, torch.bfloat16),
])
def test_each_knob_alone(knobs, weight, store):
    acc = accelerator(backend="torchao", **knobs)
    model, opt, losses = train(acc, steps=8)
    backend = acc._lowprec[-1][1]
    weights = linear_weights(acc, model)
    assert all(w.dtype == weight for w in weights)
    assert [s.dtype for s in backend.grad_stores] == [store] * len(weights) if store else not backend.grad_stores
    # FP32 update math of low-precision weights or gradients: lowprec's Adam with FP32 states
    assert type(opt.optimizer) is LowBitAdamW and opt.optimizer.param_groups[0]["exp_avg_dtype"] == torch.float32
    assert losses[-1] < losses[0]


def test_without_knobs_the_users_optimizer_and_grads_are_kept():
    acc = accelerator(backend="torchao")
    model, opt, _ = train(acc, steps=2)
    assert type(opt.optimizer) is torch.optim.AdamW
    assert not acc._lowprec[-1][1].grad_stores


def test_gradient_accumulation_sums_micro_batches():
    # two micro-batches per step against one step on both halves: same update direction
    acc = accelerator(backend="torchao", opt_level="O1", accumulation=2)
    model, opt, losses = train(acc, steps=16)
    backend = acc._lowprec[-1][1]
    assert all(store.fp8_grad_valid.item() == 0 for store in backend.grad_stores)  # cleared by zero_grad
    assert losses[-1] < losses[0]


def test_clipping_counts_the_stored_gradients():
    acc = accelerator(backend="torchao", opt_level="O2")
    model = llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    tokens = batches()[0]
    acc.backward(model(input_ids=tokens, labels=tokens).loss)
    stores = acc._lowprec[-1][1].grad_stores
    true = torch.linalg.vector_norm(torch.stack(
        [torch.linalg.vector_norm(p.grad) for p in model.parameters() if p.grad is not None]
        + [torch.linalg.vector_norm(s.grad()) for s in stores]))
    total = acc.clip_grad_norm_(model.parameters(), 1e-3)
    assert total.item() == pytest.approx(true.item(), rel=1e-5)
    after = torch.linalg.vector_norm(torch.stack(
        [torch.linalg.vector_norm(p.grad) for p in model.parameters() if p.grad is not None]
        + [torch.linalg.vector_norm(s.grad()) for s in stores]))
    assert after.item() == pytest.approx(1e-3, rel=1e-3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_save_state_load_state_resumes_bit_exactly(backend, tmp_path):
    def run(resume_from=None, save_to=None):
        acc = accelerator(backend=backend, opt_level="O2")
        model = llama()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        model, opt = acc.prepare(model, opt)
        data = batches()
        if resume_from:
            acc.load_state(resume_from)
        losses = []
        for i in range(4 if save_to else 8):
            tokens = data[i % len(data)] if not resume_from else data[(i + 4) % len(data)]
            loss = model(input_ids=tokens, labels=tokens).loss
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        if save_to:
            acc.save_state(save_to)
        return losses

    straight = run()
    run(save_to=tmp_path / "ckpt")
    resumed = run(resume_from=tmp_path / "ckpt")
    assert resumed[:4] == straight[4:8]


@pytest.mark.parametrize("backend", BACKENDS)
def test_state_dict_loads_into_the_plain_model(backend):
    acc = accelerator(backend=backend, opt_level="O1")
    model, _, _ = train(acc, steps=4)
    state = acc.get_state_dict(model, unwrap=True)
    plain = llama(seed=1)
    plain.load_state_dict(state)  # strict: no FP8 or store entries, every key present
    assert all(state[k].dtype == v.dtype for k, v in plain.state_dict().items())  # back in FP32
    trained = [w.float() for w in linear_weights(acc, model)]
    plain_linears = [m.weight for n, m in plain.named_modules() if isinstance(m, nn.Linear)]
    assert all(torch.equal(a, b) for a, b in zip(trained, plain_linears))


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_an_optimizer_low_bit_adam_cannot_replace_is_refused(level):
    acc = accelerator(backend="torchao", opt_level=level)
    with pytest.raises(ValueError, match="pass torch.optim.Adam or torch.optim.AdamW.*got SGD"):
        train(acc, optimizer=lambda p, lr: torch.optim.SGD(p, lr=lr))


def test_adam_becomes_the_l2_variant():
    acc = accelerator(backend="torchao", weight_grad_dtype="fp8")
    _, opt, _ = train(acc, steps=2, optimizer=torch.optim.Adam)
    assert type(opt.optimizer) is LowBitAdam


@pytest.mark.parametrize("engine", ["fsdp2", "deepspeed"])
@pytest.mark.parametrize("knobs", [dict(opt_level="O1"), dict(weight_grad_dtype="fp8"), dict(weight_dtype="bf16")])
def test_sharded_engines_are_refused_until_sharded_fp8_communication_exists(engine, knobs):
    recipe = FP8RecipeKwargs(backend="torchao", **knobs)
    with pytest.raises(BackendUnavailableError, match=f"one process or under DDP.*not under {engine}"):
        create_backend(recipe, RunContext(device=device_info("cpu"), engine=engine, world_size=2))
    named = {"opt_level": "opt_level='O1' (weight_dtype='fp16', weight_grad_dtype='fp8')",
             "weight_grad_dtype": "weight_grad_dtype='fp8' runs", "weight_dtype": "weight_dtype='bf16' runs"}
    with pytest.raises(BackendUnavailableError) as err:  # what the level implies is shown as the level's
        create_backend(recipe, RunContext(device=device_info("cpu"), engine=engine, world_size=2))
    assert named[next(iter(knobs))] in str(err.value)
    # FP32 weights with FP32 gradients need no FP8 communication
    create_backend(FP8RecipeKwargs(backend="torchao", weight_dtype="fp32", weight_grad_dtype="fp32"),
                   RunContext(device=device_info("cpu"), engine=engine, world_size=2))


@pytest.mark.parametrize("knobs, store", [
    (dict(opt_level="O1"), torch.float8_e4m3fn), (dict(opt_level="O2"), torch.float8_e4m3fn),
    (dict(weight_grad_dtype="fp8"), torch.float8_e4m3fn),
    (dict(weight_dtype="bf16"), None), (dict(weight_dtype="bf16", weight_grad_dtype="bf16"), None),
])
def test_ddp_takes_what_it_can_average(knobs, store):
    # .grad in the weights' dtype (DDP), or FP8 stores (FP8GradReducer): tests/optim/test_grad_store_ddp.py
    context = RunContext(device=device_info("cpu"), engine="ddp", world_size=2)
    recipe = FP8RecipeKwargs(backend="torchao", skip_first_last=False, skip_slow_shapes=False, **knobs)
    backend = create_backend(recipe, context)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))
    plan = build_plan(model, recipe, context=context, backend=backend)
    model = backend.convert(model, plan)
    backend.apply_storage(model)
    backend.verify_storage(model)
    weights = {f"{name}.weight" for name, m in model.named_modules() if backend.converted_kind(m) == "linear"}
    assert len(weights) == 2
    assert [s.dtype for s in backend.grad_stores] == ([store] * 2 if store else [])
    # the stored weights are FP8GradReducer's, not DDP's; every other gradient is DDP's, in .grad
    ignored = set(getattr(model, "_ddp_params_and_buffers_to_ignore", []))
    assert {name for name in ignored if name.endswith("weight")} == (weights if store else set())
    assert plan.tensor("grad_comm").dtype.startswith("FP8 E4M3, shared scale") == (store is not None)


@pytest.mark.parametrize("knobs", [dict(weight_grad_dtype="bf16"), dict(weight_dtype="fp16", weight_grad_dtype="bf16")])
def test_ddp_refuses_bf16_gradient_stores(knobs):
    with pytest.raises(BackendUnavailableError, match="weight_grad_dtype='bf16'.*nothing averages under DDP"):
        create_backend(FP8RecipeKwargs(backend="torchao", **knobs),
                       RunContext(device=device_info("cpu"), engine="ddp", world_size=2))


def test_verify_storage_catches_a_weight_not_stored_as_planned():
    acc = accelerator(backend="torchao", opt_level="O1")
    model, _, _ = train(acc, steps=1)
    backend = acc._lowprec[-1][1]
    weight = linear_weights(acc, model)[0]
    weight.data = weight.data.float()
    with pytest.raises(PlanMismatchError, match="planned torch.float16, built torch.float32"):
        backend.verify_storage(acc.unwrap_model(model))


@pytest.mark.parametrize("engine, message", [
    ("fsdp1", "needs FSDP2 .*fsdp_version: 2"),
    ("deepspeed", "communication_data_type takes fp32, bf16 or fp16 only.*DDP/FSDP2"),
])
def test_fp8_grad_comm_is_refused_where_the_engine_cannot_send_fp8(engine, message):
    recipe = FP8RecipeKwargs(backend="torchao", grad_comm_dtype="fp8")
    with pytest.raises(BackendUnavailableError, match=message):
        create_backend(recipe, RunContext(device=device_info("cpu"), engine=engine, world_size=2))


def test_fp8_grad_comm_under_fsdp2_needs_custom_reduce_scatter(monkeypatch):
    import lowprec.planning.engines

    context = RunContext(device=device_info("cpu"), engine="fsdp2", world_size=2)
    create_backend(FP8RecipeKwargs(backend="torchao", grad_comm_dtype="fp8"), context)  # this torch has it
    monkeypatch.setattr(lowprec.planning.engines, "supports_custom_reduce_scatter", lambda: False)
    with pytest.raises(BackendUnavailableError, match="set_custom_reduce_scatter, which torch .* lacks"):
        create_backend(FP8RecipeKwargs(backend="torchao", grad_comm_dtype="fp8"), context)


@pytest.mark.parametrize("choice, row", [("fp8", "FP8 E4M3, shared scale"), ("bf16", "BF16"), ("fp32", "FP32")])
def test_grad_comm_dtype_in_the_ddp_plan(choice, row):
    from lowprec import plan_for

    plan = plan_for(llama(), FP8RecipeKwargs(backend="torchao", grad_comm_dtype=choice, skip_first_last=False,
                                             skip_slow_shapes=False), engine="ddp", world_size=2)
    assert plan.tensor("grad_comm").dtype == row
    single = plan_for(llama(), FP8RecipeKwargs(backend="torchao", grad_comm_dtype=choice))
    assert single.tensor("grad_comm").dtype == "N/A (one process)"


@pytest.mark.parametrize("engine, choice, row, means", [
    ("fsdp2", "fp8", "FP8 E4M3, block scales (groups with FP8 Linears)", "FSDP2 custom reduce-scatter"),
    ("fsdp2", "fp32", "FP32", "MixedPrecisionPolicy's reduce_dtype"),
    ("fsdp2", "bf16", "BF16", "MixedPrecisionPolicy's reduce_dtype"),
    ("deepspeed", "fp32", "FP32", "DeepSpeed's communication_data_type"),
    ("deepspeed", "bf16", "BF16", "DeepSpeed's communication_data_type"),
])
def test_grad_comm_dtype_in_the_sharded_engines_plan(engine, choice, row, means):
    from lowprec import plan_for

    plan = plan_for(llama(), FP8RecipeKwargs(backend="torchao", grad_comm_dtype=choice), engine=engine, world_size=2)
    assert plan.tensor("grad_comm").dtype == row
    assert means in plan.tensor("grad_comm").scaling


def test_grad_comm_hook_reaches_ddp_inside_a_compiled_wrapper(monkeypatch):
    import torch.distributed as dist

    backend = create_backend(FP8RecipeKwargs(backend="torchao", grad_comm_dtype="fp8"),
                             RunContext(device=device_info("cpu"), engine="ddp", world_size=2))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ddp = nn.parallel.DistributedDataParallel(nn.Linear(4, 4))
        hooks = []
        monkeypatch.setattr(ddp, "register_comm_hook", lambda state, hook: hooks.append(hook.__name__))

        class Compiled(nn.Module):  # what torch.compile returns around the DDP wrapper
            def __init__(self, inner):
                super().__init__()
                self._orig_mod = inner

        backend.setup_grad_comm(Compiled(ddp))
        assert hooks == ["fp8_allreduce_hook"]
    finally:
        dist.destroy_process_group()
