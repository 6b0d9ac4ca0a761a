"""optim/fused_adam_form.py: Adam checkpoints between TE FusedAdam's form (te's fp8_weights: a step per group, FP32
masters) and Adam's (a step per parameter), so that a run resumes with or without fp8_weights: into LowBitAdamW and
torch's AdamW (the masters written into the parameters) here, into FusedAdam in tests/backends/test_te_checkpoints.py.
The resumed step is checked against the uninterrupted run's, in FP32."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from lowprec.optim import LowBitAdamW
from lowprec.optim.fused_adam_form import per_group_steps, per_parameter_steps, write_masters
from lowprec.runtime.checkpoints import from_low_bit_states


def trained(steps: int = 3):
    """Two parameter groups of FP32 parameters after `steps` of torch's AdamW, and the AdamW."""
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(8, 4)), nn.Parameter(torch.randn(4)), nn.Parameter(torch.randn(3, 3))]
    opt = torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0}], lr=1e-2)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    return params, opt


def fused_adam_form(opt: torch.optim.Optimizer, masters_off: float = 0.0) -> dict:
    """`opt`'s checkpoint as TE's FusedAdam saves one: a step per group, each parameter's FP32 master (the parameter
    plus `masters_off`, standing for the weights the model file rounded)."""
    saved = copy.deepcopy(opt.state_dict())  # torch's state_dict hands out the live state's dicts
    params = [p for g in opt.param_groups for p in g["params"]]
    for group in saved["param_groups"]:
        group["step"] = int(max(float(saved["state"][i]["step"]) for i in group["params"]))
    for pid, p in enumerate(params):
        entry = saved["state"][pid]
        del entry["step"]
        entry["master_param"] = p.detach().clone() + masters_off
    return saved


def test_the_two_forms_convert_into_each_other():
    _, opt = trained()
    adam = opt.state_dict()
    fused = per_group_steps(adam)
    assert [g["step"] for g in fused["param_groups"]] == [3, 3]
    assert all("step" not in s for s in fused["state"].values())
    back, masters = per_parameter_steps({**fused, "state": {i: {**s, "master_param": torch.ones(1)}
                                                           for i, s in fused["state"].items()}})
    assert masters.keys() == adam["state"].keys() and all("master_param" not in s for s in back["state"].values())
    for pid, entry in back["state"].items():
        assert entry["step"].item() == adam["state"][pid]["step"].item()
        assert torch.equal(entry["exp_avg"], adam["state"][pid]["exp_avg"])
    assert all("step" not in g for g in back["param_groups"])
    # each form is left as it is by the conversion into itself
    assert per_group_steps(fused) is fused and per_parameter_steps(adam) == (adam, {})


@pytest.mark.parametrize("into", ["LowBitAdamW", "AdamW"])
def test_a_fused_adam_checkpoint_resumes_adam_from_its_masters(into):
    # the model file of an fp8_weights run holds the weights rounded to FP8: the masters are the weights the run was
    # updating, and the resumed step must be the uninterrupted run's
    params, opt = trained()
    saved = fused_adam_form(opt)
    rounded = [nn.Parameter(p.detach() + 0.01) for p in params]  # what the model file gave back
    groups = [{"params": rounded[:2]}, {"params": rounded[2:], "weight_decay": 0.0}]
    if into == "LowBitAdamW":
        new = LowBitAdamW(groups, lr=1e-2, fused=False, stochastic_rounding=False)
    else:
        new = torch.optim.AdamW(groups, lr=1e-2)
        new.register_load_state_dict_pre_hook(from_low_bit_states)  # what prepare() registers
    new.load_state_dict(saved)
    for p, q in zip(rounded, params):
        assert torch.equal(p.detach(), q.detach())  # the masters, not the rounded weights
    grads = [torch.randn_like(p) for p in params]
    for p, q, g in zip(params, rounded, grads):
        p.grad, q.grad = g, g.clone()
    opt.step()
    new.step()
    for p, q in zip(params, rounded):
        assert (q.detach() - p.detach()).abs().max() <= 1e-6 * p.detach().abs().max()


