"""The main job: a short BF16 run, then the same run in FP8, and a table comparing them.

    lowprec demo                       # CPU: tiny model, FP8 emulated; GPU: the d=4096 proxy, compiled
    lowprec demo --backend torchao --recipe rowwise --steps 100 --out runs/demo
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import TYPE_CHECKING

import torch

from .data import TOKENIZATIONS
from .model import PRESETS, build_model, default_size
from .run import positive_int, worker_args

if TYPE_CHECKING:
    from ..planning.plan import PrecisionPlan


def plan_fp8_run(backend: str, recipe: str | None, opt_level: str | None, compiled: bool,
                 size: str) -> tuple[PrecisionPlan | None, str | None]:
    """The FP8 run's precision plan, or why that run would fail to start (bad backend/recipe/level, package
    missing): (plan, None) or (None, problem).

    Made before the BF16 run, so that a typo costs seconds, not a whole baseline run, and so that the plan is
    shown before any training: the same recipe, model shapes (on the meta device, no memory) and device as the
    FP8 process (lowprec.demo.run) prepares.
    """
    from ..backends import BackendUnavailableError, RunContext
    from ..frontend.recipe import FP8RecipeKwargs
    from ..planning.hardware import device_info
    from ..runtime.planner import build_plan

    try:
        fp8 = FP8RecipeKwargs(backend=backend, recipe=recipe, opt_level=opt_level)
        with torch.device("meta"):
            model = build_model(PRESETS[size], "llama", TOKENIZATIONS["bytes"])  # lowprec.demo.run's defaults
        return build_plan(model, fp8, context=RunContext(device=device_info(), compiled=compiled)), None
    except (ValueError, BackendUnavailableError) as exc:
        return None, str(exc)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="lowprec demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="auto")
    p.add_argument("--recipe", default=None)
    p.add_argument("--opt-level", default=None)
    p.add_argument("--size", choices=sorted(PRESETS), default=None,
                   help="model size (default: tiny on CPU, proxy on an FP8 GPU)")
    p.add_argument("--steps", type=positive_int, default=None,
                   help="optimizer steps per run (default 60 CPU, 40 GPU)")
    p.add_argument("--batch", type=positive_int, default=None)
    p.add_argument("--seq-len", type=positive_int, default=None)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--out", default=None, help="directory for each run's JSON and summary.json")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def format_table(bf16: dict, fp8: dict) -> str:
    rows = [("run", "first loss", "final loss", "held-out loss", "tokens/s", "vs BF16", "peak memory")]
    for r in (bf16, fp8):
        rows.append((
            r["label"] + (" (emulated)" if r["emulated"] else ""),
            f"{r['first_loss']:.4f}",
            f"{r['final_loss']:.4f}",
            f"{r['heldout_loss']:.4f}",
            f"{r['tokens_per_s']:,.0f}",
            "n/a" if r["emulated"] else f"{r['tokens_per_s'] / bf16['tokens_per_s']:.2f}x",
            _gib(r["peak_memory_bytes"]),
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    size = args.size or default_size()
    steps = args.steps if args.steps is not None else (40 if cuda else 60)
    out = args.out or tempfile.mkdtemp(prefix="lowprec-demo-")
    os.makedirs(out, exist_ok=True)
    common = worker_args(size, steps, args.batch, args.seq_len, args.compile)
    if args.no_progress:
        common.append("--no-progress")
    fp8_args = ["--backend", args.backend]
    if args.recipe:
        fp8_args += ["--recipe", args.recipe]
    if args.opt_level:
        fp8_args += ["--opt-level", args.opt_level]

    compiled = cuda if args.compile is None else args.compile  # as lowprec.demo.run decides
    plan, problem = plan_fp8_run(args.backend, args.recipe, args.opt_level, compiled, size)
    if problem is not None:
        print(f"lowprec demo: the FP8 run cannot start, so nothing was run: {problem}", file=sys.stderr)
        return 2

    preset = PRESETS[size]
    print(f"lowprec demo: Llama-style model '{size}' ({preset.note}), {steps} steps per run, "
          f"on {torch.cuda.get_device_name() if cuda else 'CPU'}; corpus: this Python's standard library source")
    # The plan before any training: what the FP8 run will convert, and what it costs in memory.
    print(f"\nthe FP8 run, planned before training:\n{plan}\n", flush=True)
    # The FP8 process would print the plan's summary at prepare(): the whole plan is already on screen.
    env = {**os.environ, "LOWPREC_QUIET": "1"}
    results = {}
    for variant, extra in (("bf16", []), ("fp8", fp8_args)):
        path = os.path.join(out, f"{variant}.json")
        cmd = [sys.executable, "-m", "lowprec.demo.run", "--variant", variant, *common, *extra, "--json", path]
        proc = subprocess.run(cmd, env=env)
        if proc.returncode != 0:
            print(f"lowprec demo: the {variant} run failed (exit {proc.returncode}); command:\n  {' '.join(cmd)}",
                  file=sys.stderr)
            return proc.returncode
        with open(path) as fh:
            results[variant] = json.load(fh)

    bf16, fp8 = results["bf16"], results["fp8"]
    if fp8["plan_text"] != str(plan):  # not expected: the plan shown was made for the same model, recipe and device
        print(f"\nthe FP8 run prepared another plan than the one shown before training:\n{fp8['plan_text']}")
    print()
    print(format_table(bf16, fp8))
    delta = (fp8["heldout_loss"] - bf16["heldout_loss"]) / bf16["heldout_loss"]
    print(f"\nheld-out loss, FP8 vs BF16: {100 * delta:+.2f}%")
    if fp8["emulated"]:
        print("speed: FP8 is emulated here (no FP8 GPU), so its tokens/s says nothing about FP8 speed; "
              "run on an H100/H200 for that.")
    elif size in ("tiny", "small"):
        print(f"speed: at this width FP8 does not pay for its casts ({preset.note}); --size proxy shows the gain.")
    with open(os.path.join(out, "summary.json"), "w") as fh:
        json.dump({"bf16": bf16, "fp8": fp8, "heldout_delta": delta,
                   "speedup": None if fp8["emulated"] else fp8["tokens_per_s"] / bf16["tokens_per_s"]}, fh, indent=1)
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
