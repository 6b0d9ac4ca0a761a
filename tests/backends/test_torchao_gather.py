"""torchao's FP8 all-gather under FSDP2 with lowprec's one-kernel cast of each shard: the bytes torchao's own cast
gives, its fallback before the first step, and what it does with non-finite weights."""

from __future__ import annotations

import copy
import io

import pytest
import torch

pytest.importorskip("torchao")

from torchao.float8.float8_training_tensor import LinearMMConfig  # noqa: E402
from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor  # noqa: E402

from lowprec.backends.torchao_gather import _MARK, _replace_torchaos_method, gather_cast  # noqa: E402

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def weight(data: torch.Tensor, fp8_dtype: torch.dtype, scale: torch.Tensor | None):
    w = WeightWithDynamicFloat8CastTensor(data, LinearMMConfig(), fp8_dtype)
    w._precomputed_scale = scale
    return w


def fused(w):
    _replace_torchaos_method()  # what fuse_gather_casts does for a wrapped model's shards
    setattr(w, _MARK, True)
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
    import lowprec.backends.torchao_gather as gather

    _replace_torchaos_method()
    calls = []
    original = gather._torchao_pre_all_gather

    def spy(self, mesh):
        calls.append(mesh)
        return original(self, mesh)

    monkeypatch.setattr(gather, "_torchao_pre_all_gather", spy)
    data = shard(torch.float32)
    (got,), (scale,) = fused(weight(data, torch.float8_e4m3fn, None)).fsdp_pre_all_gather("mesh")
    assert calls == ["mesh"]
    assert torch.equal(got.view(torch.uint8), gather_cast(data, scale, torch.float8_e4m3fn).view(torch.uint8))


def test_an_empty_shard_goes_to_torchao():
    # uneven sharding leaves a rank with no rows
    empty = torch.empty(0, 48)
    (got,), _ = fused(weight(empty, torch.float8_e4m3fn, torch.tensor(2.0))).fsdp_pre_all_gather(None)
    assert got.shape == (0, 48) and got.dtype == torch.float8_e4m3fn


def inf_bytes(w) -> float:
    (got,), _ = w.fsdp_pre_all_gather(None)
    return got.float()[0, 0].item()


def with_inf() -> torch.Tensor:
    data = shard(torch.float32)
    data[0, 0] = float("inf")
    return data


def test_only_the_weights_lowprec_marked_take_the_one_kernel_cast():
    # torchao's class method is replaced once, for every instance: an unmarked weight (one lowprec did not prepare)
    # gets torchao's cast, which saturates an inf, a marked one lowprec's, which keeps it non-finite
    marked = fused(weight(with_inf(), torch.float8_e4m3fn, torch.tensor(1.0)))
    plain = weight(with_inf(), torch.float8_e4m3fn, torch.tensor(1.0))
    assert WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather.__module__ == "lowprec.backends.torchao_gather"
    assert inf_bytes(plain) == 448.0 and torch.isnan(torch.tensor(inf_bytes(marked)))
    _replace_torchaos_method()  # twice: torchao's method stays the one it hands the others to
    assert inf_bytes(plain) == 448.0
    import inspect

    # FSDP2 picks the hook's calling convention from its signature: torchao's (mesh) one
    assert list(inspect.signature(marked.fsdp_pre_all_gather).parameters) == ["mesh"]


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_a_copy_keeps_the_mark_and_casts_its_own_shard(how):
    # an override bound to the instance went with a deep copy and cast the original's shard, and its pickle did not
    # load (an attribute the class lacks)
    data = shard(torch.float32)
    marked = fused(weight(data, torch.float8_e4m3fn, (448.0 / data.abs().max()).reshape(())))
    if how == "deepcopy":
        copied = copy.deepcopy(marked)
    else:
        buffer = io.BytesIO()
        torch.save(marked, buffer)
        copied = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    assert type(copied) is WeightWithDynamicFloat8CastTensor and vars(copied)[_MARK] is True
    copied._tensor.mul_(2)  # the copy's own shard, not the original's
    copied._precomputed_scale = marked._precomputed_scale / 2
    copied._tensor[0, 0] = float("inf")
    (got,), _ = copied.fsdp_pre_all_gather(None)
    (original,), _ = marked.fsdp_pre_all_gather(None)
    assert got.float()[0, 0].isnan() and not original.float()[0, 0].isnan()
    assert torch.equal(got.view(torch.uint8).flatten()[1:], original.view(torch.uint8).flatten()[1:])


def test_a_traced_pre_all_gather_is_torchaos(monkeypatch):
    # FSDP2's hooks traced by dynamo (skip_fsdp_hooks=False): inductor fuses torchao's cast, no eager kernel in a graph
    import lowprec.backends.torchao_gather as gather

    _replace_torchaos_method()
    calls = []
    original = gather._torchao_pre_all_gather
    monkeypatch.setattr(gather, "_torchao_pre_all_gather",
                        lambda self, mesh: calls.append(mesh) or original(self, mesh))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    fused(weight(shard(torch.float32), torch.float8_e4m3fn, torch.tensor(1.0))).fsdp_pre_all_gather("mesh")
    assert calls == ["mesh"]


def test_a_torchao_with_another_pre_all_gather_keeps_its_own_cast(monkeypatch):
    # a torchao whose method takes more (FSDP2's newer convention) is not the one this cast stands in for: nothing is
    # replaced or marked, and the plan says torchao casts
    import lowprec.backends.torchao_gather as gather
    from lowprec import FP8RecipeKwargs, RunContext
    from lowprec.backends import create_backend
    from lowprec.planning.hardware import device_info

    def newer(self, mesh, outer_size, outer_stride, module, mp_policy):
        raise AssertionError("not called here")

    monkeypatch.setattr(gather, "_torchao_pre_all_gather", None)
    monkeypatch.setattr(WeightWithDynamicFloat8CastTensor, "fsdp_pre_all_gather", newer)
    assert not gather.supported()
    model = torch.nn.Linear(32, 32)
    assert gather.fuse_gather_casts(model) == 0 and WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather is newer
    backend = create_backend(FP8RecipeKwargs(backend="torchao"),
                             RunContext(device=device_info("cpu"), engine="fsdp2", world_size=2))
    assert any("each shard cast by torchao" in note for note in backend.notes(None))