def test_masters_of_another_model_are_not_written():
    params = [nn.Parameter(torch.zeros(4, 4))]
    groups = [{"params": params}]
    assert write_masters(groups, [{"params": [0]}], {0: torch.ones(2, 2)}) == 0  # another shape
    assert write_masters(groups, [{"params": [0, 1]}], {0: torch.ones(4, 4)}) == 0  # another group size
    assert not params[0].any()
    assert write_masters(groups, [{"params": [7]}], {7: torch.ones(4, 4)}) == 1 and params[0].eq(1).all()


def test_an_adam_checkpoint_without_steps_is_still_refused_by_lowbitadamw():
    # FusedAdam's form is recognised by its groups' steps and no parameter's: a state without either is no Adam's
    params, _ = trained()
    new = LowBitAdamW(params, fused=False)
    bad = {"state": {0: {"exp_avg": torch.zeros(8, 4), "exp_avg_sq": torch.zeros(8, 4)},
                     1: {"step": torch.tensor(1.0), "exp_avg": torch.zeros(4)}},
           "param_groups": [{**new.param_groups[0], "params": [0, 1, 2]}]}
    with warnings.catch_warnings(), pytest.raises(ValueError, match="nothing was loaded"):
        new.load_state_dict(bad)


def test_only_fused_adams_form_is_taken_for_it():
    # groups that count steps and parameters that do not: another optimizer's state (SGD's momentum) is left as it
    # is, for the loading optimizer to refuse
    sgd = {"state": {0: {"momentum_buffer": torch.zeros(2)}}, "param_groups": [{"params": [0], "lr": 0.1}]}
    assert per_parameter_steps(sgd) == (sgd, {})
    fused = {"state": {0: {"exp_avg": torch.zeros(2), "exp_avg_sq": torch.zeros(2), "master_param": torch.ones(2)}},
             "param_groups": [{"params": [0], "lr": 0.1, "step": 5}]}
    converted, masters = per_parameter_steps(fused)
    assert converted["state"][0]["step"].item() == 5 and torch.equal(masters[0], torch.ones(2))


def test_a_load_pre_hook_takes_fused_adams_own_entries_aside_by_parameter_position():
    # what FSDP2's full-state load gave rank 0 alone (tests/test_accelerate_engines.py spreads it over two ranks):
    # the masters and group steps leave the dict the optimizer loads, kept by position for spread_from_rank0
    from lowprec.optim.fused_adam_form import STASH, keeps_group_steps, stash_fused_adam_entries

    params, opt = trained()
    saved = fused_adam_form(opt, masters_off=0.5)
    fresh = torch.optim.AdamW([{"params": [nn.Parameter(p.detach().clone()) for p in params[:2]]},
                               {"params": [nn.Parameter(params[2].detach().clone())]}], lr=1e-2)
    assert not keeps_group_steps(fresh)
    out = stash_fused_adam_entries(fresh, saved)
    masters, steps = fresh.__dict__[STASH]
    assert sorted(masters) == [0, 1, 2] and steps == [3.0, 3.0]
    for i, p in enumerate(params):
        torch.testing.assert_close(masters[i], p.detach() + 0.5)
    assert all("master_param" not in s for s in out["state"].values())
    assert all("step" not in g for g in out["param_groups"])
    assert "master_param" in saved["state"][0]  # the caller's dict is left as it was


def test_the_pre_hook_leaves_adams_form_and_an_optimizer_that_keeps_masters_alone():
    from lowprec.optim.fused_adam_form import STASH, stash_fused_adam_entries

    params, opt = trained()
    assert stash_fused_adam_entries(opt, opt.state_dict()) is None and STASH not in opt.__dict__

    class MastersKept(torch.optim.AdamW):  # as TE's FusedAdam: group steps and masters are its own
        master_weights = True

    keeper = MastersKept(params, lr=1e-2)
    assert stash_fused_adam_entries(keeper, fused_adam_form(opt)) is None and STASH not in keeper.__dict__
