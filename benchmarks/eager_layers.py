"""Eager models (no `dynamo_backend`) with their FP8 Linear layers compiled one by one, against eager BF16.

    python benchmarks/eager_layers.py --out eager_layers.json [--size proxy] [--steps 16] [--warmup 8]

A user who does not compile gets torchao's and msamp's casts, amaxes and transposes as separate eager
kernels around every GEMM (lowprec bench, eager, H100: torchao 0.54x BF16). Compiling only the
converted layers (`nn.Module.compile()` on each; layers of one shape share a graph) fuses those into
a few kernels while the rest of the model stays eager, as the user asked. Each run: the d4096 proxy
through `lowprec.Accelerator` (every Linear converted but lm_head's neighbours as the defaults say),
torch AdamW(fused=True), median step time after `--warmup` steps, peak memory, losses.
"""

from __future__ import annotations

import argparse
import json
import statistics
import traceback

import torch

# compile_fp8_layers=False everywhere: the script compiles the layers itself where the run says so (it
# predates lowprec doing it; benchmarks/widths.py --compile none measures lowprec's own default).
# skip_slow_shapes=False: lowprec's eager rules (measured with this script's successor) would keep
# every layer of an eager model with eager layers in BF16; at d4096 the layers this converts are the
# 27 of 29 that its committed results had.
TORCHAO = dict(backend="torchao", recipe="tensorwise", compile_fp8_layers=False, skip_slow_shapes=False)
MSAMP = dict(backend="msamp", opt_level="O2", compile_fp8_layers=False, skip_slow_shapes=False)
RUNS = {
    "bf16 eager": (None, False),
    "torchao eager": (TORCHAO, False),
    "torchao eager, FP8 layers compiled": (TORCHAO, True),
    "msamp O2 eager": (MSAMP, False),
    "msamp O2 eager, FP8 layers compiled": (MSAMP, True),
}


def run_one(spec: dict | None, compile_layers: bool, size: str, data: list[torch.Tensor], warmup: int) -> dict:
    from accelerate.state import AcceleratorState, GradientState
    from levels import timed_steps

    from lowprec import Accelerator, FP8RecipeKwargs
    from lowprec.demo.model import PRESETS, build_model

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    torch._dynamo.reset()
    if spec is None:
        accelerator = Accelerator(mixed_precision="bf16")
    else:
        accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[FP8RecipeKwargs(**spec)])
    torch.manual_seed(0)
    model = build_model(PRESETS[size])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    plan = accelerator.precision_plan
    compiled = 0
    if compile_layers:
        backend = accelerator._lowprec[-1][1]
        for module in accelerator.unwrap_model(model).modules():
            if backend.converted_kind(module) == "linear":
                module.compile()
                compiled += 1
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times, losses = timed_steps(accelerator, model, optimizer, data)
    median = statistics.median(times[warmup:])
    return {"step_ms_median": 1000 * median, "tokens_per_s": data[0].numel() / median, "first_step_s": times[0],
            "losses": losses, "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            "converted": len(plan.converted) if plan is not None else 0, "compiled_layers": compiled}


def main() -> None:
    from levels import batches

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="proxy")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    p.add_argument("--out", required=True)
    args = p.parse_args()
    data = batches(args.size, args.steps, None, None)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    results = {"size": args.size, "steps": args.steps, "warmup": args.warmup, "device": device,
               "torch": torch.__version__, "runs": {}}
    for label in args.runs:
        try:
            r = run_one(*RUNS[label], args.size, data, args.warmup)
        except Exception as exc:  # record and go on
            r = {"error": f"{type(exc).__name__}: {exc}"[:800], "traceback": traceback.format_exc()[-6000:]}
        results["runs"][label] = r
        base = results["runs"].get("bf16 eager", {}).get("step_ms_median")
        if base and "step_ms_median" in r:
            r["speedup_vs_bf16_eager"] = base / r["step_ms_median"]
        print(label, json.dumps({k: v for k, v in r.items() if k not in ("losses", "traceback")}), flush=True)
        with open(args.out, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
