"""`lowprec.runtime.run_context.hosts_of`: the machines a run's processes span, from the launcher's environment."""

from __future__ import annotations

import pytest

from lowprec.runtime.run_context import hosts_of


@pytest.mark.parametrize("local, world, hosts", [
    ("2", 4, 2),     # torchrun on two machines of two GPUs each
    ("8", 8, 1),     # one machine
    (None, 4, 1),    # no launcher variable: one machine
    ("3", 4, 1),     # does not divide the world: not to be trusted
    ("0", 4, 1), ("16", 4, 1), ("two", 4, 1),
])
def test_hosts_come_from_local_world_size(monkeypatch, local, world, hosts):
    if local is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    assert hosts_of(world) == hosts
