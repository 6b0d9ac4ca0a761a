"""Shared fixtures: a clean ACCELERATE_* environment, a CPU host without TE, and a fresh Accelerate state per test;
`fused_on_cpu` and `same_bytes` for the tests of `cuda_fused` passes compiled by inductor on CPU."""

from __future__ import annotations

import os
import sys
import warnings

import pytest

# Deterministic cuBLAS workspaces for the GPU tests that rerun training and compare bit for bit
# (torch.use_deterministic_algorithms refuses cuBLAS ops without it); read when CUDA makes its first
# cuBLAS handle, so set before torch does anything.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

# torchao's optional CUDA extensions cannot load into a CPU build of torch; it says so on import.
if not torch.cuda.is_available():
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
warnings.filterwarnings("ignore", message=".*is an Enum subclass and is now natively supported.*")


@pytest.fixture(autouse=True)
def clean_accelerate_env(monkeypatch):
    """No ACCELERATE_* variable leaks into a test from the shell or from another test."""
    for name in list(os.environ):
        if name.startswith("ACCELERATE_"):
            monkeypatch.delenv(name, raising=False)
    yield


@pytest.fixture(autouse=True)
def cpu_host(request, monkeypatch):
    """Run the CPU suite as on a machine with no GPU and no TransformerEngine, whatever this one has.

    CPU tests expect what such a machine gives: Accelerate placing models on the CPU, lowprec planning
    for the CPU (emulated FP8), backend='auto' choosing among what the CPU runs, and TE reported absent.
    On a CUDA host, or with TE installed, each would differ and the test would fail for no fault of the
    code. Tests that plan for a GPU name it (a DeviceInfo, capability=...); TE tests use the stand-in
    (tests/backends/fake_te.py), which puts itself in sys.modules over this; tests marked gpu see the
    machine as it is. Child processes need the same: tests that start one pass CUDA_VISIBLE_DEVICES="".
    """
    if request.node.get_closest_marker("gpu") is not None:
        yield
        return
    from lowprec.utils.imports import availability  # held: a test may patch the module's name

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    # A None entry makes importlib.util.find_spec() answer None: "not installed" to lowprec's look-up.
    monkeypatch.setitem(sys.modules, "transformer_engine", None)
    availability.cache_clear()
    yield
    availability.cache_clear()


@pytest.fixture
def fresh_accelerate_state():
    """Accelerate keeps process-wide singletons; reset them around tests that build an Accelerator."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def free_port() -> int:
    """A TCP port nothing listens on now, for torchrun's rendezvous (fixed ports collide)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


GLOO_ABORT = "terminate called without an active exception"


def run_processes(cmd: list, env: dict, timeout: int = 300, attempts: int = 4):
    """Run a multi-process launch (`torchrun`, `accelerate launch`) and return the CompletedProcess.

    gloo's teardown now and then aborts a rank at interpreter exit on a loaded 2-core host (see
    tests/distributed/teardown.py): a trained model and its optimizer sit in reference cycles (a plain torch
    loop over the demo model makes them, lowprec or not), so DDP's reducer, and the gloo backend it holds, is
    freed by the last garbage collection, during finalisation, after every line of the script ran. Measured:
    4 of 100 runs of train_llama.py with the second core busy, each after the held-out loss was printed; CI
    saw two in a row.
    Scripts of ours leave before it, but examples and benchmarks end as a user's script does. A run that
    fails with gloo's own abort message is run again, up to `attempts` runs in all, and the test says so."""
    import os
    import subprocess
    import warnings

    name = next((os.path.basename(a) for a in cmd if str(a).endswith(".py")), cmd[-1])
    for attempt in range(1, attempts + 1):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode == 0 or GLOO_ABORT not in proc.stderr or attempt == attempts:
            return proc
        warnings.warn(f"{name}: a rank aborted inside gloo ({GLOO_ABORT!r}) in run {attempt}; running it again",
                      stacklevel=2)


def run_two_ranks(script: str, *args: str, out, timeout: int = 300, **env: str):
    """Run `script *args OUT` on two CPU processes under torchrun (gloo) and return the JSON it wrote to
    `out`. The environment has no ACCELERATE_* variable but those in `env`, and no GPU (the ranks are
    CPU processes on a CUDA host too)."""
    import json
    import os
    import sys

    environ = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    environ.update(OMP_NUM_THREADS="1", TORCHAO_FORCE_SKIP_LOADING_SO_FILES="1", CUDA_VISIBLE_DEVICES="", **env)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), script, *args, str(out)]
    proc = run_processes(cmd, environ, timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out) as fh:
        return json.load(fh)


def world_of_one_cell(out_dir, *args: str, timeout: int = 300, **env: str) -> tuple:
    """tests/distributed/gpu_engines.py (what scripts/gpu/multi.sh launches) with `*args` under `torchrun
    --nproc_per_node 1`, a world of one: (the CompletedProcess, the cell's JSON, written into `out_dir`). The
    environment has no ACCELERATE_* variable but those in `env`, and GPU 0 unless `env` names CUDA_VISIBLE_DEVICES
    (or the caller's environment does; "" runs it on the CPU)."""
    import json
    import os
    import sys

    environ = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    environ.setdefault("CUDA_VISIBLE_DEVICES", "0")
    environ.update(env)
    out = os.path.join(out_dir, "cell.json")
    script = os.path.join(os.path.dirname(__file__), "distributed", "gpu_engines.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port",
           str(free_port()), script, *args, "--out", out]
    proc = run_processes(cmd, environ, timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out) as fh:
        return proc, json.load(fh)


def scenario_ranks(run: dict, name: str) -> list:
    """The per-rank records of scenario `name` in a scenario script's result (error if it failed)."""
    scenario = run["scenarios"][name]
    assert "error" not in scenario, scenario.get("traceback") or scenario.get("error")
    return scenario["ranks"]


@pytest.fixture
def fused_on_cpu(monkeypatch):
    """`cuda_fused` functions compiled on CPU too (inductor's CPU code stands in for the CUDA kernels), from
    empty dynamo caches."""
    import lowprec.kernels.fused as fused

    monkeypatch.setattr(fused, "FUSED_DEVICE_TYPES", ("cuda", "cpu"))
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def causal_lm_losses(accelerator, model, optimizer, loader, after_step=None) -> list[float]:
    """One pass of a Hugging Face causal LM over `loader` (token ids, labels = ids) through `accelerator`: each
    step's loss. `after_step()`, if given, runs after each optimizer step (what a stand-in library does there)."""
    losses = []
    for ids in loader:
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if after_step is not None:
            after_step()
    return losses


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same bytes, but for the sign bit of a NaN (inductor's CPU code gives NaN's other sign)."""
    if a.dtype == torch.float8_e4m3fn:
        nan = a.isnan()
        return torch.equal(nan, b.isnan()) and torch.equal(a.view(torch.uint8)[~nan], b.view(torch.uint8)[~nan])
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(-7.0), b.nan_to_num(-7.0))


def run_interpreted(*args: str) -> dict:
    """`python *args` with Triton's interpreter (TRITON_INTERPRET=1, in a process of its own: the variable is read
    when a kernel is defined), the repository and tests/ importable; the JSON its last line of output holds."""
    import json
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(
        [os.path.dirname(here), here, *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
