"""`FP8RecipeKwargs(optimizer_in_backward=True)` (lowprec/runtime/steps_in_backward.py): each parameter stepped by
the user's optimizer as autograd accumulates its gradient, on CPU through lowprec's Accelerator (torchao's FP8
emulated). The weights, optimizer states and LR must be those of `optimizer.step()` after backward, bit for bit: the
same kernel runs over one parameter at a time."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lowprec.runtime.steps_in_backward import FIELD, StepsInBackward, engine_problem

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


class _Tied(nn.Module):
    """Two FP8-sized Linears, a norm, and an embedding tied to the head (a parameter used twice: one hook call)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 64)
        self.up = nn.Linear(64, 128, bias=False)
        self.down = nn.Linear(128, 64, bias=True)
        self.norm = nn.LayerNorm(64)
        self.unused = nn.Linear(4, 4)  # no gradient: never stepped, as optimizer.step() skips it

    def forward(self, ids):
        h = self.embed(ids)
        h = h + self.down(torch.relu(self.up(self.norm(h))))
        return h @ self.embed.weight.t()


def _optimizer(model, kind):
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(groups, lr=3e-3, **({"foreach": False} if kind == "loop" else {kind: True}))


def _train(in_backward: bool, kind: str = "adamw foreach", steps: int = 3, accumulate: int = 1, schedule=True,
           states=None):
    """`steps` optimizer steps (each over `accumulate` micro-batches) with an LR schedule: (model, optimizer,
    per-micro-batch `.grad` left after backward, the LR each step ran with)."""
    from accelerate.state import AcceleratorState, GradientState

    from lowprec import Accelerator, FP8RecipeKwargs

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    kind = kind.replace("adamw ", "")
    torch.manual_seed(0)
    model = _Tied()
    recipe = FP8RecipeKwargs(backend="torchao", skip_slow_shapes=False, optimizer_states=states,
                             optimizer_in_backward=in_backward or None)
    accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[recipe], gradient_accumulation_steps=accumulate,
                              lowprec_quiet=True)
    optimizer = _optimizer(model, kind)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s)) if schedule else None
    prepared = accelerator.prepare(model, optimizer, *([scheduler] if scheduler else []))
    model, optimizer = prepared[0], prepared[1]
    data = torch.randint(0, 32, (steps * accumulate, 4, 16), generator=torch.Generator().manual_seed(1))
    grads_left, lrs = [], []
    for ids in data:
        with accelerator.accumulate(model):
            loss = model(ids).float().logsumexp(-1).mean()
            accelerator.backward(loss)
            grads_left.append(sum(p.grad is not None for p in model.parameters()))
            lrs.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            if scheduler is not None:
                prepared[2].step()
            optimizer.zero_grad()
    return accelerator, model, optimizer, grads_left, lrs


# lowprec's LowBitAdamW (optimizer_states): BF16 moments, and MS-AMP's E4M3 + FP16 pair with its stochastic rounding
@pytest.mark.parametrize(("kind", "states"), [("adamw foreach", None), ("adamw loop", None), ("adamw fused", None),
                                              ("sgd", None), ("adamw foreach", "bf16"), ("adamw foreach", "fp8")])
def test_steps_in_backward_train_the_weights_optimizer_step_would_to_the_bit(kind, states):
    _, plain, plain_opt, plain_left, plain_lrs = _train(False, kind, states=states)
    _, stepped, stepped_opt, left, lrs = _train(True, kind, states=states)
    assert plain_left[0] > 0 and left == [0] * len(left)  # every gradient freed in backward
    assert lrs == plain_lrs and lrs[0] != lrs[-1]  # the scheduler drove the steps in backward too
    for (name, a), b in zip(plain.named_parameters(), stepped.parameters()):
        assert torch.equal(a, b), name
    torch.manual_seed(0)
    assert torch.equal(stepped.unused.weight, _Tied().unused.weight)  # no gradient, never stepped
    # the optimizer's own state, as optimizer.step() leaves it: the checkpoint a plain run writes and reads
    ours, theirs = stepped_opt.state_dict(), plain_opt.state_dict()
    assert ours["param_groups"] == theirs["param_groups"] and ours["state"].keys() == theirs["state"].keys()
    for key, entry in theirs["state"].items():
        for name, value in entry.items():
            assert torch.equal(torch.as_tensor(ours["state"][key][name]), torch.as_tensor(value)), (key, name)


