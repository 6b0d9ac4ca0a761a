"""Held-out loss over several seeds: how far an FP8 configuration's loss is from BF16's, next to how far BF16's own
moves from seed to seed.

`lowprec bench --seeds N` trains every configuration with seeds 0..N-1. A seed fixes the initialisation and the
order of the training batches (`lowprec.demo.run --seed`; the held-out batches are the same for every run), so each
FP8 run is compared with the BF16 run of its own seed: the paired difference leaves out most of what the seed
changes, where one run each compares two draws of it (on the d4096 proxy BF16's held-out loss moved 0.3-1% between
single 300-step runs).
"""

from __future__ import annotations

import math
from collections import defaultdict


def seed_summary(rows: list[dict]) -> list[dict]:
    """Per (model class, configuration) over its seeds: the held-out loss's mean, and for FP8 configurations the
    paired difference from BF16 (relative, per seed): mean, sample standard deviation, standard error of the mean,
    smallest and largest; for BF16 the relative spread of its own losses (standard deviation / mean). Rows that
    failed, or have no BF16 run of their seed to compare with, are left out of the differences."""
    losses: dict[tuple[str, str], list[float]] = defaultdict(list)
    deltas: dict[tuple[str, str], list[float]] = defaultdict(list)
    for row in rows:
        if "error" in row:
            continue
        key = (row["arch"], row["config"])
        losses[key].append(row["heldout_loss"])
        if row["config"] != "bf16" and row.get("heldout_delta") is not None:
            deltas[key].append(row["heldout_delta"])
    summary = []
    for (arch, config), values in losses.items():
        entry = {"arch": arch, "config": config, "seeds": len(values), "heldout_loss_mean": sum(values) / len(values)}
        if config == "bf16":
            entry["spread"] = _sd(values) / entry["heldout_loss_mean"] if len(values) > 1 else None
        elif deltas[(arch, config)]:
            d = deltas[(arch, config)]
            sd = _sd(d) if len(d) > 1 else None
            entry.update(delta_mean=sum(d) / len(d), delta_sd=sd,
                         delta_sem=None if sd is None else sd / math.sqrt(len(d)), delta_min=min(d), delta_max=max(d),
                         paired=len(d))
        summary.append(entry)
    return summary


def seed_markdown(summary: list[dict]) -> str:
    """The summary as a table: one line per configuration."""
    lines = ["| model | config | seeds | held-out loss (mean) | vs BF16, paired by seed: mean | sd | "
             "standard error | range | BF16's own spread |", "|---|---|---|---|---|---|---|---|---|"]

    def pct(value) -> str:
        return "" if value is None else f"{100 * value:+.2f}%"

    for s in summary:
        spread = "" if s.get("spread") is None else f"{100 * s['spread']:.2f}%"
        sd = "" if s.get("delta_sd") is None else f"{100 * s['delta_sd']:.2f}%"
        sem = "" if s.get("delta_sem") is None else f"{100 * s['delta_sem']:.2f}%"
        span = "" if "delta_min" not in s else f"{pct(s['delta_min'])} .. {pct(s['delta_max'])}"
        lines.append(f"| {s['arch']} | {s['config']} | {s['seeds']} | {s['heldout_loss_mean']:.4f} | "
                     f"{pct(s.get('delta_mean'))} | {sd} | {sem} | {span} | {spread} |")
    return "\n".join(lines) + "\n"


def _sd(values: list[float]) -> float:
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
