"""`lowprec bench`: BF16 and FP8 configurations side by side, each trained in its own process.

    lowprec bench                                      # every available backend x recipe x level
    lowprec bench --configs bf16 torchao:tensorwise msamp:delayed:O2 --size proxy --steps 40
    lowprec bench --convergence --steps 300            # long enough to separate the loss curves
    lowprec bench --convergence --seeds 3 --jobs 6     # seeds 0..2 each, against BF16's seed and BF16's mean
    lowprec bench --arch mistral qwen2 --size small    # other transformers model classes
    lowprec bench --configs bf16 torchao:tensorwise torchao:tensorwise,skip_first_last=false --tokens pairs
                                                       # the output head in FP8 or not, at a 64K vocabulary
    lowprec bench --configs bf16 msamp:delayed:O2 msamp:delayed:O2,activation_dtype=fp8
                                                       # peak memory split: model state and the rest

A configuration is `bf16` or `backend:recipe[:level]`, optionally followed by `,skip_first_last=false` or
`,skip_slow_shapes=false` (either true|false), `,activation_dtype=fp8` (saved activations in FP8) and
`,activations_fp32=fp8|bf16|keep` (how those store FP32 tensors: LOWPREC_FP8_ACTIVATIONS_FP32) and
`,activations_in_graph=true|false` (inside compiled graphs or through the Python hooks:
LOWPREC_FP8_ACTIVATIONS_IN_GRAPH), so that each form is a configuration of its own, never pooled with another;
`,optimizer_states=fp32|bf16|fp16|fp8` stores Adam's moments so (FP8RecipeKwargs.optimizer_states);
`,amax_compute_algo=max|most_recent` sets a delayed recipe's (FP8RecipeKwargs.amax_compute_algo), and te's
`,te_first_scales=true|false` casts DelayedScaling's first step with scales from its own tensors or with TE's 1
(LOWPREC_TE_FIRST_SCALES), and te's `,fp8_weights=true|false` keeps its Linear weights in FP8 only with FP32 masters in
TE's FusedAdam (FP8RecipeKwargs.fp8_weights), for A/Bs paired with BF16 in one bench. Each runs `python -m
lowprec.demo.run` in a fresh process (Accelerate's state is a process-wide singleton, and peak memory and compile
caches must be the run's own) on the demo corpus: tokens/s (median step after warm-up), peak memory split into model
state (weights, gradients, optimizer states, measured) and the rest (saved activations, temporaries), what one forward
leaves held for backward, model-state bytes per parameter, losses and held-out loss. torchao configurations are also
trained with torchao driven directly in the same process (`--raw`), giving lowprec's overhead against the peer. Written
to --out: results.json, results.md (the table), throughput.png and loss.png.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

import torch

from .bench_configs import VALUE_OPTIONS, available_configs, config_problems, parse_config
from .data import TOKENIZATIONS
from .model import ARCHS, PRESETS, default_size
from .run import positive_int, worker_args
from .seeds import lowprec_environment, seed_markdown, seed_summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="lowprec bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", type=parse_config, default=None,
                   help="bf16 and/or backend:recipe[:level] (default: every one available here)")
    p.add_argument("--arch", nargs="+", choices=sorted(ARCHS), default=["llama"], help="transformers model classes")
    p.add_argument("--size", choices=sorted(PRESETS), default=None,
                   help="model size (default: proxy on an FP8 GPU, tiny elsewhere)")
    p.add_argument("--steps", type=positive_int, default=None, help="optimizer steps per run (default 30, 300 with "
                                                           "--convergence)")
    p.add_argument("--batch", type=positive_int, default=None)
    p.add_argument("--seq-len", type=positive_int, default=None)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile every run (default: on for CUDA)")
    p.add_argument("--convergence", action="store_true",
                   help="train long enough to separate the curves and report held-out loss against BF16")
    p.add_argument("--no-raw", action="store_true", help="skip the torchao-driven-directly comparison")
    p.add_argument("--tokens", choices=sorted(TOKENIZATIONS), default="bytes",
                   help="bytes (vocabulary 256) or byte pairs (65536: an output head the size of a real LLM's, "
                        "for judging FP8 in that head)")
    p.add_argument("--out", default=None, help="directory for results.json/.md and the plots")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--jobs", type=int, default=1,
                   help="runs at a time, spread over the GPUs (default 1). Above 1 the runs share GPUs and CPUs: "
                        "losses and peak memory are each run's own, speeds are not compared")
    p.add_argument("--seeds", type=int, default=1,
                   help="train each configuration with seeds 0..N-1 (initialisation and batch order) and compare "
                        "each with BF16's run of the same seed (mean, spread and range of the difference) and with "
                        "BF16's mean, unpaired (default 1)")
    p.add_argument("--first-seed", type=int, default=0,
                   help="with --seeds N: seeds FIRST..FIRST+N-1, to add runs to an earlier result's (pool them with "
                        "`python -m lowprec.demo.seeds A/results.json B/results.json`)")
    args = p.parse_args(argv)
    if args.first_seed < 0:
        p.error(f"--first-seed {args.first_seed}: give 0 or more")
    if args.first_seed and args.seeds < 2:
        p.error("--first-seed needs --seeds 2 or more (one run of each configuration takes no seed)")
    if args.seeds < 1:
        p.error(f"--seeds {args.seeds}: give at least 1 (runs of each configuration)")
    if args.steps is not None and args.steps < 2:
        p.error("--steps must be at least 2")
    if args.jobs < 1:
        p.error(f"--jobs {args.jobs}: give at least 1 (runs at a time)")
    return args


def visible_devices(count: int) -> list[str]:
    """The `count` devices this process sees, as its children must name them in CUDA_VISIBLE_DEVICES: the entries
    of this process's own CUDA_VISIBLE_DEVICES where it is set (an index, a UUID, a MIG name), else 0..count-1.
    A child given its parent's index instead (`CUDA_VISIBLE_DEVICES=1 lowprec bench --jobs 4` ran its jobs on GPU
    0) shares another's device."""
    visible = [entry.strip() for entry in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if entry.strip()]
    return visible[:count] if "CUDA_VISIBLE_DEVICES" in os.environ else [str(i) for i in range(count)]