def test_under_accumulate_the_steps_come_with_the_micro_batch_that_synchronises():
    _, plain, _, plain_left, _ = _train(False, accumulate=2, steps=2)
    _, stepped, _, left, _ = _train(True, accumulate=2, steps=2)
    # the first micro-batch of each step keeps its gradients to accumulate; the second steps and frees them
    assert left[0] == plain_left[0] > 0 and left[1] == 0 and left[3] == 0
    for a, b in zip(plain.parameters(), stepped.parameters()):
        assert torch.equal(a, b)


def test_the_optimizers_own_hooks_run_once_a_step_not_once_a_parameter():
    calls = []
    model = nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    optimizer.register_step_post_hook(lambda *_: calls.append(1))
    steps = StepsInBackward(optimizer, lambda: True)
    model(torch.randn(2, 8)).sum().backward()
    assert calls == [] and model.weight.grad is None and len(optimizer.state) == 2
    optimizer.step()
    assert calls == [1]
    steps.remove()
    model(torch.randn(2, 8)).sum().backward()
    assert model.weight.grad is not None  # removed: gradients stay for optimizer.step() again


def test_clipping_is_refused_naming_the_option():
    accelerator, model, _, _, _ = _train(True, steps=1)
    with pytest.raises(ValueError, match=r"clip_grad_norm_ with FP8RecipeKwargs.optimizer_in_backward=True"):
        accelerator.clip_grad_norm_(model.parameters(), 1.0)


def test_a_checkpoint_of_steps_in_backward_resumes_a_plain_run_exactly(tmp_path):
    accelerator, _, optimizer, _, _ = _train(True, steps=2, schedule=False)
    accelerator.save_state(str(tmp_path))
    plain_accelerator, plain, plain_opt, _, _ = _train(False, steps=1, schedule=False)
    plain_accelerator.load_state(str(tmp_path))
    _, reference, reference_opt, _, _ = _train(False, steps=2, schedule=False)
    for a, b in zip(plain.parameters(), reference.parameters()):
        assert torch.equal(a, b)
    assert plain_opt.state_dict()["state"][0]["step"] == reference_opt.state_dict()["state"][0]["step"] == 2


@pytest.mark.parametrize(("fields", "named"), [
    (dict(backend="msamp"), "weight_grad_dtype='fp8' (from opt_level='O2', backend 'msamp''s default)"),
    (dict(backend="torchao", weight_grad_dtype="bf16"), "weight_grad_dtype='bf16'"),
    (dict(backend="torchao", opt_level="O1"), "weight_grad_dtype='fp8' (from opt_level='O1')"),
])
def test_gradients_kept_outside_grad_are_refused_by_the_recipe(fields, named):
    from lowprec import FP8RecipeKwargs

    with pytest.raises(ValueError, match="optimizer_in_backward=True cannot be honoured with") as info:
        FP8RecipeKwargs(optimizer_in_backward=True, **fields)
    assert named in str(info.value)


@pytest.mark.parametrize(("engine", "processes"), [("ddp", 2), ("fsdp2", 1), ("deepspeed", 2), ("single", 2)])
def test_several_processes_or_an_engine_are_refused(engine, processes):
    problem = engine_problem(engine, processes)
    assert problem.startswith(f"{FIELD}=True") and repr(engine) in problem
    assert engine_problem("single", 1) is None


def test_the_environment_variable_and_a_bad_value(monkeypatch):
    from lowprec import FP8RecipeKwargs

    monkeypatch.setenv("ACCELERATE_FP8_OPTIMIZER_IN_BACKWARD", "true")
    assert FP8RecipeKwargs(backend="torchao").optimizer_in_backward is True
    monkeypatch.setenv("ACCELERATE_FP8_OPTIMIZER_IN_BACKWARD", "sometimes")
    with pytest.raises(ValueError, match=r"optimizer_in_backward='sometimes' is not a boolean.*"
                                         r"ACCELERATE_FP8_OPTIMIZER_IN_BACKWARD"):
        FP8RecipeKwargs(backend="torchao")


