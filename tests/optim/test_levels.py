"""MS-AMP memory levels as optimizer-state precision (`lowprec.optim.levels`).

What `msamp.initialize` does (reference/msamp.md §2): O1 keeps FP32/FP32 moments, O2 stores exp_avg in
E4M3 and exp_avg_sq in FP16; torch Adam becomes the L2 variant (LBAdam), AdamW the decoupled one
(LBAdamW); anything else (SGD, ...) is a ValueError; the implementation switches (foreach, fused,
capturable, ...) are dropped and the hyper-parameters kept. MS-AMP's tests/test_initialize.py checks
the same mapping.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

from lowprec.optim import LEVEL_STATE_DTYPES, LowBitAdam, LowBitAdamW, low_bit_optimizer
from lowprec.optim.levels import check_optimizer, state_bytes, state_description

E4M3 = torch.float8_e4m3fn
LEVELS = ["O1", "O2"]


def model(seed=0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def train(net, opt, steps=3):
    for i in range(steps):
        opt.zero_grad()
        net(torch.randn(4, 8, generator=torch.Generator().manual_seed(i))).pow(2).mean().backward()
        opt.step()


def test_level_state_dtypes_are_ms_amp_s():
    assert LEVEL_STATE_DTYPES == {"O1": (torch.float32, torch.float32), "O2": (E4M3, torch.float16),
                                  "O3": (E4M3, torch.float16)}
    assert state_description("O1") == "FP32+FP32"
    assert state_description("O2") == "FP8 E4M3+FP16"


def test_state_bytes_per_parameter():
    # reference/msamp.md §8: O1 4+4, O2 1+2 (the docs' "up to 62.5% of optimizer memory": 3/8)
    assert state_bytes("O1") == 8 and state_bytes("O2") == 3
    assert 1 - state_bytes("O2") / state_bytes("O1") == 0.625


@pytest.mark.parametrize("level", LEVELS)
def test_state_bytes_matches_what_the_optimizer_holds(level):
    net = model()
    opt = low_bit_optimizer(torch.optim.AdamW(net.parameters()), level, backend="msamp")
    train(net, opt, 1)
    numel = sum(p.numel() for p in net.parameters())
    tensors = len(list(net.parameters()))
    moments = sum(s[k].numel() * s[k].element_size() for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq"))
    assert moments == numel * state_bytes(level)
    # the optimizer's own count adds at most one FP32 scale per moment per tensor
    assert numel * state_bytes(level) <= opt.state_bytes() <= numel * state_bytes(level) + 2 * 4 * tensors


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize(
    "torch_cls,kwargs,expected",
    [
        (torch.optim.AdamW, {}, LowBitAdamW),
        (torch.optim.Adam, {}, LowBitAdam),
        # torch's Adam can be AdamW: the decay kind decides, not the class name
        (torch.optim.Adam, {"decoupled_weight_decay": True}, LowBitAdamW),
    ],
)
def test_adam_variants_map_to_the_matching_low_bit_class(level, torch_cls, kwargs, expected):
    net = model()
    new = low_bit_optimizer(torch_cls(net.parameters(), **kwargs), level, backend="msamp")
    assert type(new) is expected
    m_dtype, v_dtype = LEVEL_STATE_DTYPES[level]
    train(net, new, 1)
    for p in net.parameters():
        assert new.state[p]["exp_avg"].dtype == m_dtype and new.state[p]["exp_avg_sq"].dtype == v_dtype


@pytest.mark.parametrize("torch_cls", [torch.optim.Adam, torch.optim.AdamW])
def test_hyper_parameters_and_groups_are_carried_over(torch_cls):
    net = model()
    groups = [
        {"params": list(net[0].parameters()), "lr": 3e-3, "weight_decay": 0.05},
        {"params": list(net[2].parameters()), "betas": (0.8, 0.95)},
    ]
    original = torch_cls(groups, lr=1e-4, betas=(0.85, 0.99), eps=1e-6, weight_decay=0.2, maximize=True,
                         foreach=False)
    original.param_groups[0]["initial_lr"] = 3e-3  # as an LR scheduler adds
    new = low_bit_optimizer(original, "O2", backend="msamp")
    assert new.defaults["lr"] == 1e-4 and new.defaults["betas"] == (0.85, 0.99)
    assert new.defaults["eps"] == 1e-6 and new.defaults["weight_decay"] == 0.2 and new.defaults["maximize"]
    assert len(new.param_groups) == 2
    for old_group, new_group in zip(original.param_groups, new.param_groups):
        # the same Parameter objects, in the same order (the model is not copied)
        assert all(a is b for a, b in zip(old_group["params"], new_group["params"]))
        for key in ("lr", "betas", "eps", "weight_decay", "maximize"):
            assert new_group[key] == old_group[key], key
        # torch's implementation switches do not leak into the new optimizer
        for key in ("foreach", "capturable", "differentiable", "amsgrad", "decoupled_weight_decay"):
            assert key not in new_group, key
    assert new.param_groups[0]["initial_lr"] == 3e-3
    assert new.param_groups[0]["lr"] == 3e-3 and new.param_groups[1]["betas"] == (0.8, 0.95)


@pytest.mark.parametrize("torch_cls", [torch.optim.Adam, torch.optim.AdamW])
def test_o1_replacement_trains_like_the_original(torch_cls):
    """O1 changes nothing numerically: FP32 moments, same update rule and hyper-parameters."""
    reference, net = model(), model()
    groups = lambda m: [{"params": m[0].parameters(), "lr": 1e-2}, {"params": m[2].parameters()}]  # noqa: E731
    ref_opt = torch_cls(groups(reference), lr=1e-3, weight_decay=0.1)
    opt = low_bit_optimizer(torch_cls(groups(net), lr=1e-3, weight_decay=0.1), "O1", backend="msamp")
    train(reference, ref_opt, 4)
    train(net, opt, 4)
    for p, q in zip(net.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


def test_o2_replacement_stays_close_to_the_original():
    reference, net = model(), model()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=1e-3)
    opt = low_bit_optimizer(torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=1e-3), "O2", backend="msamp")
    train(reference, ref_opt, 4)
    train(net, opt, 4)
    diff = max((p - q).abs().max().item() for p, q in zip(net.parameters(), reference.parameters()))
    assert 0 < diff < 3e-4  # MS-AMP's tolerance; not 0: the moments really are E4M3/FP16


def test_a_low_bit_optimizer_is_returned_as_is():
    opt = LowBitAdamW(model().parameters(), exp_avg_dtype="e5m2", exp_avg_sq_dtype="bf16")
    assert low_bit_optimizer(opt, "O2", backend="msamp") is opt  # the user's state dtypes win
    check_optimizer(opt, "O2", backend="msamp")


@pytest.mark.parametrize("cls", [torch.optim.SGD, torch.optim.RMSprop, torch.optim.Adagrad])
@pytest.mark.parametrize("level", LEVELS)
def test_other_optimizers_are_refused_with_a_clear_error(cls, level):
    opt = cls(model().parameters(), lr=1e-3)
    for fn in (check_optimizer, low_bit_optimizer):
        with pytest.raises(ValueError) as info:
            fn(opt, level, backend="msamp")
        message = str(info.value)
        assert cls.__name__ in message and level in message
        assert "torch.optim.Adam" in message and "torch.optim.AdamW" in message


def test_amsgrad_is_refused():
    # MS-AMP's LBAdamW has no AMSGrad either (reference/msamp.md §3)
    opt = torch.optim.AdamW(model().parameters(), amsgrad=True)
    with pytest.raises(ValueError, match="amsgrad"):
        low_bit_optimizer(opt, "O2", backend="msamp")


def test_existing_state_is_dropped_with_a_warning(caplog):
    net = model()
    original = torch.optim.AdamW(net.parameters())
    train(net, original, 1)
    assert original.state
    with caplog.at_level(logging.WARNING, logger="lowprec.optim.levels"):
        new = low_bit_optimizer(original, "O2", backend="msamp")
    assert not new.state
    assert any("fresh moments" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_the_original_optimizer_is_left_unchanged():
    net = model()
    original = torch.optim.AdamW(net.parameters(), lr=2e-3, foreach=False)
    before = copy.deepcopy(original.param_groups[0])
    low_bit_optimizer(original, "O2", backend="msamp")
    after = original.param_groups[0]
    assert after.keys() == before.keys() and after["foreach"] is False and after["lr"] == 2e-3
