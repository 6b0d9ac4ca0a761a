"""Every backend x level x engine either works (FP8 active, the plan's rows built) or is refused with a
message that names the combination and what to use instead; docs/support-matrix.md is generated
from these cells (`python scripts/support_matrix.py`) and must match them."""

from __future__ import annotations

import re

import pytest
from support_matrix_cells import BACKENDS, ENGINES, LEVELS, PAGE, all_cells, evaluate, render

pytest.importorskip("torchao")
pytest.importorskip("transformers")


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("level", LEVELS, ids=lambda lvl: lvl or "none")
@pytest.mark.parametrize("backend", BACKENDS)
def test_cell_works_or_is_refused_clearly(backend, level, engine):
    cell = evaluate(backend, level, engine)
    if cell["status"] == "works":
        assert cell["converted"] > 0  # FP8 really in the model, not a plan with nothing converted
        rows = cell["rows"]
        if engine == "single":
            assert rows["grad_comm"] == "N/A (one process)"
        if cell["level"] in ("O1", "O2"):
            assert "FP16" in rows["weight"] and "FP8" in rows["weight_grad"]
            assert "FP8" in rows["optimizer_states"] if cell["level"] == "O2" else "FP32" in rows["optimizer_states"]
        return
    error = cell["error"]
    assert error.startswith(("BackendUnavailableError", "ValueError")), error
    # names what was asked for, and what would work instead
    assert backend in error and (level is None or level in error or engine in error or "zero_stage" in error), error
    assert re.search(r"\b(use|Use|supports|Keep)\b", error), error


def test_levels_refused_only_where_their_parts_are_not_there_yet():
    cells = all_cells()
    for backend in BACKENDS:
        for engine in ("single", "ddp"):
            for level in ("O1", "O2"):
                assert cells[backend, level, engine]["status"] == "works", (backend, level, engine)
        for engine in ENGINES:
            # O3 shards masters and states: msamp under FSDP2 and DeepSpeed ZeRO-1/2 (ZeRO-3 would partition
            # the modules holding the FP8 weights)
            expected = "works" if backend == "msamp" and engine in ("fsdp2", "zero12") else "refused"
            assert cells[backend, "O3", engine]["status"] == expected, (backend, engine)


def test_the_docs_page_is_generated_from_these_cells():
    with open(PAGE) as fh:
        page = fh.read()
    assert page == render(all_cells()), "docs/support-matrix.md is stale: run `python scripts/support_matrix.py`"
