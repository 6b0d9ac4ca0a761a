"""lowprec.runtime.fsdp_prefetch: FSDP2 groups chained for forward prefetch in the order the first forward runs them.

The two-rank part (tests/distributed/fsdp2_prefetch.py, gloo) trains FP32 and msamp O3 models of three blocks run in
the reverse of their registration order, with the chain 0 (FSDP2's implicit overlap), 1 and 2 groups deep.
"""

from __future__ import annotations

import os

import pytest
from torch import nn

from lowprec.runtime.fsdp_prefetch import ForwardPrefetch

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "distributed", "fsdp2_prefetch.py")
ORDER = {
    "fp32": ["FSDPModel", "blocks.2", "blocks.1", "blocks.0"],
    # O3: each block's FP8 Linears are an FSDP2 group of their own inside the block's (named by their first), the
    # head a group of one outside every block
    "O3": ["FSDPModel", "blocks.2", "blocks.2.up", "blocks.1", "blocks.1.up", "blocks.0", "blocks.0.up", "head"],
}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    from conftest import run_two_ranks

    result = run_two_ranks(SCRIPT, out=tmp_path_factory.mktemp("fsdp2_prefetch") / "result.json")
    assert len(result) == 2
    return result


@pytest.mark.slow
@pytest.mark.parametrize("level", ["fp32", "O3"])
@pytest.mark.parametrize("depth", [1, 2])
def test_prefetch_changes_no_loss_and_no_weight(ranks, level, depth):
    for rank in ranks:
        plain, chained = rank[f"{level}_0"], rank[f"{level}_{depth}"]
        assert chained["losses"] == plain["losses"] and chained["weights"] == plain["weights"]


@pytest.mark.slow
@pytest.mark.parametrize("level", ["fp32", "O3"])
@pytest.mark.parametrize("depth", [1, 2])
def test_the_chain_follows_the_first_training_forward_and_then_prefetches(ranks, level, depth):
    for rank in ranks:
        run = rank[f"{level}_{depth}"]
        assert run["order_after_eval"] == []  # an evaluation forward records nothing
        assert run["order"] == ORDER[level] and run["hooks_left"] == 0
        assert run["prefetches"][0] == []  # the first forward records; FSDP2's own overlap meanwhile
        # every group after the root is prefetched by the `depth` groups before it (the second one by the root only)
        names = [name.replace("up", "up, " + name.rsplit(".", 1)[0] + ".down") if name.endswith(".up") else name
                 for name in ORDER[level][1:]]
        expected = sorted(f"FSDP::forward_prefetch for {name}" for i, name in enumerate(names)
                          for _ in range(min(depth, i + 1)))
        assert all(step == expected for step in run["prefetches"][1:]), run["prefetches"][1]
    assert rank[f"{level}_0"]["prefetches"] == [[]] * 4  # without the chain: FSDP2's implicit overlap only


@pytest.mark.parametrize("depth", [0, -1, True, 1.5, "1"])
def test_a_depth_other_than_a_positive_integer_is_refused(depth):
    with pytest.raises(ValueError, match=r"ForwardPrefetch\(depth=.*\): depth must be an integer >= 1"):
        ForwardPrefetch(nn.Linear(2, 2), depth=depth)


def test_a_model_without_fsdp2_is_refused():
    with pytest.raises(ValueError, match="holds no fully_shard-ed module"):
        ForwardPrefetch(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
