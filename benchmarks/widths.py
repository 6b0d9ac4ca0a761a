"""lowprec's default FP8 configurations against compiled BF16 at several model widths (issue 18, first step).

The command of results/gpu/2026-11-23-h100-widths (one H100, torchao from .gpubundle):

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpubundle/torchao-*.whl
    export PYTHONPATH=/tmp/site:$PWD
    timeout 565 python3 benchmarks/widths.py --widths d1024 d2048 d4096 d8192 --steps 20 --warmup 10 \\
        --profile d4096 --out $OUT/widths.json --profile-dir $OUT
    # msamp O2 past its 16 warm-up steps (see below), a second call:
    timeout 262 python3 benchmarks/widths.py --widths d1024 d2048 --configs bf16 "msamp O2" --steps 28 --warmup 18 \\
        --profile d2048 --profile-configs bf16 "msamp O2" --out $OUT/widths_msamp_steady.json --profile-dir $OUT

On CPU (what tests/test_benchmarks.py runs; FP8 emulated, nothing timed that means anything):

    python benchmarks/widths.py --widths tiny --vocab 512 --steps 3 --warmup 1 --profile tiny --out /tmp/widths.json

Model: a Llama-style `transformers` decoder built from a config (random init, vocab 32000, SwiGLU,
heads = d/128, untied lm_head), batch 4 x 2048 tokens of random ids:

    d1024: 8 layers, ffn 2816     d2048: 4 layers, ffn 5632
    d4096: 4 layers, ffn 14336    d8192: 2 layers, ffn 28672   (tiny: d64, 2 layers, CPU-sized)

Configurations, each with the same training step as benchmarks/levels.py's `run_one` (forward with
labels, `accelerator.backward`, optimizer step, zero_grad, `loss.item()`), torch AdamW(fused=True) as
the optimizer handed to `prepare()`, and torch.compile (inductor) through Accelerate's dynamo plugin:
- "bf16":            lowprec.Accelerator(mixed_precision="bf16")
- "torchao default": FP8RecipeKwargs(backend="torchao", recipe="tensorwise"), skip_first_last and
                     skip_slow_shapes as lowprec defaults them (the plan's converted Linears are recorded)
- "torchao all":     the same with skip_first_last=False, skip_slow_shapes=False (every Linear, as levels.py)
- "msamp O2":        FP8RecipeKwargs(backend="msamp", opt_level="O2"), defaults otherwise
- "raw torchao":     no lowprec: torchao.float8.convert_to_float8_training(model) (tensorwise, every
                     Linear but lm_head), then plain accelerate.Accelerator(mixed_precision="bf16")
- "te default":      FP8RecipeKwargs(backend="te"), lowprec's defaults (delayed scaling in an eager model,
                     current scaling compiled): what backend="auto" picks for an eager model where TE is
                     installed ("te all": every Linear, skip_slow_shapes=False). Needs transformer_engine
                     (`bash .gpubundle/setup.sh` on the GPU host):

    timeout 400 python benchmarks/widths.py --compile none --widths d2048 d1024 d4096 d8192 \
        --configs bf16 "te default" --steps 16 --warmup 8 --out $OUT/te_eager.json

`--compile regional` (the default) is Accelerate's regional compilation (`use_regional_compilation=True`):
each decoder layer is compiled (the layers share one compiled graph; a layer whose modules differ, such
as layers.0 when skip_first_last keeps its q_proj in BF16, gets its own) and so is every other leaf
module (embedding, final norm, lm_head, rotary embedding); the causal-LM loss, which `transformers`
computes outside those modules, is compiled as one function. That compiles one layer per
configuration instead of all of them, which is what lets 20 configurations fit one device call.
`--compile full` compiles the whole model as levels.py does. `--compile none` runs every model eager,
as a user who sets no `dynamo_backend` does; lowprec then compiles each FP8 layer on its own
(`compile_fp8_layers`, on by default for torchao), which "torchao eager layers" turns off:

    timeout 500 python benchmarks/widths.py --compile none --widths d1024 d2048 d4096 d8192 \
        --configs bf16 "torchao default" "torchao eager layers" --steps 16 --warmup 8 --out $OUT/eager.json

Per run: median step time after `--warmup` steps, tokens/s, peak CUDA memory (reset after prepare,
as levels.py), the first step's seconds (compilation), the CUDA memory still allocated when the run
started (a leftover from the run before would inflate its peak), dynamo's graph and recompile counts,
and for FP8 runs the precision plan's converted and kept Linear layers by shape. `--profile WIDTH`
adds a torch.profiler table (top 25 kernels by self CUDA time) for `--profile-configs` at that width,
from `--profile-steps` extra steps after the timed ones, and a per-category breakdown of the kernel
time (GEMM, attention, amax, FP8 cast, transpose, dtype cast, optimizer, other: a heuristic on kernel
names, `CATEGORIES`).
The JSON is rewritten after every run, so a time limit keeps what finished; `widths.py --summarize
RESULT.json` prints it as Markdown (the README's table).

`--rounds R` runs every configuration R times per width in ABBA order (as given, reversed, as given,
...), each run a fresh model and Accelerator. A step bound by the host (compiled d1024: 23-81 ms)
measured 0.92-0.97x BF16 for the BF16 model itself, run after BF16 (results/gpu/2026-11-23-h100-speed-head):
the order may be part of that. Each run's record keeps round
0's details and lists every round's median step (`rounds`, with the run's position in that round);
`step_ms_median` and `speedup_vs_bf16` are then taken from the medians over the rounds.

msamp's delayed scaling scales from the tensor's own amax for its first `amax_history_len` (16) steps and
then switches to the window's scales, which dynamo compiles as a second graph at step 17: to time
msamp's steady state, give it `--steps 28 --warmup 18` (results/gpu/2026-11-23-h100-widths, call 2).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import sys
import time
import traceback
from collections import Counter

import torch

from lowprec.demo.model import ModelPreset, llama_config

VOCAB = 32000

# name -> (hidden, layers, ffn, seq_len, batch); heads = hidden / 128
WIDTHS: dict[str, tuple[int, int, int, int, int]] = {
    "tiny": (64, 2, 256, 32, 2),
    "d1024": (1024, 8, 2816, 2048, 4),
    "d2048": (2048, 4, 5632, 2048, 4),
    "d4096": (4096, 4, 14336, 2048, 4),
    "d8192": (8192, 2, 28672, 2048, 4),
}

# label -> FP8RecipeKwargs fields (None: BF16; "raw": torchao without lowprec)
CONFIGS: dict[str, dict | str | None] = {
    "bf16": None,
    "torchao default": dict(backend="torchao", recipe="tensorwise"),
    "torchao all": dict(backend="torchao", recipe="tensorwise", skip_first_last=False, skip_slow_shapes=False),
    "raw torchao": "raw",
    "msamp O2": dict(backend="msamp", opt_level="O2"),
    # the output head (and first Linear) in FP8 too, every other default kept (skip_slow_shapes on)
    "torchao head": dict(backend="torchao", recipe="tensorwise", skip_first_last=False),
    "msamp O2 head": dict(backend="msamp", opt_level="O2", skip_first_last=False),
    # eager models (--compile none): lowprec's default compiles each FP8 layer (compile_fp8_layers); this one does not
    "torchao eager layers": dict(backend="torchao", recipe="tensorwise", compile_fp8_layers=False),
    # msamp's layers compiled one by one in an eager model (its default keeps them eager: not yet measured)
    "msamp O2 compiled layers": dict(backend="msamp", opt_level="O2", compile_fp8_layers=True),
    # TransformerEngine with lowprec's defaults: what backend="auto" picks for an eager model where TE is installed
    "te default": dict(backend="te"),
    "te all": dict(backend="te", skip_slow_shapes=False),
}
# Not run unless named in --configs (what they measure is a question of its own, or a package most hosts lack).
OPT_IN_CONFIGS = ("torchao eager layers", "msamp O2 compiled layers", "torchao head", "msamp O2 head", "te default",
                  "te all")

PROFILE_CONFIGS = ["bf16", "torchao default", "msamp O2"]

# First match wins, so the order matters: lowprec's LowBitAdamW kernels are named amax_pass / update_pass,
# a fused "abs_max" reduction is the amax pass even where it also casts, and "fp8 cast" (clamp, FP8 dtypes,
# msamp's cast_transpose) comes before plain dtype casts; a fused kernel that does more than cast (an RMSNorm
# with its BF16 output, say) is "other".
CATEGORIES: list[tuple[str, tuple[str, ...]]] = [
    ("attention", ("flash", "fmha", "sdpa", "attention", "attn")),
    ("optimizer", ("adam", "multi_tensor", "foreach", "lowbit", "update_pass", "amax_pass", "reduce_pass",
                   "scale_kernel")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "_mm_", "scaled_mm", "matmul", "sm90_")),
    ("amax", ("amax", "abs_max", "_abs_")),
    ("fp8 cast", ("cast_transpose", "clamp", "float8", "fp8", "e4m3", "e5m2")),
    ("transpose", ("transpose", "permute", "clone", "contiguous")),
    ("dtype cast", ("copy_kernel", "direct_copy")),
]
# an inductor kernel that only casts (autocast's BF16 copies of FP32 weights, say): triton_poi_fused__to_copy_3
_ONLY_CAST = re.compile(r"triton_\w+?_fused__to_copy(_view|_t|_clone)*_\d+$")


def preset(width: str) -> ModelPreset:
    hidden, layers, ffn, seq, batch = WIDTHS[width]
    return ModelPreset(hidden, layers, max(1, hidden // 128), ffn, seq, batch, 1e-4, width)


def batches(width: str, steps: int, vocab: int) -> list[torch.Tensor]:
    p = preset(width)
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (p.batch, p.seq_len), generator=g) for _ in range(steps)]


def category(name: str) -> str:
    low = name.lower()
    if _ONLY_CAST.search(low):
        return "dtype cast"
    for cat, keys in CATEGORIES:
        # inductor names a fused kernel after the ops it feeds: "triton_poi_fused__scaled_mm_..._clamp" casts
        # the inputs of an FP8 GEMM; the GEMMs themselves run in cuBLAS (nvjet_*) outside Triton here.
        if cat == "gemm" and low.startswith("triton_"):
            continue
        if any(k in low for k in keys):
            return cat
    return "other"


def _dynamo_limits() -> None:
    # A layer graph per decoder layer would fall back to eager past the limit: keep it compiled, and count it.
    for attr, value in (("recompile_limit", 64), ("cache_size_limit", 64), ("accumulated_recompile_limit", 1024)):
        if hasattr(torch._dynamo.config, attr):
            setattr(torch._dynamo.config, attr, value)


def _plan_summary(plan) -> dict:
    def by_shape(decisions) -> dict:
        return dict(Counter(f"{d.shape[0]}x{d.shape[1]}" for d in decisions))

    linears = [m for m in plan.modules if m.kind == "linear"]
    kept = [m for m in linears if not m.convert]
    return {
        "linears": len(linears),
        "converted": sum(m.convert for m in linears),
        "converted_modules": len(plan.converted),  # norms too, where a backend converts them
        "converted_shapes_NxK": by_shape(m for m in linears if m.convert),
        "kept": [{"fqn": m.fqn, "NxK": f"{m.shape[0]}x{m.shape[1]}", "rule": m.rule, "reason": m.reason}
                 for m in kept],
        "fp8_linear_param_fraction": plan.fp8_linear_param_fraction,
        "emulated": plan.emulated,
        "execution": plan.execution,
    }


def profile_steps(step, data, cuda: bool, path: str | None) -> dict:
    """`step` over `data` under torch.profiler: the top kernels per step, kernel time by `category`, and the
    table written to `path` (also used by headline.py's `--profile-dir`)."""
    from torch.profiler import ProfilerActivity, profile

    activity = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        for ids in data:
            step(ids)
        if cuda:
            torch.cuda.synchronize()
    events = prof.key_averages()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    table = events.table(sort_by=key, row_limit=25, max_name_column_width=110)
    totals: Counter = Counter()
    for evt in events:
        totals[category(evt.key)] += getattr(evt, key)
    all_us = sum(totals.values()) or 1.0
    n = len(data)
    top = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:40]
    result = {
        "steps": n,
        "top": [{"name": e.key[:200], "ms_per_step": getattr(e, key) / 1000 / n, "calls_per_step": e.count / n,
                 "category": category(e.key)} for e in top],
        "kernel_ms_per_step": sum(totals.values()) / 1000 / n,
        "by_category_ms_per_step": {k: v / 1000 / n for k, v in totals.most_common()},
        "by_category_share": {k: v / all_us for k, v in totals.most_common()},
    }
    if path:
        with open(path, "w") as fh:
            fh.write(f"{n} steps; kernel time by category (ms/step): "
                     + ", ".join(f"{k} {v:.2f}" for k, v in result["by_category_ms_per_step"].items()) + "\n\n")
            fh.write(table)
    result["table"] = path
    return result


