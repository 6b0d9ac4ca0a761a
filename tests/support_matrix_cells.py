"""The support matrix's cells: what `prepare()` does for each backend x level x engine.

Shared by tests/test_support_matrix.py (which checks every cell and that docs/support-matrix.md is this
module's rendering) and scripts/support_matrix.py (which rewrites the page). A cell is decided as
`prepare()` decides it: the backend is created for the engine's context (an H100 and two processes
assumed), the model planned, converted and its storage applied; a refusal is the error `prepare()` (or
the Accelerator's constructor) raises. TransformerEngine cells use the TE test double
(tests/backends/fake_te.py) where TE is not installed: the adapter's decisions are lowprec's code either
way, and the runs that show FP8 really active are the tests and GPU results listed in the page.
"""

from __future__ import annotations

import contextlib
import os
import sys

import pytest
import torch
from torch import nn

BACKENDS = ("te", "torchao", "msamp")
LEVELS = (None, "O1", "O2", "O3")
ENGINES = ("single", "ddp", "fsdp2", "zero12", "zero3")
ENGINE_TITLES = {"single": "one process", "ddp": "DDP", "fsdp2": "FSDP2", "zero12": "DeepSpeed ZeRO-1/2",
                 "zero3": "DeepSpeed ZeRO-3"}
# lowprec's engine name and the DeepSpeed config (BF16, as Accelerate's plugin fills it for lowprec) per column
ENGINE_OF = {"zero12": "deepspeed", "zero3": "deepspeed"}
ZERO_STAGE = {"zero12": 2, "zero3": 3}
PAGE = os.path.join(os.path.dirname(__file__), "..", "docs", "support-matrix.md")

# Where each engine's cells are run for real (CPU tests in the README's test command; GPU results committed).
EVIDENCE = {
    "single": "tests/optim/test_weight_storage.py (the three backends x O1/O2 training a Llama), "
              "tests/backends/test_msamp*.py, tests/gpu/ and results/gpu/2026-11-23-h100-levels (H100)",
    "ddp": "tests/optim/test_grad_store_ddp.py (torchao O1/O2 and grad_comm_dtype), tests/backends/test_msamp_comm.py "
           "(msamp O1/O2), two CPU processes; results/gpu/2026-11-30-h200x2-matrix-bdbfff9 (te, torchao, msamp O1 and "
           "O2 on two H200s, 300 steps: speed, memory, model-state bytes per rank and held-out loss against BF16; "
           "earlier: 2026-11-29-h200x2-matrix-9c30527, 2026-11-23-h200x2-matrix)",
    "fsdp2": "tests/optim/test_fsdp_comm.py, tests/backends/test_torchao.py and tests/backends/test_msamp_o3.py (msamp "
             "O3: FP8 all-gather, FP8 reduce-scatter, sharded masters and states; fully_shard on two CPU processes); "
             "results/gpu/2026-11-29-h200x2-matrix-9c30527 (te with and without FP8 weights, torchao, msamp O3 through "
             "Accelerate on two H200s, 300 steps, held-out losses; msamp O3 again in 2026-11-30-h200x2-matrix-bdbfff9 "
             "and -08938d9; earlier: 2026-11-23-h200x2-matrix)",
    "zero12": "tests/test_deepspeed.py (ZeRO-1 and -2 through Accelerate's plugin, two CPU processes: torchao, "
              "optimizer_states, grad_comm_dtype, msamp O3 against O2 on one process, checkpoints, and the refusals); "
              "results/gpu/2026-11-23-h200x2-matrix and -zero-o3 (te, torchao, msamp O3 at ZeRO-1 and -2 on two H200s)",
    "zero3": "tests/test_deepspeed.py (ZeRO-3 through Accelerate's plugin, two CPU processes); "
             "results/gpu/2026-11-23-h200x2-matrix (te, torchao on two H200s)",
}


def _model() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    return LlamaForCausalLM(config)


@contextlib.contextmanager
def _te_available():
    """TransformerEngine as installed, else its test double."""
    from lowprec.utils.imports import availability

    if availability("transformer_engine")[0]:
        yield
        return
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "backends"))
    try:
        import fake_te
    finally:
        sys.path.pop(0)
    with pytest.MonkeyPatch.context() as monkeypatch, fake_te.installed(monkeypatch):
        yield


