"""te with fp8_weights in checkpoints written whole (torch.save / safetensors: FSDP2's FULL_STATE_DICT, DDP, one
process): its FP8-only weights go in dequantised (`plain_checkpoint_entries`), and after a load they are written from
FusedAdam's FP32 masters (`after_load_state`), as its step writes them. TE's Float8Tensor is stood in for by a tensor
holding E4M3 values that has its two methods lowprec calls (`dequantize`, `quantize_`); the whole path through
Accelerate on TE itself: tests/gpu/test_te_gpu.py's Accelerate-engine test."""

from __future__ import annotations

import fake_te as fake
import pytest
import torch
from fake_te import fake_te  # noqa: F401  (fixture)
from test_te import te_backend
from torch import nn

E4M3 = torch.float8_e4m3fn


class Float8Like(torch.Tensor):
    """E4M3 values times one FP32 scale, in a BF16 tensor (TE's nominal dtype), with TE's module name: what lowprec
    recognises as one of TE's tensors."""

    scale_inv = 1.0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # a view keeps the scale, as TE's own views do (DTensor's to_local / from_local make views)
        out = super().__torch_function__(func, types, args, kwargs or {})
        source = next((a for a in args if isinstance(a, Float8Like)), None)
        if isinstance(out, Float8Like) and source is not None:
            out.scale_inv = source.scale_inv
        return out

    def dequantize(self, dtype=None):
        return self.as_subclass(torch.Tensor).to(dtype or self.dtype) * self.scale_inv

    def quantize_(self, src):
        self.scale_inv = float(src.abs().max()) / 448.0
        self.as_subclass(torch.Tensor).copy_((src / self.scale_inv).to(E4M3).to(self.dtype))
        return self


Float8Like.__module__ = "transformer_engine.pytorch.tensor.float8_tensor"


def float8_like(values: torch.Tensor) -> Float8Like:
    t = torch.zeros(values.shape, dtype=torch.bfloat16).as_subclass(Float8Like)
    return t.quantize_(values.float())


def sqnr_db(x: torch.Tensor, ref: torch.Tensor) -> float:
    x = x.detach()
    return float(10 * torch.log10(ref.pow(2).sum() / (x - ref).pow(2).sum()))


def test_fp8_weights_are_dequantised_exactly_and_only_under_the_prefix(fake_te):
    backend = te_backend("current", fp8_weights=True)
    weight = float8_like(torch.randn(16, 16, generator=torch.Generator().manual_seed(0)))
    other = float8_like(torch.randn(4, 4))
    extra = torch.arange(9, dtype=torch.uint8)
    state = {"module.0.weight": weight, "module.0._extra_state": extra, "module.0.bias": torch.ones(16),
             "other.weight": other}
    backend.plain_checkpoint_entries(state, "module.")
    plain = state["module.0.weight"]
    assert type(plain) is torch.Tensor and plain.dtype == torch.bfloat16  # the weight's nominal dtype
    # each E4M3 value times its scale, rounded once to BF16: within half a BF16 step of what the weight holds
    expected = weight.as_subclass(torch.Tensor).double() * weight.scale_inv
    assert ((plain.double() - expected).abs() <= expected.abs() * 2 ** -8).all()
    assert state["module.0._extra_state"] is extra and state["other.weight"] is other  # outside the prefix: left


def test_without_fp8_weights_nothing_is_dequantised(fake_te):
    backend = te_backend("current")
    weight = float8_like(torch.randn(8, 8))
    state = {"0.weight": weight}
    backend.plain_checkpoint_entries(state, "")
    assert state["0.weight"] is weight


def test_sharded_fp8_weights_stay_dtensors_of_their_placement(fake_te):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    backend = te_backend("current", fp8_weights=True)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        local = float8_like(torch.randn(8, 4))
        sharded = DTensor.from_local(local, init_device_mesh("cpu", (1,)), [Shard(0)], run_check=False)
        state = {"0.weight": sharded}
        backend.plain_checkpoint_entries(state, "")
        plain = state["0.weight"]
        assert isinstance(plain, DTensor) and plain.placements == (Shard(0),) and plain.shape == sharded.shape
        assert type(plain.to_local()) is torch.Tensor
        assert torch.equal(plain.to_local(), local.dequantize())
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("fp8_weights", [True, False], ids=["fp8_weights", "bf16_weights"])
def test_after_a_load_fp8_weights_are_written_from_their_masters(fake_te, fp8_weights):
    # the load quantised the checkpoint's dequantised weight with a scale of its own; the FP32 master is what the
    # run continues from, and FusedAdam's step writes the weight from it: so does the load, once it is over
    backend = te_backend("current", fp8_weights=fp8_weights)
    torch.manual_seed(0)
    master = torch.randn(16, 16)
    weight = float8_like(master * 3).requires_grad_()  # what a load left: another weight than the master's
    bias = nn.Parameter(torch.randn(16))
    optimizer = fake.FusedAdam([weight, bias], master_weights=True)
    for p in (weight, bias):
        optimizer.initialize_state(p, store_param_remainders=False)
    optimizer.state[weight]["master_param"].copy_(master)
    bias_before, weight_before = bias.detach().clone(), weight.dequantize(torch.float32)
    backend.after_load_state(nn.Linear(1, 1), [optimizer, torch.optim.SGD([nn.Parameter(torch.ones(1))])])
    if fp8_weights:
        assert sqnr_db(weight.dequantize(torch.float32), master) > 25  # E4M3 of the master: ~30 dB
        assert torch.equal(weight.dequantize(torch.float32), float8_like(master).dequantize(torch.float32))
    else:  # no FP8-only weights: nothing of te's to write
        assert torch.equal(weight.dequantize(torch.float32), weight_before)
    assert torch.equal(bias.detach(), bias_before)  # a plain parameter is its own master's step



