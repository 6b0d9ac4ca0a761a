"""`lowprec.runtime.run_context.hosts_of`: the machines a run's processes span, from the launcher's environment."""

from __future__ import annotations

import pytest

from lowprec.runtime.run_context import hosts_of


@pytest.mark.parametrize("local, world, hosts", [
    ("2", 4, 2),     # torchrun on two machines of two GPUs each
    ("8", 8, 1),     # one machine
    (None, 4, 1),    # no launcher variable: one machine
    ("4", 6, 2),     # 4 + 2 processes: on the first machine; the second says 3 (below): both several hosts
    ("2", 6, 3),
    ("0", 4, 1), ("16", 4, 1), ("two", 4, 1),
])
def test_hosts_come_from_local_world_size(monkeypatch, local, world, hosts):
    if local is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    assert hosts_of(world) == hosts


def test_an_accelerators_context_counts_its_hosts(monkeypatch):
    # run_context_of passes the hosts on: O3 under FSDP2 reduce-scatters in FP8 across hosts only
    from types import SimpleNamespace

    import torch
    from accelerate.utils import DistributedType

    from lowprec.runtime.run_context import run_context_of

    accelerator = SimpleNamespace(distributed_type=DistributedType.MULTI_GPU, num_processes=4,
                                  device=torch.device("cpu"), state=SimpleNamespace(dynamo_plugin=None))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert run_context_of(accelerator, "").hosts == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert run_context_of(accelerator, "").hosts == 1


def test_an_fsdp_state_without_its_plugin_is_a_clear_error():
    # On a GPU host Accelerate writes the engine its AcceleratorState chose (FSDP) back into PartialState's shared
    # state; an Accelerator built after AcceleratorState._reset_state(reset_partial_state=False) then has
    # distributed_type FSDP and no fsdp_plugin, and accelerator.is_fsdp2 raised a bare AttributeError naming
    # 'is_fsdp2' (tests/gpu/test_te_gpu.py's Accelerate-engine test on the H200 at 4a73b59). On the CPU the write-back
    # is made by hand: a single CPU process would choose no engine at all.
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    from lowprec import Accelerator, FP8RecipeKwargs

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    try:
        PartialState(cpu=True)
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        with pytest.raises(ValueError, match=r"distributed_type=FSDP but holds no fsdp_plugin.*"
                                             r"_reset_state\(reset_partial_state=True\)"):
            Accelerator(mixed_precision="fp8", kwargs_handlers=[FP8RecipeKwargs(backend="msamp", opt_level="O2")],
                        fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
