"""No lowprec line waits for the GPU inside a training step (issue 29: check with CUDA's sync debug mode).

CI has no GPU, so tests/kernels/step_syncs.py records, on the CPU, every call of a host-syncing tensor method
(`.item()`, `bool()`, ...) that lowprec's own code makes during a step, with LowBitAdamW on its CUDA path (the
fused kernels, interpreted by Triton). On a GPU, tests/distributed/gpu_engines.py records the real syncs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")
pytest.importorskip("transformers")
HERE = os.path.dirname(__file__)
CONFIGS = ["msamp:O2", "msamp:O1", "msamp:O2,fp8", "torchao", "torchao,fp8"]
# Calls on tensors that stay on the host on a GPU too, so they wait for nothing there.
HOST_SIDE = {
    # torch's convention: a .grad parameter's step count is a CPU tensor (the FP8 stores' live on the device)
    "__float__ lowprec/kernels/adam.py:fused_low_bit_adam_step",
}


@pytest.fixture(scope="module")
def recorded():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, os.path.join(HERE, "step_syncs.py"), *CONFIGS], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS)
def test_a_training_step_makes_no_host_sync_in_lowprec(recorded, config):
    r = recorded[config]
    assert set(r["calls"]) - HOST_SIDE == set(), r["calls"]
    if config.startswith("msamp"):
        assert r["fused_launches"] > 0  # LowBitAdamW took the fused path: the check covered it