@pytest.mark.parametrize("source", ["AdamW", "LowBitAdamW O2"])
def test_an_adam_checkpoint_resumes_fp8_weights(fake_te, source):
    # a run saved without fp8_weights (Adam's form: a step per parameter, no masters; LowBitAdamW's moments scaled)
    # resumed with it: TE's FusedAdam would fail on the state named "step" (a KeyError from its load, as TE's
    # stand-in raises it); its steps become the groups', its moments FP32 values, and after the load each parameter
    # without a master gets one from its weight, with a warning. TE's load makes its states from the dict it is given,
    # not from a hook's result: the stand-in does too.
    import copy

    from test_te import fp8_weights_setup

    from lowprec.optim import LowBitAdamW
    from lowprec.optim.low_bit_adam import plain_adam_state_dict
    from lowprec.runtime.checkpoints import from_low_bit_states

    backend, model, plan = fp8_weights_setup()
    before = (torch.optim.AdamW(model.parameters(), lr=1e-2) if source == "AdamW" else
              LowBitAdamW(model.parameters(), lr=1e-2, exp_avg_dtype="e4m3", exp_avg_sq_dtype="fp16", fused=False))
    for _ in range(3):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        before.step()
    saved = copy.deepcopy(before.state_dict())
    expected = plain_adam_state_dict(copy.deepcopy(saved))["state"]  # FP32 moments
    new = backend.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), plan)
    new.register_load_state_dict_pre_hook(from_low_bit_states)  # as prepare() does
    new.load_state_dict(copy.deepcopy(saved))
    assert [g["step"] for g in new.param_groups] == [3]
    params = list(model.parameters())
    for i, p in enumerate(params):
        assert set(new.state[p]) == {"exp_avg", "exp_avg_sq"}
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(new.state[p][key], expected[i][key].float())
    with pytest.warns(UserWarning, match="no FP32 master weights .* 4 masters start from the weights"):
        backend.after_load_state(model, [new])
    for p in params:
        assert torch.equal(new.state[p]["master_param"], p.detach().float())
    # TE's FusedAdam alone, without lowprec's conversion: the failure it replaces
    plain = fake.FusedAdam(model.parameters(), master_weights=True)
    with pytest.raises(KeyError, match="step"):
        plain.load_state_dict(copy.deepcopy(saved))


def test_before_a_load_masters_are_marked_and_those_it_kept_are_seeded_from_the_weights(fake_te):
    # a load that keeps what it has no entry for (FSDP2's full state dict on several processes) left the masters of
    # the model before the load, which FusedAdam's next step would have written into the FP8 weights: they are NaN
    # until the load replaces them, and after it those still NaN come from the loaded weights
    from lowprec.backends.te.optimizer import complete_fused_adam_state, seed_missing_masters

    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4)), nn.Parameter(torch.randn(0))]
    optimizer = fake.FusedAdam(params, master_weights=True)
    complete_fused_adam_state(optimizer)  # a save: the masters are the weights
    assert all(torch.equal(optimizer.state[p]["master_param"], p.detach()) for p in params)
    complete_fused_adam_state(optimizer, loading=True)
    assert all(optimizer.state[p]["master_param"].isnan().all() for p in params)
    loaded = torch.full((4, 4), 7.0)
    optimizer.state[params[0]]["master_param"].copy_(loaded)  # the load gave this one
    with torch.no_grad():
        params[1].add_(1.0)  # the loaded weight
    assert seed_missing_masters(optimizer) == 1  # the empty shard has nothing to seed
    assert torch.equal(optimizer.state[params[0]]["master_param"], loaded)
    assert torch.equal(optimizer.state[params[1]]["master_param"], params[1].detach())