def evaluate(backend: str, level: str | None, engine: str) -> dict:
    """{"status": "works", ...what was built} or {"status": "refused", "error": ...}."""
    from lowprec import FP8RecipeKwargs
    from lowprec.backends import BackendUnavailableError, RunContext, create_backend
    from lowprec.planning.hardware import assumed_device
    from lowprec.runtime.planner import build_plan

    with (_te_available() if backend == "te" else contextlib.nullcontext()):
        try:
            recipe = FP8RecipeKwargs(backend=backend, opt_level=level, skip_first_last=False, skip_slow_shapes=False)
            context = RunContext(device=assumed_device("9.0"), engine=ENGINE_OF.get(engine, engine),
                                 world_size=1 if engine == "single" else 2)
            adapter = create_backend(recipe, context)
            if engine in ZERO_STAGE:
                problem = adapter.engine_config_problem({"zero_optimization": {"stage": ZERO_STAGE[engine]},
                                                         "bf16": {"enabled": True}})
                if problem is not None:
                    raise ValueError(problem)
            model = _model()
            plan = build_plan(model, recipe, context=context, backend=adapter)
            with torch.no_grad():
                converted = adapter.convert(model, plan)
                adapter.apply_storage(converted)
            plan.verify(converted, adapter.is_converted)
            adapter.verify_storage(converted)
        except (BackendUnavailableError, ValueError) as exc:
            return {"status": "refused", "error": f"{type(exc).__name__}: {exc}"}
    rows = {kind: plan.tensor(kind).dtype for kind in ("weight", "weight_grad", "grad_comm", "optimizer_states")}
    return {"status": "works", "recipe": plan.recipe, "level": plan.opt_level, "converted": len(plan.converted),
            "rows": rows}


def all_cells() -> dict[tuple, dict]:
    return {(b, lvl, e): evaluate(b, lvl, e) for b in BACKENDS for lvl in LEVELS for e in ENGINES}


def render(cells: dict[tuple, dict]) -> str:
    lines = [
        "# Support matrix",
        "",
        "<!-- Generated by `python scripts/support_matrix.py` from tests/support_matrix_cells.py; "
        "tests/test_support_matrix.py fails when this page and the code disagree. Do not edit by hand. -->",
        "",
        "What `prepare()` does for each backend, memory level and engine, on an FP8 GPU. ✓: it converts the",
        "model and trains in FP8 (the recipe lowprec picks there is named). ✗: it raises, and the note gives",
        "the message, which says what to use instead. \"no level\" keeps FP32 weights, gradients and optimizer",
        "states; the levels are described in [levels.md](levels.md), gradient communication in",
        "[communication.md](communication.md).",
        "",
        "| backend | level | " + " | ".join(ENGINE_TITLES[e] for e in ENGINES) + " |",
        "|---|---|" + "---|" * len(ENGINES),
    ]
    notes: list[str] = []
    for b in BACKENDS:
        for lvl in LEVELS:
            row = []
            for e in ENGINES:
                cell = cells[b, lvl, e]
                if cell["status"] == "works":
                    implied = f", {cell['level']}" if cell["level"] != lvl else ""  # msamp always runs a level
                    row.append(f"✓ {cell['recipe']}{implied}")
                else:
                    message = cell["error"].split(": ", 1)[1]
                    if message not in notes:
                        notes.append(message)
                    row.append(f"✗ [{notes.index(message) + 1}]")
            lines.append(f"| {b} | {lvl or 'no level'} | " + " | ".join(row) + " |")
    lines += ["", "## Why a cell is refused", ""]
    lines += [f"{i}. {message}" for i, message in enumerate(notes, 1)]
    lines += ["", "## Where the ✓ cells run for real", ""]
    lines += [f"- {ENGINE_TITLES[e]}: {EVIDENCE[e]}" for e in ENGINES]
    lines += ["", "TransformerEngine has no CPU build: its cells run on GPUs only (tests/gpu/, results/gpu/).", ""]
    return "\n".join(lines)