def run_one(label: str, width: str, data: list[torch.Tensor], args, profile_path: str | None) -> dict:
    """One configuration at one width: levels.py's run_one with the width's model, the recipe as the
    configuration gives it (lowprec defaults included) and an optional profile after the timed steps."""
    from accelerate import Accelerator as PlainAccelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import TorchDynamoPlugin
    from transformers import LlamaForCausalLM
    from transformers.loss.loss_utils import LOSS_MAPPING

    from lowprec import Accelerator, FP8RecipeKwargs

    spec = CONFIGS[label]
    cuda = torch.cuda.is_available()
    leftover = torch.cuda.memory_allocated() / 2**30 if cuda else None
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    torch._dynamo.utils.counters.clear()
    dynamo = (TorchDynamoPlugin(backend="no") if args.compile == "none" else
              TorchDynamoPlugin(backend=args.dynamo_backend, use_regional_compilation=args.compile == "regional"))
    if spec is None:
        accelerator = Accelerator(mixed_precision="bf16", dynamo_plugin=dynamo)
    elif spec == "raw":
        accelerator = PlainAccelerator(mixed_precision="bf16", dynamo_plugin=dynamo)
    else:
        accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[FP8RecipeKwargs(**spec)],
                                  dynamo_plugin=dynamo)
    torch.manual_seed(0)
    with torch.device(accelerator.device):  # random init on the GPU: seconds, not minutes, at d8192
        model = LlamaForCausalLM(llama_config(preset(width), vocab_size=args.vocab))
    # Training: no KV cache (transformers would fill one every step, and its per-layer state makes
    # dynamo compile every decoder layer anew under regional compilation).
    model.config.use_cache = False
    if args.compile == "regional":
        # transformers computes the loss in the top-level forward, outside every compiled region.
        model.loss_function = torch.compile(LOSS_MAPPING["ForCausalLM"], backend=args.dynamo_backend)
    if spec == "raw":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, module_filter_fn=lambda mod, fqn: fqn != "lm_head",
                                   config=Float8LinearConfig(emulate=not cuda))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    if cuda:
        torch.cuda.reset_peak_memory_stats()

    def step(ids: torch.Tensor) -> float:
        ids = ids.to(accelerator.device, non_blocking=True)
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()  # synchronises

    times, losses = [], []
    for ids in data:
        t0 = time.perf_counter()
        losses.append(step(ids))
        times.append(time.perf_counter() - t0)
    median = statistics.median(times[args.warmup:])
    result = {
        "step_ms_median": 1000 * median,
        "step_ms_min": 1000 * min(times[args.warmup:]),
        "step_ms_max": 1000 * max(times[args.warmup:]),
        "step_ms": [round(1000 * t, 3) for t in times],
        "tokens_per_s": data[0].numel() / median,
        "first_step_s": times[0],
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "allocated_at_start_gib": leftover,
        "optimizer": type(getattr(optimizer, "optimizer", optimizer)).__name__,
        "dynamo": {k: dict(v) for k, v in torch._dynamo.utils.counters.items()
                   if k in ("stats", "recompiles", "graph_break", "frames")},
    }
    plan = getattr(accelerator, "precision_plan", None)
    if plan is not None:
        result["plan"] = _plan_summary(plan)
    elif spec == "raw":
        from torchao.float8.float8_linear import Float8Linear

        inner = accelerator.unwrap_model(model, keep_torch_compile=False)
        result["plan"] = {"linears": sum(isinstance(m, torch.nn.Linear) for m in inner.modules()),
                          "converted": sum(isinstance(m, Float8Linear) for m in inner.modules())}
    if profile_path is not None:
        result["profile"] = profile_steps(step, data[: args.profile_steps], cuda, profile_path)
    return result


