"""The plan's communication / weight / master-weight rows come from what the engine really does."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lowprec import FP8RecipeKwargs
from lowprec.backends import RunContext
from lowprec.engines import EnginePrecision, deepspeed_precision, dtype_name, fsdp_precision
from lowprec.hardware import assumed_device
from lowprec.planning import build_plan

pytest.importorskip("torchao")


def _model():
    return nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(4)])


def _plan(engine: str, backend: str = "torchao", precision: EnginePrecision | None = None, **recipe):
    context = RunContext(device=assumed_device("9.0"), engine=engine, world_size=1 if engine == "single" else 2,
                         precision=precision)
    return build_plan(_model(), FP8RecipeKwargs(backend=backend, **recipe), context=context)


def _rows(plan):
    return {t.kind: t.dtype for t in plan.tensors}


def test_single_process_has_no_gradient_communication():
    assert _rows(_plan("single"))["grad_comm"] == "N/A (one process)"


def test_ddp_reduces_in_the_parameters_dtype():
    rows = _rows(_plan("ddp"))
    assert rows["grad_comm"] == "FP32"
    assert rows["weight"] == "FP32" and rows["master_weight"] == "N/A"


def test_fsdp2_defaults_are_accelerates_bf16_policy():
    # lowprec hands Accelerate "bf16": FSDP2 reduce-scatters gradients and gathers weights in BF16
    rows = _rows(_plan("fsdp2", enable_fsdp_float8_all_gather=False))
    assert rows["grad_comm"] == "BF16"
    assert rows["weight"] == "FP32 (all-gathered as BF16)"


def test_fsdp2_with_torchao_fp8_all_gather_says_fp8():
    rows = _rows(_plan("fsdp2"))
    assert rows["weight"] == "FP32 (all-gathered as FP8 E4M3)"
    assert rows["grad_comm"] == "BF16"


def test_fsdp2_policy_from_the_plugin_is_shown():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    rows = _rows(_plan("fsdp2", precision=fsdp_precision(policy), enable_fsdp_float8_all_gather=False))
    assert rows["grad_comm"] == "FP32"
    assert rows["weight"] == "FP32 (all-gathered as BF16)"


def test_deepspeed_bf16_keeps_bf16_weights_and_fp32_masters():
    plan = _plan("deepspeed")
    rows = _rows(plan)
    assert rows["weight"] == "BF16"
    assert rows["master_weight"] == "FP32 (deepspeed)"
    assert rows["weight_grad"] == "BF16"
    assert rows["grad_comm"] == "BF16"
    # 2 (BF16 weight) + 2 (BF16 grad) + 4 (FP32 master) + 8 (FP32 Adam states)
    assert plan.model_state_bytes_per_param == pytest.approx(16)
    assert plan.bytes_per_param["master_weight"] == 4


@pytest.mark.parametrize("config, expected", [
    ({"bf16": {"enabled": "auto"}}, ("BF16", "BF16", "FP32")),
    ({"bf16": {"enabled": True}, "communication_data_type": "fp32"}, ("FP32", "BF16", "FP32")),
    ({"fp16": {"enabled": True}}, ("FP16", "FP16", "FP32")),
    ({}, (None, None, None)),
])
def test_deepspeed_precision_reads_the_config(config, expected):
    ep = deepspeed_precision(config)
    assert (ep.grad_reduce, ep.weight, ep.master_weight) == expected


def test_te_rows_follow_the_engine_too():
    from lowprec.backends import create_backend

    context = RunContext(device=assumed_device("9.0"), engine="deepspeed", world_size=2)
    recipe = FP8RecipeKwargs(backend="te", recipe="current")
    backend = create_backend(recipe, context, require_package=False)  # planning needs no TE
    rows = _rows(build_plan(_model(), recipe, context=context, backend=backend))
    assert rows["weight"] == "BF16" and rows["master_weight"] == "FP32 (deepspeed)"


def test_dtype_name():
    assert dtype_name(torch.bfloat16) == "BF16"
    assert dtype_name("float32") == "FP32"
    assert dtype_name(None) is None


def test_cli_plan_for_fsdp2_shows_bf16_communication(capsys):
    pytest.importorskip("transformers")
    from lowprec.cli import main

    main(["plan", "--model", "tiny", "--backend", "torchao", "--capability", "9.0", "--engine", "fsdp2",
          "--world-size", "2"])
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| this plan"))
    assert "| BF16 " in row and "FP32 " in row
