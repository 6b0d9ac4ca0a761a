"""torchao's FP8 all-gather under FSDP2 with lowprec's one-kernel cast of each shard: the bytes torchao's own cast
gives, its fallback before the first step, and what it does with non-finite weights."""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("torchao")

from torchao.float8.float8_training_tensor import LinearMMConfig  # noqa: E402
from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor  # noqa: E402

from lowprec.backends.torchao_gather import _pre_all_gather, gather_cast  # noqa: E402

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def weight(data: torch.Tensor, fp8_dtype: torch.dtype, scale: torch.Tensor | None):
    w = WeightWithDynamicFloat8CastTensor(data, LinearMMConfig(), fp8_dtype)
    w._precomputed_scale = scale
    return w


def fused(w):
    w.fsdp_pre_all_gather = types.MethodType(_pre_all_gather, w)
    return w


def shard(dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    data = torch.randn(96, 48, generator=g) * torch.logspace(-3, 1, 48)  # columns over four decades
    return data.to(dtype)


@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("headroom", [1.0, 4.0], ids=["at_amax", "saturating"])
def test_the_bytes_and_scale_are_torchaos(fp8_dtype, dtype, headroom):
    data = shard(dtype)
    # headroom 4: a scale four times the amax's, as after a step that grew the weights, so the largest values
    # saturate at the format's max
    scale = (torch.finfo(fp8_dtype).max / data.abs().max().float() * headroom).reshape(())
    (expected,), (expected_scale,) = weight(data, fp8_dtype, scale).fsdp_pre_all_gather(None)
    (got,), (got_scale,) = fused(weight(data, fp8_dtype, scale)).fsdp_pre_all_gather(None)
    assert got.dtype == expected.dtype == fp8_dtype and got.shape == data.shape
    assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
    assert got_scale is expected_scale is scale
    if headroom > 1:
        assert (got.float().abs() == torch.finfo(fp8_dtype).max).sum() >= 20


@pytest.mark.parametrize("fp8_dtype", FP8)
def test_a_non_finite_weight_stays_non_finite(fp8_dtype):
    # torchao's clamp makes an inf a finite +-max: a weight that overflowed would train on as a large finite value
    data = shard(torch.float32)
    data[0, 0], data[1, 1], data[2, 2] = float("inf"), float("-inf"), float("nan")
    scale = torch.tensor(1.0)
    (got,), _ = fused(weight(data, fp8_dtype, scale)).fsdp_pre_all_gather(None)
    decoded = got.float()
    assert decoded[0, 0].isnan() and decoded[1, 1].isnan() and decoded[2, 2].isnan()
    finite = torch.ones_like(data, dtype=torch.bool)
    finite[0, 0] = finite[1, 1] = finite[2, 2] = False
    assert decoded[finite].isfinite().all()
    (theirs,), _ = weight(data, fp8_dtype, scale).fsdp_pre_all_gather(None)
    assert theirs.float()[0, 0] == torch.finfo(fp8_dtype).max  # what the override changes
    assert torch.equal(got.view(torch.uint8)[finite], theirs.view(torch.uint8)[finite])


def test_before_the_first_step_torchaos_own_cast_runs(monkeypatch):
    # no precomputed scale yet: torchao computes one from the shard (all-reducing the amax under FSDP2)
    calls = []
    original = WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather

    def spy(self, mesh):
        calls.append(mesh)
        return original(self, mesh)

    monkeypatch.setattr(WeightWithDynamicFloat8CastTensor, "fsdp_pre_all_gather", spy)
    data = shard(torch.float32)
    (got,), (scale,) = fused(weight(data, torch.float8_e4m3fn, None)).fsdp_pre_all_gather("mesh")
    assert calls == ["mesh"]
    assert torch.equal(got.view(torch.uint8), gather_cast(data, scale, torch.float8_e4m3fn).view(torch.uint8))


def test_an_empty_shard_goes_to_torchao():
    # uneven sharding leaves a rank with no rows
    empty = torch.empty(0, 48)
    (got,), _ = fused(weight(empty, torch.float8_e4m3fn, torch.tensor(2.0))).fsdp_pre_all_gather(None)
    assert got.shape == (0, 48) and got.dtype == torch.float8_e4m3fn


def test_the_override_is_the_instances_own():
    w = fused(weight(shard(torch.float32), torch.float8_e4m3fn, torch.tensor(1.0)))
    other = weight(shard(torch.float32), torch.float8_e4m3fn, torch.tensor(1.0))
    assert w.fsdp_pre_all_gather.__func__ is _pre_all_gather
    assert other.fsdp_pre_all_gather.__func__ is WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather
    import inspect

    # FSDP2 picks the hook's calling convention from its signature: torchao's (mesh) one
    assert list(inspect.signature(w.fsdp_pre_all_gather).parameters) == ["mesh"]