def test_the_plan_says_so():
    accelerator, _, _, _, _ = _train(True, steps=1)
    assert any(note.startswith("optimizer_in_backward:") for note in accelerator.precision_plan.notes)
    assert "in backward" in accelerator.precision_plan.tensor("weight_grad").scaling
    assert "in backward" in str(accelerator.precision_plan)
    plain, _, _, _, _ = _train(False, steps=1)
    assert not any("optimizer_in_backward" in note for note in plain.precision_plan.notes)
    assert "in backward" not in plain.precision_plan.tensor("weight_grad").scaling


def test_an_optimizer_is_given_steps_in_backward_once():
    optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    StepsInBackward(optimizer, lambda: True)
    with pytest.raises(ValueError, match="already steps in backward"):
        StepsInBackward(optimizer, lambda: True)


def test_an_optimizer_prepared_after_its_model_steps_in_backward_too():
    from lowprec import Accelerator, FP8RecipeKwargs
    from lowprec.runtime.steps_in_backward import steps_in_backward

    torch.manual_seed(0)
    accelerator = Accelerator(mixed_precision="fp8", lowprec_quiet=True, kwargs_handlers=[
        FP8RecipeKwargs(backend="torchao", skip_slow_shapes=False, optimizer_in_backward=True)])
    model = accelerator.prepare(_Tied())
    optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert steps_in_backward(optimizer) is not None
    accelerator.backward(model(torch.randint(0, 32, (2, 16))).float().mean())
    assert all(p.grad is None for p in model.parameters()) and len(optimizer.state) > 0


def test_a_second_backward_before_optimizer_step_is_refused_not_stepped_twice():
    model = nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    StepsInBackward(optimizer, lambda: True)
    model(torch.randn(2, 8)).sum().backward()
    with pytest.raises(RuntimeError, match="a second backward reached a parameter already stepped"):
        model(torch.randn(2, 8)).sum().backward()
    optimizer.zero_grad()  # the refused backward's gradients
    optimizer.step()  # what the training loop calls after each backward: the next one steps again
    model(torch.randn(2, 8)).sum().backward()
    assert all(state["step"] == 2 for state in optimizer.state.values())


@pytest.mark.parametrize(("engine", "world"), [("single", 1), ("ddp", 2), ("fsdp2", 2)])
def test_lowprec_plan_takes_the_flag_and_refuses_it_under_an_engine(capsys, engine, world):
    from lowprec.cli import main

    code = main(["plan", "--model", "tiny", "--backend", "torchao", "--optimizer-in-backward", "--engine", engine,
                 "--world-size", str(world)])
    out = capsys.readouterr()
    if engine == "single":
        assert code == 0 and "each stepped by the optimizer in backward" in out.out
    else:
        assert code == 2 and f"{FIELD}=True steps each parameter" in out.err and repr(engine) in out.err


def test_after_load_state_dict_the_steps_use_the_loaded_groups():
    # load_state_dict puts new dicts in param_groups: a hook holding the old one would step with its stale LR
    def run(in_backward: bool):
        torch.manual_seed(0)
        model = nn.Linear(8, 8)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        state = optimizer.state_dict()
        state["param_groups"][0]["lr"] = 0.5
        if in_backward:
            StepsInBackward(optimizer, lambda: True)
        optimizer.load_state_dict(state)
        model(torch.ones(2, 8)).sum().backward()
        optimizer.step()
        return model.weight.detach()

    assert torch.equal(run(True), run(False))


def test_a_finished_run_leaves_neither_its_model_nor_its_optimizer_alive():
    # the hooks live in autograd's C++ nodes, where the garbage collector sees no cycle: a hook holding its
    # optimizer strongly kept every model that stepped in backward allocated (13.9 GiB of the proxy on the H200)
    import gc
    import weakref

    accelerator, model, optimizer, _, _ = _train(True, steps=2)
    inner = getattr(optimizer, "optimizer", optimizer)
    refs = [weakref.ref(p) for p in model.parameters()] + [weakref.ref(inner)]
    assert inner.state and all(r() is not None for r in refs)
    del accelerator, model, optimizer, inner
    gc.collect()
    assert [r for r in refs if r() is not None] == []
