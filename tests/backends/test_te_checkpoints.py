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

