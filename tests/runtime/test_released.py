"""A finished run lets go of its model and optimizer: after the user drops the Accelerator, the prepared model and
optimizer, nothing lowprec installed (hooks on parameters, gradient stores, activation storages, scale state,
compiled layers' caches) keeps a parameter or the optimizer alive.

A leak here costs the whole model state on the GPU for every run after it in the same process (a sweep, a notebook,
the headline benchmark): steps in backward once kept 13.9 GiB of the d4096 proxy allocated after its run, because
their parameter hooks, which live in autograd's C++ nodes where the garbage collector sees no cycle, held the
optimizer strongly. Checked per recipe on CPU, where a reference that survives `gc.collect()` is the same leak.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from norm_mlp_block import NormMLPBlock
from torch import nn

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")

RECIPES = {
    "bf16": None,
    "torchao": dict(backend="torchao"),
    "torchao O2": dict(backend="torchao", opt_level="O2"),
    "torchao fp8 states": dict(backend="torchao", optimizer_states="fp8"),
    "torchao act8": dict(backend="torchao", activation_dtype="fp8"),
    "torchao in backward": dict(backend="torchao", optimizer_in_backward=True),
    "msamp O1": dict(backend="msamp", opt_level="O1"),
    "msamp O2": dict(backend="msamp", opt_level="O2"),
    "msamp O2 act8": dict(backend="msamp", opt_level="O2", activation_dtype="fp8"),
}


def _run(fields: dict | None, steps: int = 3) -> list[weakref.ref]:
    """Train `steps` steps through lowprec's Accelerator; weak references to every parameter and the optimizer."""
    from lowprec import Accelerator, FP8RecipeKwargs

    torch.manual_seed(0)
    if fields is None:
        accelerator = Accelerator(mixed_precision="bf16", lowprec_quiet=True)
    else:
        accelerator = Accelerator(mixed_precision="fp8", lowprec_quiet=True,
                                  kwargs_handlers=[FP8RecipeKwargs(skip_slow_shapes=False, **fields)])
    model = nn.Sequential(NormMLPBlock(64), NormMLPBlock(64))
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    for _ in range(steps):
        loss = model(torch.randn(4, 16, 64)).float().square().mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    inner = getattr(optimizer, "optimizer", optimizer)
    assert inner.state, "the optimizer never stepped: the run measured nothing"
    return [weakref.ref(p) for p in model.parameters()] + [weakref.ref(inner)]


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_a_finished_run_leaves_no_parameter_and_no_optimizer_alive(recipe):
    refs = _run(RECIPES[recipe])
    gc.collect()
    alive = [r() for r in refs if r() is not None]
    assert not alive, f"{recipe}: {len(alive)} of {len(refs)} parameters/optimizers outlived their run " \
                      f"({sorted({type(o).__name__ for o in alive})})"


def test_a_layer_keeps_its_gradient_store_while_it_lives():
    # the weight's hook holds its store weakly, so the layer must hold it: a model trained on after the Accelerator is
    # gone still has its weight gradients taken into the store, not left in .grad
    from lowprec import Accelerator, FP8RecipeKwargs
    from lowprec.optim.grad_store import GradStore

    torch.manual_seed(0)
    accelerator = Accelerator(mixed_precision="fp8", lowprec_quiet=True, kwargs_handlers=[
        FP8RecipeKwargs(backend="torchao", opt_level="O2", skip_slow_shapes=False)])
    model = accelerator.prepare(nn.Sequential(NormMLPBlock(64), NormMLPBlock(64)))
    layers = [m for m in model.modules() if any(isinstance(v, GradStore) for v in vars(m).values())]
    assert len(layers) == 4
    del accelerator
    gc.collect()
    model(torch.randn(4, 16, 64)).float().square().mean().backward()
    for layer in layers:
        store = next(v for v in vars(layer).values() if isinstance(v, GradStore))
        assert layer.weight.grad is None and store.grad() is not None


@pytest.mark.parametrize("recipe", ["torchao act8", "torchao O2", "torchao in backward", "msamp O2"])
def test_free_memory_lets_go_of_every_model_the_accelerator_prepared(recipe):
    # Accelerate's way between two trainings with one Accelerator: lowprec's own per-model state (backend, plan,
    # health monitor, replaced parameters) kept each model alive through it until 2026-11-29
    from lowprec import Accelerator, FP8RecipeKwargs

    accelerator = Accelerator(mixed_precision="fp8", lowprec_quiet=True,
                              kwargs_handlers=[FP8RecipeKwargs(skip_slow_shapes=False, **RECIPES[recipe])])

    def run():
        torch.manual_seed(0)
        model = nn.Sequential(NormMLPBlock(64), NormMLPBlock(64))
        model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        accelerator.fp8_health(every=1)
        losses = []
        for _ in range(3):
            loss = model(torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(len(losses)))).square().mean()
            accelerator.backward(loss.float())
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return [weakref.ref(p) for p in model.parameters()] + [weakref.ref(optimizer.optimizer)], losses

    refs, first = run()
    accelerator.free_memory()
    assert accelerator.precision_plan is None
    assert [r for r in refs if r() is not None] == []
    refs, second = run()  # the same Accelerator trains the next model as it did the first
    assert second == first and accelerator.precision_plan is not None


def test_a_model_with_gradient_stores_pickles_whole_and_its_copies_store_nothing(tmp_path):
    # the layer holds its store since 799fdf4, so torch.save of a whole model and copy.deepcopy (an EMA copy) reach
    # it: the weak hook, a local function, failed to pickle; a copy's store is dormant, the original's keeps working
    import copy

    from lowprec import Accelerator, FP8RecipeKwargs
    from lowprec.optim.grad_store import GradStore

    torch.manual_seed(0)
    accelerator = Accelerator(mixed_precision="fp8", lowprec_quiet=True, kwargs_handlers=[
        FP8RecipeKwargs(backend="torchao", opt_level="O2", skip_slow_shapes=False)])
    model = accelerator.prepare(nn.Sequential(NormMLPBlock(64), NormMLPBlock(64)))
    torch.save(model, tmp_path / "whole.pt")
    loaded = torch.load(tmp_path / "whole.pt", weights_only=False)
    ema = copy.deepcopy(model)
    for other in (loaded, ema):
        other(torch.randn(4, 16, 64)).float().square().mean().backward()
        assert all(m.weight.grad is not None for m in other.modules() if isinstance(m, nn.Linear))
    model(torch.randn(4, 16, 64)).float().square().mean().backward()
    stores = [v for m in model.modules() for v in vars(m).values() if isinstance(v, GradStore)]
    assert len(stores) == 4 and all(s.grad() is not None and s.weight.grad is None for s in stores)
