"""`FP8RecipeKwargs(backend='te', fp8_weights=True)` under FSDP2 (lowprec/backends/te/fsdp.py): where it is
accepted, the plan it prints, and the adapter's hooks around Accelerate's FSDP2 preparation, on two CPU
processes with the TE test double (tests/distributed/te_fp8_weights_fsdp2.py). TE's own all-gather and
FusedAdam on DTensor shards need its kernels: tests/gpu/test_te_gpu.py::test_fp8_weights_under_fsdp2.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from fake_te import fake_te  # noqa: F401  (fixture)
from torch import nn

from lowprec import BackendUnavailableError, FP8RecipeKwargs, RunContext, build_plan
from lowprec.backends import create_backend
from lowprec.backends.te import TEBackend
from lowprec.planning.hardware import DeviceInfo

H100 = DeviceInfo("cuda", "H100", (9, 0))
B200 = DeviceInfo("cuda", "B200", (10, 0))
SCRIPT = os.path.join(os.path.dirname(__file__), "..", "distributed", "te_fp8_weights_fsdp2.py")


def backend(recipe="current", engine="fsdp2", world_size=4, device=H100, **kwargs) -> TEBackend:
    kwargs.setdefault("skip_first_last", False)
    kwargs.setdefault("skip_slow_shapes", False)
    recipe = FP8RecipeKwargs(backend="te", recipe=recipe, fp8_weights=True, **kwargs)
    return create_backend(recipe, RunContext(device=device, engine=engine, world_size=world_size),
                          require_package=False)


@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_per_tensor_recipes_are_accepted_and_gather_fp8(recipe):
    b = backend(recipe)
    assert b.gathers_fp8_weights and b.effective_options()["fp8_weights"] is True
    assert not backend(recipe, engine="ddp").gathers_fp8_weights


@pytest.mark.parametrize("recipe, device, why", [
    ("block", H100, "Float8BlockScaling weights built FP8-only is expected to fail in TE's own tests"),
    ("mxfp8", B200, "whole 32-row blocks"),
])
def test_block_scaled_recipes_are_refused_naming_what_works(recipe, device, why):
    with pytest.raises(BackendUnavailableError, match=f"recipe='{recipe}' is not supported under fsdp2") as err:
        backend(recipe, device=device)
    assert why in str(err.value) and "Use recipe='current' or 'delayed'" in str(err.value)
    backend(recipe, engine="single", device=device)  # unchanged elsewhere


def test_delayed_without_amax_reduction_is_refused():
    # the gathered weight takes the gathering rank's scale for every shard
    with pytest.raises(BackendUnavailableError, match="reduce_amax=False is not supported under fsdp2"):
        backend("delayed", reduce_amax=False)
    backend("delayed", engine="ddp", reduce_amax=False)


@pytest.mark.parametrize("engine, why", [("fsdp1", "FSDP1 has no all-gather extension"),
                                         ("deepspeed", "DeepSpeed shards and gathers flat")])
def test_fsdp1_and_deepspeed_are_refused_pointing_at_fsdp2(engine, why):
    with pytest.raises(BackendUnavailableError, match=f"is not supported with {engine}: {why}") as err:
        backend(engine=engine)
    assert "under FSDP2 (fsdp_version: 2) with recipe='delayed' or 'current'" in str(err.value)


def test_plan_rows_and_bytes_per_rank():
    model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64))
    b = backend(world_size=4)
    plan = build_plan(model, b.recipe, context=b.context, backend=b)
    weight = plan.tensor("weight")
    assert weight.dtype == ("FP8 E4M3 (Linear, sharded over 4 ranks, all-gathered as FP8), "
                            "FP32 (all-gathered as BF16) (rest)")
    assert "TE's Float8Tensor is the FSDP2 shard" in weight.scaling
    assert "all-reduced over the FSDP2 mesh" in weight.scaling
    assert plan.tensor("master_weight").dtype == "FP32 (TE FusedAdam), sharded over 4 ranks"
    share = 64 * 64 / sum(p.numel() for p in model.parameters())
    expected = {"weight": (share * 1 + (1 - share) * 4) / 4, "weight_grad": 4 / 4, "master_weight": share * 4 / 4,
                "optimizer_states": 8 / 4}
    assert plan.bytes_per_param == pytest.approx(expected)
    assert any(n.startswith("fp8_weights under FSDP2: model state") and "per rank over 4 ranks" in n
               for n in plan.notes)
    delayed = backend("delayed")
    plan = build_plan(model, delayed.recipe, context=delayed.context, backend=delayed)
    assert "amaxes all-reduced across ranks" in plan.tensor("weight").scaling


def test_weights_are_built_nominally_fp32_under_fsdp2(fake_te, monkeypatch):
    # Accelerate upcasts every non-FP32 trainable parameter by dequantising it, and FSDP2 needs one dtype per group
    monkeypatch.setattr(TEBackend, "fp8_weight_device", staticmethod(lambda: torch.device("cpu")))
    for engine, dtype in (("fsdp2", torch.float32), ("ddp", torch.bfloat16)):
        b = backend(engine=engine)
        model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64)).to(torch.bfloat16)
        new = b.convert(model, build_plan(model, b.recipe, context=b.context, backend=b))
        assert new[0].weight.dtype == dtype and new[1].weight.dtype == torch.bfloat16


def test_masters_wait_for_the_shards(fake_te):
    b = backend()
    model = nn.Sequential(nn.Linear(64, 64))
    b._hp_weights[id(model[0].weight)] = torch.ones(64, 64)
    new = b.wrap_optimizer(torch.optim.AdamW(model.parameters()), build_plan(model, b.recipe, context=b.context,
                                                                              backend=b))
    assert new.scaled_state == {} and id(model[0].weight) in b._hp_weights  # seeded by install, after sharding


@pytest.mark.parametrize("setting, message", [
    (dict(cpu_ram_efficient_loading=True), "cpu_ram_efficient_loading=True"),
    (dict(cpu_offload=True), "cannot offload parameters to the CPU"),
])
def test_plugin_settings_it_cannot_run_with_are_refused(setting, message):
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    # the plugin's attributes as Accelerate sets them (its constructor also exports them to os.environ)
    plugin = SimpleNamespace(cpu_ram_efficient_loading=setting.get("cpu_ram_efficient_loading", False),
                             cpu_offload=CPUOffloadPolicy() if setting.get("cpu_offload") else OffloadPolicy())
    accelerator = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin))
    with pytest.raises(ValueError, match=message):
        backend().before_engine_prepare([nn.Linear(16, 16)], accelerator)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    from conftest import run_two_ranks

    return run_two_ranks(SCRIPT, out=tmp_path_factory.mktemp("te_fsdp2") / "result.json")


@pytest.mark.slow
def test_through_accelerates_fsdp2_preparation(ranks):
    for rank, r in enumerate(ranks):
        hooked = r["hooks"]
        # the optimizer holds the sharded weights in their groups and places, its FP32 masters this rank's rows,
        # through AcceleratedOptimizer's state-dict round trip (new group dicts: until 2026-11-29 the FP8 weights
        # went back into the old ones, and under Accelerate no TE Linear trained with fp8_weights under FSDP2)
        assert hooked["groups_after"] == hooked["groups_before"]
        assert hooked["stepped"] == sorted(n for group in hooked["groups_before"] for n in group)
        assert all(hooked["masters_are_this_ranks_rows"].values())
        assert hooked["fp8_weights"]["head.weight"] == ["DTensor", "torch.float32", [24, 32]]
        assert hooked["other_dtypes"] == ["torch.float32"] and hooked["grads"]
        assert hooked["quantized_init_calls"] == 5
        # without the hooks, Accelerate's data_ptr() mapping (0 for every Float8Tensor) gives the optimizer one
        # weight five times: the failure the hooks are there for
        assert r["no_hooks"]["groups_after"][1] == ["head.weight"] * 5, rank
