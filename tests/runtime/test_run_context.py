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
