"""The two-GPU harness (gpu_engines.py, what scripts/gpu/multi.sh launches) on one CPU process: a compiled model's
cell stays compiled, a cell evaluates on the held-out split, and bad flags are refused."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import pytest
from conftest import world_of_one_cell

HERE = Path(__file__).parent


@pytest.mark.slow
def test_a_compiled_models_cell_watches_two_forwards_and_stays_compiled(tmp_path):
    # the evidence hooks, traced by dynamo, recompiled every step until the cache limit left the blocks eager
    # (a CPU run of this cell: 8 recompiles and a median step 1.6x the compiled one's); after two steps they go. Their
    # counters then appended to a list, whose length dynamo guarded on: every block's every forward recompiled, the
    # proxy's four blocks past the limit on two H200s (0a837bc); and the model's KV cache, on which each block
    # guarded. Now one recompile, the hooks' removal, whatever the number of blocks and steps.
    pytest.importorskip("torchao")
    sys.path.insert(0, str(HERE))
    try:
        from gpu_engines import EVIDENCE_STEPS
    finally:
        sys.path.pop(0)
    proc, cell = world_of_one_cell(tmp_path, "--backend", "torchao", "--recipe", "tensorwise", "--engine", "fsdp2",
                                   "--compile-model", "--fused-adamw", "--size", "tiny", "--steps", "6",
                                   "--peak", str(tmp_path / "cell.peak.txt"), timeout=600,
                                   OMP_NUM_THREADS="1", TORCHAO_FORCE_SKIP_LOADING_SO_FILES="1",
                                   CUDA_VISIBLE_DEVICES="", TORCH_LOGS="recompiles")
    assert cell["compiled_model"] is True and cell["all_forwards_in_fp8"] is True
    assert cell["optimizer_fused"] is True  # multi.sh's 'fused': torch's fused AdamW over FSDP2's DTensors
    # every FP8 Linear's weight moved, and no gradient outlived the last step's zero_grad
    assert cell["fp8_weights_moved"] == cell["fp8_modules"] > 0 and cell["grads_after_zero_grad"] == 0
    assert cell["fp8_forward_calls"] == EVIDENCE_STEPS * cell["planned_fp8_linears"]  # watched, then let go
    assert proc.stderr.count("Recompiling function") == 1, proc.stderr[-3000:]
    assert not (tmp_path / "cell.peak.txt").exists()  # the allocator's trace is CUDA's: nothing recorded on a CPU
    assert cell["last_loss"] < cell["first_loss"]


@pytest.mark.parametrize("flag", ["--no-fp8-all-gather", "--optimizer-states=bf16", "--fp8-weights",
                                  "--torchao-gather-cast"])
def test_the_harness_refuses_recipe_fields_for_the_bf16_baseline(tmp_path, flag):
    # a BF16 cell has no FP8RecipeKwargs: a recipe field there would be a baseline silently unlike what it says
    import subprocess

    proc = subprocess.run([sys.executable, str(HERE / "gpu_engines.py"), "--backend", "bf16", flag,
                           "--out", str(tmp_path / "cell.json")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "backend 'bf16' has none" in proc.stderr
    assert "--no-fp8-all-gather" in proc.stderr and not (tmp_path / "cell.json").exists()


@pytest.mark.parametrize("args, says", [
    (["--backend", "bf16", "--peak-step", "1"], "--peak-step 1 needs --peak and a step of the run"),
    (["--backend", "bf16", "--steps", "4", "--peak", "p.txt", "--peak-step", "4"], "(0 to --steps - 1 = 3)"),
    (["--backend", "msamp", "--opt-level", "O3", "--engine", "fsdp2", "--torchao-gather-cast"],
     "need --backend torchao --engine fsdp2 (got --backend msamp --engine fsdp2)"),
    (["--backend", "torchao", "--engine", "ddp", "--no-fp8-all-gather"],
     "need --backend torchao --engine fsdp2 (got --backend torchao --engine ddp)"),
    (["--backend", "torchao", "--engine", "fsdp2", "--no-fp8-all-gather", "--torchao-gather-cast"],
     "which --no-fp8-all-gather turns off: name one of them"),
    (["--backend", "bf16", "--engine", "ddp", "--forward-prefetch", "1"],
     "chains FSDP2's groups: it needs --engine fsdp2 (got 1 with --engine ddp)"),
    (["--backend", "bf16", "--engine", "fsdp2", "--forward-prefetch", "-1"], "--forward-prefetch takes a whole number"),
])
def test_the_harness_refuses_all_gather_flags_where_they_would_do_nothing(tmp_path, args, says):
    # a cell named ..._aocast or ..._noag that ran as the default would be an A/B of nothing
    import subprocess

    proc = subprocess.run([sys.executable, str(HERE / "gpu_engines.py"), *args, "--out", str(tmp_path / "cell.json")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and says in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "cell.json").exists()


def test_a_cell_evaluates_on_the_held_out_split_after_training(tmp_path):
    # multi.sh's EVAL_BATCHES: the loss a level ends with under its engine, on windows no cell trained on, the same
    # windows for BF16 and FP8 cells; the evaluation's forwards do not count as training ones
    pytest.importorskip("torchao")
    env = dict(OMP_NUM_THREADS="1", TORCHAO_FORCE_SKIP_LOADING_SO_FILES="1", CUDA_VISIBLE_DEVICES="")
    args = ("--engine", "ddp", "--size", "tiny", "--steps", "3", "--eval-batches", "2")
    _, fp8 = world_of_one_cell(tmp_path, "--backend", "torchao", "--recipe", "tensorwise", *args, timeout=600, **env)
    steps_only = fp8["fp8_forward_calls"]
    assert fp8["eval_batches"] == 2 and fp8["heldout_loss"] is not None and math.isfinite(fp8["heldout_loss"])
    assert fp8["all_forwards_in_fp8"] is True and steps_only == 3 * fp8["planned_fp8_linears"]
    # where the cell's wall time went, in order: the launch and imports, the build, prepare(), the steps, the eval
    timeline = fp8["timeline_s"]
    assert list(timeline) == ["before_main", "accelerator", "built", "prepared", "trained", "evaluated", "ended"]
    assert timeline["before_main"] > 0 and 0 < timeline["accelerator"] <= timeline["built"] <= timeline["prepared"]
    assert timeline["prepared"] <= timeline["trained"]
    assert timeline["trained"] - timeline["prepared"] >= sum(fp8["step_times_s"]) - 0.01
    assert timeline["evaluated"] >= timeline["trained"] and timeline["ended"] >= timeline["evaluated"]
    # main()'s start on the wall clock, for matrix_table.py's split of the time outside it
    assert 0 < time.time() - fp8["main_started_s"] < 600
    again = tmp_path / "again"
    again.mkdir()
    _, repeat = world_of_one_cell(again, "--backend", "torchao", "--recipe", "tensorwise", *args, timeout=600, **env)
    assert repeat["heldout_loss"] == fp8["heldout_loss"]  # the same windows, the same weights: the same loss


@pytest.mark.parametrize("flags", ["act8", "act8+ingraph"])
def test_multi_sh_runs_a_cell_as_a_world_of_one_and_ingraph_reaches_it(tmp_path, flags):
    # multi.sh itself (NPROC=1: torchrun, one process) on the CPU: its sixth field's 'ingraph' sets
    # LOWPREC_FP8_ACTIVATIONS_IN_GRAPH=1 for the cell, which the cell's plan then says
    import json
    import os
    import subprocess

    pytest.importorskip("torchao")
    root = HERE.parent.parent
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "LOWPREC_"))}
    env.update(NPROC="1", SIZE="tiny", STEPS="3", CASE_TIMEOUT="500", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
               TORCHAO_FORCE_SKIP_LOADING_SO_FILES="1", PYTHONPATH=str(root),
               PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""))
    proc = subprocess.run(["bash", str(root / "scripts" / "gpu" / "multi.sh"), str(tmp_path / "m"),
                           f"torchao:tensorwise:ddp:::{flags}"], capture_output=True, text=True, timeout=600, env=env,
                          cwd=root)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    with open(tmp_path / "m" / f"torchao_tensorwise_ddp_{flags.replace('+', '_')}.json") as fh:
        cell = json.load(fh)
    assert cell["activation_dtype"] == "fp8" and cell["all_forwards_in_fp8"] is True
    # the rank ended by os._exit (FAST_EXIT's default) after rewriting its result with the end of main()
    end = cell["main_started_s"] + cell["timeline_s"]["ended"]  # each stamp rounded to 10 ms
    assert cell["launch_ended_s"] >= end - 0.05 and cell["launch_started_s"] <= cell["main_started_s"]
    said = " ".join(cell["saved_activations"] or [])
    assert ("inside the graph" in said) == flags.endswith("ingraph"), said


@pytest.mark.parametrize("flag, says", [("--eval-batches", "--eval-batches takes a whole number >= 0"),
                                        ("--seed", "--seed takes a whole number >= 0")])
def test_the_harness_refuses_a_negative_count(tmp_path, flag, says):
    import subprocess

    proc = subprocess.run([sys.executable, str(HERE / "gpu_engines.py"), flag, "-1", "--out",
                           str(tmp_path / "c.json")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and says in proc.stderr, proc.stderr[-1000:]


def test_multi_sh_seeds_give_each_seed_its_folder_weights_and_windows(tmp_path):
    # multi.sh's SEEDS: one held-out loss is one training's, which moved -2.6% to +2.0% around BF16's across cells on
    # two H200s (results/gpu/2026-11-29-h200x2-matrix-9c30527); each seed trains from its own weights on its own
    # windows, is evaluated on the same held-out windows, and lands in its own folder for matrix_table.py
    import json
    import os
    import subprocess

    root = HERE.parent.parent
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "LOWPREC_"))}
    # BUDGET_S as a device call would set it: both cells fit, so both start (the one before gives the second its need)
    env.update(NPROC="1", SIZE="tiny", STEPS="2", EVAL_BATCHES="1", SEEDS="0 3", CASE_TIMEOUT="300", BUDGET_S="570",
               CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONPATH=str(root),
               PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""))
    proc = subprocess.run(["bash", str(root / "scripts" / "gpu" / "multi.sh"), str(tmp_path / "m"), "bf16::ddp"],
                          capture_output=True, text=True, timeout=600, env=env, cwd=root)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    cells = {}
    for seed in (0, 3):
        with open(tmp_path / "m" / f"s{seed}" / "bf16_ddp.json") as fh:
            cells[seed] = json.load(fh)
    assert cells[0]["seed"] == 0 and cells[3]["seed"] == 3
    from lowprec.demo.schedule import DESCRIPTION  # lowprec bench's protocol, so both held-out losses read alike

    assert cells[0]["training"] == DESCRIPTION
    from lowprec.demo.model import PRESETS
    from lowprec.demo.schedule import lr_schedule

    assert cells[3]["learning_rates"] == pytest.approx([PRESETS["tiny"].lr * lr_schedule(2)(s) for s in range(2)])
    assert cells[0]["first_loss"] != cells[3]["first_loss"]  # other weights on other windows
    assert all(math.isfinite(c["heldout_loss"]) for c in cells.values())
    assert not (tmp_path / "m" / "not_started.txt").exists()


@pytest.mark.parametrize("cpu, backend, says", [
    ("", ["bf16"], "launched as 2 processes but Accelerate runs 1"),
    ("true", ["bf16"], "--engine fsdp2 but Accelerate runs DistributedType.MULTI_CPU"),
    # a recipe Accelerate's engine there refuses (O3 under DDP) wrote its refusal as the FSDP2 cell's result
    ("true", ["msamp", "--opt-level", "O3"], "--engine fsdp2 but Accelerate runs DistributedType.MULTI_CPU"),
], ids=["no_cpu_flag", "fsdp2_on_cpu", "o3_fsdp2_on_cpu"])
def test_a_launch_accelerate_runs_otherwise_writes_no_cell(tmp_path, cpu, backend, says):
    # two CPU ranks under torchrun without ACCELERATE_USE_CPU: Accelerate made each a world of one, both ranks wrote
    # the one JSON (one over the other: unreadable, and labelled DDP had it been read); now no cell, and why;
    import os
    import subprocess

    from conftest import free_port

    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    # and two CPU ranks with it asked for FSDP2: Accelerate wrapped the model in DDP, and the cell said FSDP2
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", TORCHAO_FORCE_SKIP_LOADING_SO_FILES="1")
    if cpu:
        env["ACCELERATE_USE_CPU"] = cpu
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port()), str(HERE / "gpu_engines.py"), "--backend", *backend, "--engine",
                           "fsdp2" if cpu else "ddp", "--size", "tiny", "--steps", "2", "--out",
                           str(tmp_path / "cell.json")], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode != 0 and says in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "cell.json").exists()