def _cleanup() -> None:
    torch._dynamo.reset()  # first: compiled code holds the last model's parameters
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def markdown(results: dict) -> str:
    """The results as a Markdown table (width x configuration) and, where profiled, the kernel time per
    step by category, recomputed from the recorded top kernels with `category` as it stands now."""
    rows = ["| width | configuration | step ms (median) | timed min-max | vs BF16 | peak GiB | FP8 Linears |",
            "|---|---|---|---|---|---|---|"]
    profiles = []
    for width, entry in results["widths"].items():
        for label, r in entry["runs"].items():
            if "step_ms_median" not in r:
                rows.append(f"| {width} | {label} | {r.get('error', '')[:100]} | | | | |")
                continue
            conv = f"{r['plan']['converted']}/{r['plan']['linears']}" if "plan" in r else "-"
            ratio = f"{r['speedup_vs_bf16']:.3f}" if "speedup_vs_bf16" in r else "1"
            peak = f"{r['peak_gib']:.2f}" if r["peak_gib"] is not None else "-"
            rows.append(f"| {width} | {label} | {r['step_ms_median']:.2f} | {r['step_ms_min']:.1f}-"
                        f"{r['step_ms_max']:.1f} | {ratio} | {peak} | {conv} |")
            if "profile" in r:
                cats: Counter = Counter()
                for t in r["profile"]["top"]:
                    cats[category(t["name"])] += t["ms_per_step"]
                cats["rest (beyond the top kernels)"] = r["profile"]["kernel_ms_per_step"] - sum(cats.values())
                profiles.append(f"- {width} {label}: kernels {r['profile']['kernel_ms_per_step']:.2f} ms/step "
                                f"(step median {r['step_ms_median']:.2f}): "
                                + ", ".join(f"{k} {v:.2f}" for k, v in cats.most_common()))
    return "\n".join(rows + ([""] + profiles if profiles else []))


