"""Markdown table of scripts/gpu/multi.sh results: one row per cell, speed and peak memory as ratios
against the BF16 cell of the same engine and mode (the model compiled or eager: multi.sh's 'model' flag) in the same
folder (with ROUNDS or SEEDS, the same round's or seed's subfolder), and with several of them, each cell's steady
ratio and held-out loss against BF16 per round or seed, and their means.

    python scripts/gpu/matrix_table.py results/gpu/2026-11-23-h200x2-matrix
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys


def table(folder: str) -> str:
    cells = {}
    for path in sorted(glob.glob(os.path.join(folder, "**", "*.json"), recursive=True)):
        with open(path) as fh:
            text = fh.read()
        if not text.strip():  # the harness opened its result and failed before writing it: its log says why
            cells[os.path.relpath(path, folder)[:-5]] = {"refused": "no result: an empty JSON (see the cell's log)"}
            continue
        cell = json.loads(text)
        if "engine" in cell or "refused" in cell:  # a cell of multi.sh, not another benchmark's JSON beside them
            cells[os.path.relpath(path, folder)[:-5]] = cell
    # keyed by (subfolder, engine, compiled model): a round's cells are compared with that round's BF16 of their mode
    bf16 = {_key(name, c): c for name, c in cells.items() if c.get("backend") == "bf16" and "refused" not in c}
    lines = ["| cell | FP8 in every forward | loss first → last 5 | step ms | vs BF16 | steady ms | vs BF16 (steady) "
             "| peak GiB/rank | vs BF16 | ranks' weights differ by | state B/param/rank (plan) "
             "| held-out loss (vs BF16) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, c in cells.items():
        if "refused" in c:
            lines.append(f"| {name} | refused: {c['refused'][:100]}… | | | | | | | | | | |")
            continue
        base = bf16.get(_key(name, c))
        peak = max(c["peak_memory_gib_per_rank"])
        median, base_median = c.get("median_step_s"), (base or {}).get("median_step_s")
        # a run too short for a median (fewer than 6 steps) has None
        speed = f"{base_median / median:.2f}" if median and base_median else "n/a"
        median_ms = f"{1000 * median:.0f}" if median else ""
        base_peak = max(base["peak_memory_gib_per_rank"]) if base else 0.0
        memory = f"{peak / base_peak:.2f}" if base_peak else "n/a"  # 0 on a CPU run: no CUDA memory to read
        diff = c.get("max_param_diff_across_ranks")
        # after msamp's warm-up (gpu_profile.STEADY_FROM): what a long run sees; absent from runs before 2026-11-27
        # and from runs too short to have it
        steady, base_steady = c.get("steady_median_step_s"), (base or {}).get("steady_median_step_s")
        steady_ms = f"{1000 * steady:.0f}" if steady else ""
        steady_speed = f"{base_steady / steady:.2f}" if steady and base_steady else ""
        lines.append(f"| {name} | {c['all_forwards_in_fp8']} | {c['first_loss']:.2f} → {c['last_loss']:.2f} "
                     f"| {median_ms} | {speed} | {steady_ms} | {steady_speed} | {peak:.1f} "
                     f"| {memory} | {'' if diff is None else diff} | {_state(c)} | {_heldout(c, base)} |")
    lines += _rounds(cells, bf16)
    phased = {name: c["phase_ms"] for name, c in cells.items() if c.get("phase_ms")}
    if phased:  # where each step's time goes (gpu_engines.py's marks): device ms where measured, and host ms
        # beside them: a phase whose host time reaches its device time is bound by the host (msamp O3's forward
        # under FSDP2, 36.5 ms of host for 37.1 of device at 08938d9, where BF16's took 17.3 for 40.0)
        names = list(next(iter(phased.values()))["host"])
        lines += ["", "| cell | clock | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
        for name, phases in phased.items():
            for side in [s for s in ("device", "host") if s in phases]:
                lines.append(f"| {name} | {side} | " + " | ".join(f"{phases[side].get(n, 0):.1f}" for n in names)
                             + " |")
    timed = {name: c for name, c in cells.items() if c.get("timeline_s")}
    if timed:  # where a cell's wall time went (gpu_engines.py's timeline): the launch's and the steps' share
        lines += ["", "| cell | launch + imports s | Accelerator s | build s | prepare s | steps s (first) "
                  "| besides the steps s (evidence, eval) | outside the ranks' main s (launcher, exit) |",
                  "|---" * 8 + "|"]
        for name, c in timed.items():
            t, steps = c["timeline_s"], c.get("step_times_s") or [0.0]
            launch = "" if t.get("before_main") is None else f"{t['before_main']:.1f}"
            setup = "" if "accelerator" not in t else f"{t['accelerator']:.1f}"
            end = t.get("ended", t["evaluated"])  # result written, end_training done (older results: evaluated)
            lines.append(f"| {name} | {launch} | {setup} | {t['built'] - t.get('accelerator', 0.0):.1f} "
                         f"| {t['prepared'] - t['built']:.1f} | {sum(steps):.1f} ({steps[0]:.1f}) "
                         f"| {end - t['prepared'] - sum(steps):.1f} | {_outside(c, end)} |")
    profiled = {name: c["profiled_step"] for name, c in cells.items() if c.get("profiled_step")}
    if profiled:  # one profiled step per rank (gpu_profile.kernel_summary): busy << span means the GPU waited
        lines += ["", "| cell | rank | kernels | kernel ms | NCCL ms | busy ms | span ms |", "|---" * 7 + "|"]
        for name, ranks in profiled.items():
            lines += [f"| {name} | {r} | {s['kernels']} | {s['kernel_ms']} | {s['nccl_ms']} | {s['busy_ms']} "
                      f"| {s['span_ms']} |" for r, s in enumerate(ranks)]
    return "\n".join(lines)


def _state(cell: dict) -> str:
    """Model-state bytes per parameter on a rank as measured from the tensors (`model_state_bytes_per_param`), with
    the plan's figure beside it, marked where they differ by more than 5%; empty where not measured (DeepSpeed's
    own optimizer)."""
    measured = (cell.get("model_state_bytes_per_param") or {}).get("all_params", {}).get("total")
    planned = cell.get("planned_bytes_per_param")
    if measured is None:
        return ""
    if not planned:
        return f"{measured:.2f}"
    mark = " **differs**" if abs(measured - planned) > 0.05 * planned else ""
    return f"{measured:.2f} ({planned:.2f}){mark}"


def _heldout(cell: dict, base: dict | None) -> str:
    """The cell's held-out loss (multi.sh's EVAL_BATCHES) and its difference from BF16's of the same engine and mode."""
    loss = cell.get("heldout_loss")
    if loss is None:
        return ""
    delta = None if base is None or cell is base else _heldout_delta(cell, base)
    return f"{loss:.4f}" if delta is None else f"{loss:.4f} ({delta:+.2f}%)"


