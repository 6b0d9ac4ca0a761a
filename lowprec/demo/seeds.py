"""Held-out loss over several seeds: how far an FP8 configuration's loss is from BF16's, next to how far BF16's own
moves from seed to seed.

`lowprec bench --seeds N` trains every configuration with seeds 0..N-1. A seed fixes the initialisation and the
order of the training batches (`lowprec.demo.run --seed`; the held-out batches are the same for every run), so each
FP8 run is compared with the BF16 run of its own seed: the paired difference leaves out what the seed changes.
On a GPU a seed does not fix the run, though: kernels that add in a varying order (atomics, split reductions) made
BF16's held-out loss of one seed move up to 1.6% between three 300-step runs of the d4096 proxy, as much as between
seeds (results/gpu/2026-11-28-h200x2-act8-seeds-6db774f). So each configuration's mean is also compared with BF16's
mean, unpaired, with the standard error of that difference (Welch's: each side's own variance), and
`python -m lowprec.demo.seeds RESULTS.json ...` pools the runs of several `lowprec bench` results into one table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections import defaultdict


def seed_summary(rows: list[dict]) -> list[dict]:
    """Per (model class, configuration) over its seeds: the held-out loss's mean, and for FP8 configurations the
    paired difference from BF16 (relative, per seed): mean, sample standard deviation, standard error of the mean,
    smallest and largest; against BF16's mean, unpaired: the relative difference of the means (`vs_mean`) and its
    standard error (`vs_mean_sem`, None below two runs on either side); for BF16 the relative spread of its own
    losses (standard deviation / mean). Rows that failed, or have no BF16 run of their seed to compare with, are
    left out of the paired differences."""
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
        bf16 = losses.get((arch, "bf16"))
        if config == "bf16":
            entry["spread"] = _sd(values) / entry["heldout_loss_mean"] if len(values) > 1 else None
            summary.append(entry)
            continue
        if bf16:
            base = sum(bf16) / len(bf16)
            entry["vs_mean"] = entry["heldout_loss_mean"] / base - 1
            entry["vs_mean_sem"] = (math.sqrt(_sd(values) ** 2 / len(values) + _sd(bf16) ** 2 / len(bf16)) / base
                                    if len(values) > 1 and len(bf16) > 1 else None)
        if deltas[(arch, config)]:
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
             "standard error | range | vs BF16's mean, unpaired | standard error | BF16's own spread |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]

    def pct(value) -> str:
        return "" if value is None else f"{100 * value:+.2f}%"

    for s in summary:
        spread = "" if s.get("spread") is None else f"{100 * s['spread']:.2f}%"
        sd = "" if s.get("delta_sd") is None else f"{100 * s['delta_sd']:.2f}%"
        sem = "" if s.get("delta_sem") is None else f"{100 * s['delta_sem']:.2f}%"
        span = "" if "delta_min" not in s else f"{pct(s['delta_min'])} .. {pct(s['delta_max'])}"
        unpaired_sem = "" if s.get("vs_mean_sem") is None else f"{100 * s['vs_mean_sem']:.2f}%"
        lines.append(f"| {s['arch']} | {s['config']} | {s['seeds']} | {s['heldout_loss_mean']:.4f} | "
                     f"{pct(s.get('delta_mean'))} | {sd} | {sem} | {span} | {pct(s.get('vs_mean'))} | "
                     f"{unpaired_sem} | {spread} |")
    return "\n".join(lines) + "\n"


# LOWPREC_* variables that change nothing a run computes: the tree's name, the console's messages
_NOT_TRAINING = ("LOWPREC_COMMIT", "LOWPREC_QUIET")


def lowprec_environment() -> dict[str, str]:
    """The LOWPREC_* variables set for a bench: they change what a configuration's name says it ran (where FP8
    activations are stored, how their FP32 tensors are), so results made under different ones are not pooled."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("LOWPREC_") and k not in _NOT_TRAINING}


def pooled_rows(paths: list[str]) -> list[dict]:
    """The rows of several `lowprec bench` results.json files, for one summary. Each file's paired differences stay
    against its own BF16 runs. Refused, since their losses differ: files of different sizes, step counts or modes
    (compiled or eager), and files whose benches ran under different LOWPREC_* variables (a file older than that
    record counts as none set)."""
    rows, shapes, environments = [], {}, {}
    for path in paths:
        with open(path) as fh:
            result = json.load(fh)
        if "rows" not in result:
            raise ValueError(f"{path}: not a `lowprec bench` results.json (no 'rows')")
        shapes[path] = (result.get("size"), result.get("steps"), result.get("tokens"), result.get("compiled"))
        environments[path] = result.get("environment") or {}
        rows += result["rows"]
    if len(set(shapes.values())) > 1:
        raise ValueError("results of different runs cannot be pooled: (size, steps, tokens, compiled) "
                         + ", ".join(f"{p}: {v}" for p, v in shapes.items()))
    if len({json.dumps(e, sort_keys=True) for e in environments.values()}) > 1:
        raise ValueError("results made under different LOWPREC_* variables cannot be pooled (a configuration's name "
                         "would stand for two forms; name the form in the configuration instead, e.g. "
                         "',activations_in_graph=false'): " + ", ".join(f"{p}: {e}" for p, e in environments.items()))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lowprec.demo.seeds",
                                     description="Pool the runs of several `lowprec bench` results into one table.")
    parser.add_argument("results", nargs="+", help="results.json files written by `lowprec bench --out`")
    args = parser.parse_args(argv)
    try:
        rows = pooled_rows(args.results)
    except (OSError, ValueError) as exc:
        parser.error(str(exc))
    print(f"Pooled over {len(args.results)} results:\n\n" + seed_markdown(seed_summary(rows)), end="")
    return 0


def _sd(values: list[float]) -> float:
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


if __name__ == "__main__":
    raise SystemExit(main())