def main(argv: list[str] | None = None) -> dict:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--summarize"]:  # widths.py --summarize RESULT.json ...: Markdown of earlier runs
        for path in argv[1:]:
            with open(path) as fh:
                print(markdown(json.load(fh)) + "\n")
        return {}
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--widths", nargs="+", default=["d1024", "d2048", "d4096", "d8192"], choices=list(WIDTHS))
    p.add_argument("--configs", nargs="+",
                   default=[c for c in CONFIGS if c not in OPT_IN_CONFIGS],
                   choices=list(CONFIGS),
                   help="run in this order within each width ('bf16' first: the ratios need it)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every configuration this many times, in ABBA order; ratios from the medians over rounds")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=10, help="steps left out of the timing (compile, warm-up)")
    p.add_argument("--vocab", type=int, default=VOCAB)
    p.add_argument("--compile", choices=["regional", "full", "none"], default="regional",
                   help="none: eager models, as a user who sets no dynamo_backend runs them")
    p.add_argument("--dynamo-backend", default="inductor")
    p.add_argument("--profile", nargs="*", default=[], choices=list(WIDTHS), help="widths to profile")
    p.add_argument("--profile-configs", nargs="+", default=PROFILE_CONFIGS, choices=list(CONFIGS))
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--profile-dir", default=None, help="where the profiler tables go (default: beside --out)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.steps <= args.warmup:
        p.error("--steps must exceed --warmup")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    _dynamo_limits()
    profile_dir = args.profile_dir or os.path.dirname(os.path.abspath(args.out))
    os.makedirs(profile_dir, exist_ok=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    cuda = torch.cuda.is_available()
    results = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "steps": args.steps, "warmup": args.warmup, "vocab": args.vocab, "compile": args.compile,
        "dynamo_backend": args.dynamo_backend, "argv": argv,
        "widths": {},
    }
    for name in ("accelerate", "transformers", "torchao", "triton", "transformer_engine"):
        try:
            results[name] = __import__(name).__version__
        except Exception as exc:  # a missing package is recorded, not fatal (torchao configs then fail alone)
            results[name] = f"unavailable: {type(exc).__name__}"

    def write() -> None:
        with open(args.out, "w") as fh:  # after every run: a time limit keeps what finished
            json.dump(results, fh, indent=1)

    for width in args.widths:
        p_ = preset(width)
        entry = results["widths"][width] = {
            "hidden": p_.hidden, "layers": p_.layers, "heads": p_.heads, "ffn": p_.ffn,
            "batch": p_.batch, "seq_len": p_.seq_len, "runs": {},
        }
        data = batches(width, args.steps, args.vocab)
        for round_ in range(args.rounds):
            for position, label in enumerate(round_order(args.configs, round_)):
                if round_ > 0 and "step_ms_median" not in entry["runs"][label]:
                    continue  # failed in round 0: its error is recorded, and more rounds would not change it
                t0 = time.perf_counter()
                path = None
                if round_ == 0 and width in args.profile and label in args.profile_configs:
                    path = os.path.join(profile_dir, f"profile_{width}_{label.replace(' ', '_')}.txt")
                try:
                    r = run_one(label, width, data, args, path)
                except Exception as exc:  # record and go on: one failing run must not hide the others
                    r = {"error": f"{type(exc).__name__}: {exc}"[:800], "traceback": traceback.format_exc()[-6000:]}
                r["run_s"] = time.perf_counter() - t0
                if round_ == 0:
                    entry["runs"][label] = r
                if args.rounds > 1 and "step_ms_median" in entry["runs"][label]:
                    entry["runs"][label].setdefault("rounds", []).append(
                        {"round": round_, "position": position, **(
                            {"step_ms_median": r["step_ms_median"], "step_ms_min": r["step_ms_min"]}
                            if "step_ms_median" in r else {"error": r["error"]})})
                set_ratios(entry["runs"])
                _cleanup()
                write()
                brief = {k: v for k, v in r.items() if k not in ("traceback", "plan", "profile", "dynamo", "step_ms")}
                if "plan" in r:
                    brief["converted"] = f"{r['plan']['converted']}/{r['plan']['linears']}"
                where = f"{width} round {round_}" if args.rounds > 1 else width
                print(where, label, json.dumps(brief), flush=True)
    print_table(results)
    return results


