"""`LOWPREC_FP8_GRAD_OVERLAP=1` on two GPUs: the stored FP8 weight gradients averaged block by block on a side CUDA
stream over NCCL are bitwise those of the single pass after the backward (tests/distributed/blockwise_ddp.py in
its `cuda` mode; the CPU run of the same script is tests/optim/test_grad_overlap.py). Needs two Hopper GPUs:
skipped on one (verify.sh's single-GPU call), run on `nvidia-h200-x2` with `pytest -m gpu` on this file.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2
        or torch.cuda.get_device_capability() < (9, 0),
        reason="needs two Hopper (sm_90) or newer GPUs",
    ),
]

HERE = os.path.dirname(__file__)
SCRIPT = os.path.join(HERE, "..", "distributed", "blockwise_ddp.py")


def _launch(tmp_path_factory, mode: str, **env: str) -> list[dict]:
    import json

    from conftest import free_port, run_processes

    out = tmp_path_factory.mktemp(f"blockwise_{mode}") / "result.json"
    environ = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    environ.update(CUDA_VISIBLE_DEVICES="0,1", NCCL_NVLS_ENABLE="0", **env)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           SCRIPT, mode, str(out)]
    proc = run_processes(cmd, environ, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out) as fh:
        return json.load(fh)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return _launch(tmp_path_factory, "cuda")


@pytest.fixture(scope="module")
def zero_ranks(tmp_path_factory):
    pytest.importorskip("deepspeed")
    return _launch(tmp_path_factory, "zero-cuda", ACCELERATE_USE_DEEPSPEED="true")


def _cpu_test_module():
    """tests/optim/test_grad_overlap.py: the same scenarios' checks, run here on what the GPUs recorded."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("grad_overlap_checks",
                                                  os.path.join(HERE, "..", "optim", "test_grad_overlap.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CHECKS = _cpu_test_module()


@pytest.mark.parametrize("name", CHECKS.SCENARIOS)
def test_blockwise_averaging_on_a_side_stream_changes_no_byte(ranks, name):
    # the script writes every FP8 gradient and starts every side-stream bucket ~30 ms late on the GPUs, so a
    # missing wait between the streams would average stale bytes here
    CHECKS.assert_same_bytes_as_the_single_pass(ranks, name)
    assert all(rank["scenarios"][name]["on"]["side_stream"] for rank in ranks)


def test_stores_with_loss_backward_called_directly_on_the_gpus(ranks):
    CHECKS.test_stores_are_averaged_every_step_with_loss_backward_called_directly(ranks)


def test_loss_backward_called_directly_twice_a_step_on_the_gpus(ranks):
    CHECKS.test_loss_backward_called_directly_twice_a_step_keeps_ranks_in_step(ranks)


@pytest.mark.parametrize("name", CHECKS.ZERO_SCENARIOS)
def test_o3_under_zero2_on_a_side_stream_changes_no_byte(zero_ranks, name):
    CHECKS.assert_same_bytes_as_the_single_pass(zero_ranks, name)
