"""Markdown table of scripts/gpu/multi.sh results: one row per cell, speed and peak memory as ratios
against the BF16 cell of the same engine in the same folder.

    python scripts/gpu/matrix_table.py results/gpu/2026-11-23-h200x2-matrix
"""

from __future__ import annotations

import glob
import json
import os
import sys


def table(folder: str) -> str:
    cells = {}
    for path in sorted(glob.glob(os.path.join(folder, "**", "*.json"), recursive=True)):
        with open(path) as fh:
            cell = json.load(fh)
        if "engine" in cell or "refused" in cell:  # a cell of multi.sh, not another benchmark's JSON beside them
            cells[os.path.relpath(path, folder)[:-5]] = cell
    bf16 = {c["engine"]: c for c in cells.values() if c.get("backend") == "bf16" and "refused" not in c}
    lines = ["| cell | FP8 in every forward | loss first → last 5 | step ms | vs BF16 | steady ms | vs BF16 (steady) "
             "| peak GiB/rank | vs BF16 | ranks' weights differ by |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, c in cells.items():
        if "refused" in c:
            lines.append(f"| {name} | refused: {c['refused'][:100]}… | | | | | | | | |")
            continue
        base = bf16.get(c["engine"])
        peak = max(c["peak_memory_gib_per_rank"])
        speed = f"{base['median_step_s'] / c['median_step_s']:.2f}" if base else "n/a"
        memory = f"{peak / max(base['peak_memory_gib_per_rank']):.2f}" if base else "n/a"
        diff = c.get("max_param_diff_across_ranks")
        # after msamp's warm-up (gpu_profile.STEADY_FROM): what a long run sees; absent from runs before 2026-11-27
        # and from runs too short to have it
        steady, base_steady = c.get("steady_median_step_s"), (base or {}).get("steady_median_step_s")
        steady_ms = f"{1000 * steady:.0f}" if steady else ""
        steady_speed = f"{base_steady / steady:.2f}" if steady and base_steady else ""
        lines.append(f"| {name} | {c['all_forwards_in_fp8']} | {c['first_loss']:.2f} → {c['last_loss']:.2f} "
                     f"| {1000 * c['median_step_s']:.0f} | {speed} | {steady_ms} | {steady_speed} | {peak:.1f} "
                     f"| {memory} | {'' if diff is None else diff} |")
    phased = {name: c["phase_ms"] for name, c in cells.items() if c.get("phase_ms")}
    if phased:  # where each step's time goes (gpu_engines.py's marks): device ms where measured, else host
        names = list(next(iter(phased.values()))["host"])
        lines += ["", "| cell | clock | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
        for name, phases in phased.items():
            side = "device" if "device" in phases else "host"
            lines.append(f"| {name} | {side} | " + " | ".join(f"{phases[side].get(n, 0):.1f}" for n in names) + " |")
    profiled = {name: c["profiled_step"] for name, c in cells.items() if c.get("profiled_step")}
    if profiled:  # one profiled step per rank (gpu_profile.kernel_summary): busy << span means the GPU waited
        lines += ["", "| cell | rank | kernels | kernel ms | NCCL ms | busy ms | span ms |", "|---" * 7 + "|"]
        for name, ranks in profiled.items():
            lines += [f"| {name} | {r} | {s['kernels']} | {s['kernel_ms']} | {s['nccl_ms']} | {s['busy_ms']} "
                      f"| {s['span_ms']} |" for r, s in enumerate(ranks)]
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(sys.argv[1]))