def round_order(configs: list[str], round_: int) -> list[str]:
    """The run order of one round: as given, then reversed, and so on (ABBA), so that no configuration
    always runs first: a step bound by the host (d1024) may depend on it."""
    return list(configs) if round_ % 2 == 0 else list(reversed(configs))


def set_ratios(runs: dict) -> None:
    """`speedup_vs_bf16` of every run: BF16's median step over the run's. With rounds, the medians are
    the medians over the rounds (`step_ms_median` becomes that; round 0's own stays in `rounds`)."""
    for r in runs.values():
        timed = [x["step_ms_median"] for x in r.get("rounds", ()) if "step_ms_median" in x]
        if timed:
            r["step_ms_median"] = statistics.median(timed)
    base = runs.get("bf16", {}).get("step_ms_median")
    for r in runs.values():
        if base and "step_ms_median" in r:
            r["speedup_vs_bf16"] = base / r["step_ms_median"]


def print_table(results: dict) -> None:
    print(f"\n{'width':6s} {'config':16s} {'step ms':>8s} {'vs bf16':>8s} {'peak GiB':>8s} {'FP8 Linears':>11s} "
          f"{'compile s':>9s}")
    for width, entry in results["widths"].items():
        for label, r in entry["runs"].items():
            if "step_ms_median" not in r:
                print(f"{width:6s} {label:16s} {r.get('error', '')[:90]}")
                continue
            conv = f"{r['plan']['converted']}/{r['plan']['linears']}" if "plan" in r else "-"
            peak = f"{r['peak_gib']:.2f}" if r["peak_gib"] is not None else "-"
            print(f"{width:6s} {label:16s} {r['step_ms_median']:8.2f} {r.get('speedup_vs_bf16', float('nan')):8.3f} "
                  f"{peak:>8s} {conv:>11s} {r['first_step_s']:9.1f}")


if __name__ == "__main__":
    main()