def run_one(config: dict, arch: str, common: list[str], out: str, raw: bool, gpu: str | None = None,
            seed: int | None = None) -> dict:
    """One training of `config` in a process of its own (`seed`: the run's, named in its file; None: the default)."""
    name = config["name"].replace(":", "_").replace(",", "_").replace("=", "-")
    path = os.path.join(out, f"{arch}_{name}" + ("" if seed is None else f"_seed{seed}") + ".json")
    cmd = [sys.executable, "-m", "lowprec.demo.run", "--arch", arch, *common, "--json", path, "--no-progress"]
    if seed is not None:
        cmd += ["--seed", str(seed)]
    if config["backend"] is None:
        cmd += ["--variant", "bf16"]
    else:
        cmd += ["--variant", "fp8", "--backend", config["backend"], "--recipe", config["recipe"]]
        if config["opt_level"]:
            cmd += ["--opt-level", config["opt_level"]]
        for key, value in config["options"].items():
            flag = key.replace("_", "-")
            cmd += [f"--{flag}", value] if key in VALUE_OPTIONS else [f"--{'' if value else 'no-'}{flag}"]
        if raw and config["backend"] == "torchao" and not config["opt_level"]:
            cmd.append("--raw")
    env = None if gpu is None else {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        return {"config": config["name"], "arch": arch, "seed": seed,
                "error": proc.stderr.strip().splitlines()[-1:] or ["?"], "command": " ".join(cmd)}
    with open(path) as fh:
        result = json.load(fh)
    result["config"] = config["name"]
    result["seed"] = seed
    return result


def summarise(results: list[dict], speeds: bool = True) -> list[dict]:
    """Per run: the ratios against the BF16 run of the same model class and seed (speeds=False: runs that shared a
    device, whose speeds are not compared)."""
    base = {(r["arch"], r.get("seed")): r for r in results if r.get("config") == "bf16" and "error" not in r}
    rows = []
    for r in results:
        row = {"arch": r["arch"], "config": r["config"]}
        if r.get("seed") is not None:
            row["seed"] = r["seed"]
        if "error" in r:
            row["error"] = r["error"][-1]
            rows.append(row)
            continue
        b = base.get((r["arch"], r.get("seed")))
        state = r["model_state_bytes_per_param"]["all_params"]["total"]
        split = r.get("peak_split") or {}
        gib = {k: None if split.get(k) is None else split[k] / 2**30
               for k in ("model_state_bytes", "rest_bytes", "held_by_forward_bytes")}
        row.update(tokens_per_s=r["tokens_per_s"], step_ms=r["step_ms_median"], peak_gib=r["peak_memory_bytes"] / 2**30,
                   state_gib=gib["model_state_bytes"], rest_gib=gib["rest_bytes"],
                   held_by_forward_gib=gib["held_by_forward_bytes"],
                   state_bytes=state, heldout_loss=r["heldout_loss"], emulated=r["emulated"],
                   overhead_vs_raw=r.get("overhead_vs_raw"))
        if b is not None:
            row["speedup"] = None if r["emulated"] or not speeds else r["tokens_per_s"] / b["tokens_per_s"]
            if r.get("peak_memory_kind") == "cuda max_memory_allocated":
                row["peak_vs_bf16"] = r["peak_memory_bytes"] / b["peak_memory_bytes"]
            row["heldout_delta"] = (r["heldout_loss"] - b["heldout_loss"]) / b["heldout_loss"]
        rows.append(row)
    return rows


def markdown(rows: list[dict], header: str) -> str:
    lines = [header, "", "| model | config | tokens/s | vs BF16 | peak GiB | vs BF16 | model state GiB | rest GiB "
             "| held by a forward GiB | state B/param | held-out loss | vs BF16 | overhead vs raw torchao |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def gib(value) -> str:
        return "" if value is None else f"{value:.2f}"

    for r in rows:
        config = r["config"] + ("" if r.get("seed") is None else f" (seed {r['seed']})")
        if "error" in r:
            lines.append(f"| {r['arch']} | {config} | failed: {r['error']} |" + " |" * 10)
            continue
        peak_ratio = "" if r.get("peak_vs_bf16") is None else f"{r['peak_vs_bf16']:.3f}x"
        speed = (f"{r['speedup']:.3f}x" if r.get("speedup") is not None
                 else "n/a (emulated)" if r.get("emulated") else "not compared" if "heldout_delta" in r else "")
        delta = "" if "heldout_delta" not in r else f"{100 * r['heldout_delta']:+.2f}%"
        over = "" if r.get("overhead_vs_raw") is None else f"{100 * r['overhead_vs_raw']:+.1f}%"
        if over and r["emulated"]:
            over += " (emulated: not an FP8 figure)"
        lines.append(f"| {r['arch']} | {config} | {r['tokens_per_s']:,.0f} | {speed} | {r['peak_gib']:.2f} | "
                     f"{peak_ratio} | {gib(r.get('state_gib'))} | {gib(r.get('rest_gib'))} | "
                     f"{gib(r.get('held_by_forward_gib'))} | {r['state_bytes']:.1f} | {r['heldout_loss']:.4f} | "
                     f"{delta} | {over} |")
    if any(r.get("emulated") for r in rows if "error" not in r):
        # a CPU run's FP8 columns time stand-in casts and high-precision matmuls: large, and meaningless for a GPU
        lines += ["", "Emulated runs (no FP8 GPU here): their tokens/s and overhead time the FP8 casts and "
                  "high-precision matmuls that stand in for FP8 on this machine, not FP8 speed; the loss and the "
                  "state bytes/param are what they would be on a GPU. Peak memory is the process's RSS, so its "
                  "split (rest, held by a forward) is left empty."]
    return "\n".join(lines) + "\n"


def plot(results: list[dict], rows: list[dict], out: str) -> list[str]:
    """throughput.png (tokens/s per configuration, BF16 marked) and loss.png (training loss curves)."""
    try:
        import matplotlib
    except ImportError:
        print("lowprec bench: matplotlib is not installed, so no plots were drawn (pip install matplotlib)",
              file=sys.stderr)
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    ok = [r for r in rows if "error" not in r]
    if ok:
        fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(ok)), 4))
        labels = [f"{r['arch']}\n{r['config']}" for r in ok]
        colors = ["#888888" if r["config"] == "bf16" else "#3b75af" for r in ok]
        ax.bar(range(len(ok)), [r["tokens_per_s"] for r in ok], color=colors)
        ax.set_xticks(range(len(ok)), labels, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("tokens/s (median step)")
        emulated = any(r["emulated"] for r in ok)
        ax.set_title("throughput" + (" (FP8 emulated: not a speed measurement)" if emulated else ""))
        fig.tight_layout()
        path = os.path.join(out, "throughput.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        made.append(path)
    curves = [r for r in results if "error" not in r]
    if curves:
        fig, ax = plt.subplots(figsize=(7, 4))
        for r in curves:
            seed = "" if r.get("seed") is None else f" seed {r['seed']}"
            ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=f"{r['arch']} {r['config']}{seed}",
                    linewidth=1.6 if r["config"] == "bf16" else 1.0)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("training loss")
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(out, "loss.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        made.append(path)
    return made


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    size = args.size or default_size()
    steps = args.steps or (300 if args.convergence else 30)
    compiled = cuda if args.compile is None else args.compile
    skipped: dict[str, str] = {}
    configs = args.configs or [parse_config(name) for name in available_configs(compiled, skipped)]
    for reason in sorted(set(skipped.values())):  # said, not silently dropped: a missing package, no FP8 GPU
        names = [name for name, why in skipped.items() if why == reason]
        print(f"lowprec bench: not run here ({', '.join(names)}): {reason}", file=sys.stderr)
    problems, of_mode = config_problems(args.configs or [], compiled)  # the defaults passed the same check above
    if problems:
        mode = "compiled (--compile; --no-compile runs every configuration eager, BF16 too)" if compiled else "eager"
        print("lowprec bench: nothing run: " + "; ".join(problems) + (f". This bench runs {mode}." if of_mode else ""),
              file=sys.stderr)
        return 2
    if not any(c["name"] == "bf16" for c in configs):
        configs.insert(0, parse_config("bf16"))  # every ratio is against BF16 measured the same way
    out = args.out or tempfile.mkdtemp(prefix="lowprec-bench-")
    os.makedirs(out, exist_ok=True)
    common = worker_args(size, steps, args.batch, args.seq_len, compiled, args.tokens)

    from tqdm.auto import tqdm

    seeds = list(range(args.first_seed, args.first_seed + args.seeds)) if args.seeds > 1 else [None]
    jobs = [(arch, c, seed) for seed in seeds for arch in args.arch for c in configs]
    device = torch.cuda.get_device_name() if cuda else "CPU"
    print(f"lowprec bench: {len(jobs)} runs ({size}, {steps} steps each, {'compiled' if compiled else 'eager'}) "
          f"on {device}, each in its own process; results in {out}", flush=True)
    bar = tqdm(total=len(jobs), disable=args.no_progress, file=sys.stderr, dynamic_ncols=True)
    gpus = visible_devices(torch.cuda.device_count()) if cuda else []

    def one(index: int) -> dict:
        arch, config, seed = jobs[index]
        gpu = gpus[index % len(gpus)] if gpus and args.jobs > 1 else None
        result = run_one(config, arch, common, out, raw=not args.no_raw, gpu=gpu, seed=seed)
        bar.update(1)
        return result

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:  # each run is a process: threads only wait
        results = list(pool.map(one, range(len(jobs))))
    bar.close()
    rows = summarise(results, speeds=args.jobs == 1)
    header = (f"lowprec bench: {size} ({PRESETS[size].note}), {steps} steps, "
              f"{'compiled' if compiled else 'eager'}, {device}, torch {torch.__version__}"
              + ("" if args.jobs == 1 else f", {args.jobs} runs at a time over {max(len(gpus), 1)} device(s): "
                 "speeds not compared"))
    table = markdown(rows, header)
    by_seed = seed_summary(rows) if args.seeds > 1 else None
    if by_seed is not None:
        table += (f"\nOver {args.seeds} seeds (each FP8 run against BF16's of its seed, and against BF16's mean):\n\n"
                  + seed_markdown(by_seed))
    with open(os.path.join(out, "results.json"), "w") as fh:
        json.dump({"size": size, "steps": steps, "tokens": args.tokens, "compiled": compiled, "device": device,
                   "jobs": args.jobs, "seeds": args.seeds, "seed_summary": by_seed,
                   "torch": torch.__version__, "environment": lowprec_environment(),
                   "convergence": args.convergence, "rows": rows, "runs": results}, fh, indent=1)
    with open(os.path.join(out, "results.md"), "w") as fh:
        fh.write(table)
    plots = plot(results, rows, out)
    print(table)
    if plots:
        print("plots: " + ", ".join(plots))
    failed = [r for r in rows if "error" in r]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