def _heldout_delta(cell: dict, base: dict) -> float | None:
    """The cell's held-out loss against BF16's in percent, where both were evaluated on as many batches."""
    loss, base_loss = cell.get("heldout_loss"), base.get("heldout_loss")
    if loss is None or base_loss is None or base.get("eval_batches") != cell.get("eval_batches"):
        return None
    return 100 * (loss - base_loss) / base_loss


def _outside(cell: dict, end: float) -> str:
    """multi.sh's wall time of the launch less what the ranks' timeline accounts for, and where the launch's and the
    ranks' wall clocks are both there, its split: the launcher's start before a rank's process began, the exit after
    main()."""
    t, wall = cell["timeline_s"], cell.get("launch_wall_s")
    if wall is None or t.get("before_main") is None:
        return ""
    start, stop, main = cell.get("launch_started_s"), cell.get("launch_ended_s"), cell.get("main_started_s")
    if None in (start, stop, main) or "ended" not in t:
        return f"{wall - t['before_main'] - end:.1f}"  # launch_wall_s: whole seconds
    launcher, exit_ = main - t["before_main"] - start, stop - main - t["ended"]
    return f"{launcher + exit_:.1f} (launcher {launcher:.1f}, exit {exit_:.1f})"


def _key(name: str, cell: dict) -> tuple:
    """Which BF16 cell a cell is compared with: same subfolder, engine and mode (cells before the 'model' flag were
    all eager)."""
    return os.path.dirname(name), cell.get("engine"), bool(cell.get("compiled_model"))


def _rounds(cells: dict, bf16: dict) -> list[str]:
    """Each FP8 cell's steady ratio and held-out loss against BF16 in every round or seed it ran in (cells in
    subfolders, as ROUNDS and SEEDS write them), and their mean: empty with one folder."""
    def steady(c, base):
        s, b = c.get("steady_median_step_s"), base.get("steady_median_step_s")
        return b / s if s and b else None

    return (_by_folder(cells, bf16, steady, "steady vs BF16", "{:.3f}")
            + _by_folder(cells, bf16, _heldout_delta, "held-out loss vs BF16, %", "{:+.2f}"))


def _by_folder(cells: dict, bf16: dict, value, title: str, form: str) -> list[str]:
    """A table of `value(cell, its BF16 cell)` per FP8 cell (rows) and subfolder (columns), with the mean."""
    values: dict[str, dict[str, float]] = {}
    for name, c in cells.items():
        folder = os.path.dirname(name)
        base = bf16.get(_key(name, c))
        if not _repeat(folder) or c.get("backend") == "bf16" or "refused" in c or not base:
            continue
        v = value(c, base)
        if v is not None:
            values.setdefault(os.path.basename(name), {})[folder] = v
    if not values:
        return []
    # every round's or seed's column, a blank where a cell has no comparison there (not a column left out)
    folders = sorted({os.path.dirname(name) for name in cells if _repeat(os.path.dirname(name))})
    out = ["", f"| cell ({title}) | " + " | ".join(folders) + " | mean |", "|---|" + "---|" * (len(folders) + 1)]
    for cell, per in values.items():
        out.append(f"| {cell} | " + " | ".join(form.format(per[f]) if f in per else "" for f in folders)
                   + f" | {form.format(sum(per.values()) / len(per))} |")
    return out


def _repeat(folder: str) -> bool:
    """Whether `folder` is one round (rN, multi.sh's ROUNDS) or one seed (sN, SEEDS) of a list: other subfolders (an
    engine matrix's parts) are different cells, not repeats to average."""
    return re.fullmatch(r"[rs]\d+", os.path.basename(folder)) is not None


if __name__ == "__main__":
    print(table(sys.argv[1]))
