"""Memory levels O1/O2 per backend against BF16: one process, same model and data.

    python benchmarks/levels.py --out levels.json [--size proxy] [--steps 30] [--warmup 12] [--runs ...]

Every run goes through `lowprec.Accelerator` with the same training step (forward, backward,
optimizer step, zero_grad) and `torch.compile` (inductor), which torchao needs for its speed:
- "bf16":                Accelerator(mixed_precision="bf16"), torch AdamW(fused=True)
- "torchao tensorwise":  FP8RecipeKwargs(backend="torchao", recipe="tensorwise"), torch AdamW(fused=True)
- "te current":          FP8RecipeKwargs(backend="te", recipe="current") (compilable), torch AdamW(fused=True)
- "<backend> O1" / "O2": FP8RecipeKwargs(backend=..., opt_level=...), AdamW -> lowprec LowBitAdamW

All convert every Linear (skip_first_last / skip_slow_shapes off) so the FP8 GEMM work is the same.
Reported per run: median step time after warm-up, tokens/s, peak CUDA memory, and the measured
model-state bytes per parameter (weights + gradients, wherever they live, + optimizer states +
master weights), over all parameters and over the converted Linear weights alone.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
import traceback

import torch

from lowprec.demo.memory import model_state_bytes

RUNS = {
    "bf16": None,
    "torchao tensorwise": dict(backend="torchao", recipe="tensorwise"),
    "msamp O1": dict(backend="msamp", opt_level="O1"),
    "msamp O2": dict(backend="msamp", opt_level="O2"),
    "torchao O1": dict(backend="torchao", recipe="tensorwise", opt_level="O1"),
    "torchao O2": dict(backend="torchao", recipe="tensorwise", opt_level="O2"),
    "te current": dict(backend="te", recipe="current"),
    "te O1": dict(backend="te", recipe="current", opt_level="O1"),
    "te O2": dict(backend="te", recipe="current", opt_level="O2"),
}


def batches(size: str, steps: int, batch: int | None, seq: int | None) -> list[torch.Tensor]:
    from lowprec.demo.model import PRESETS

    preset = PRESETS[size]
    g = torch.Generator().manual_seed(0)
    b, t = batch or preset.batch, seq or preset.seq_len
    return [torch.randint(0, 256, (b, t), generator=g) for _ in range(steps)]


def timed_steps(accelerator, model, optimizer, data: list[torch.Tensor]) -> tuple[list[float], list[float]]:
    """(seconds, loss) of one training step per batch: forward with labels, backward, step, zero_grad."""
    times, losses = [], []
    for ids in data:
        t0 = time.perf_counter()
        ids = ids.to(accelerator.device, non_blocking=True)
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())  # synchronises
        times.append(time.perf_counter() - t0)
    return times, losses


def run_one(label: str, spec: dict | None, size: str, data: list[torch.Tensor], warmup: int) -> dict:
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import TorchDynamoPlugin

    from lowprec import Accelerator, FP8RecipeKwargs
    from lowprec.demo.model import PRESETS, build_model

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    dynamo = TorchDynamoPlugin(backend="inductor")
    if spec is None:
        accelerator = Accelerator(mixed_precision="bf16", dynamo_plugin=dynamo)
    else:
        recipe = FP8RecipeKwargs(**spec, skip_first_last=False, skip_slow_shapes=False)
        accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[recipe], dynamo_plugin=dynamo)
    torch.manual_seed(0)
    model = build_model(PRESETS[size])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    torch.cuda.reset_peak_memory_stats()

    times, losses = timed_steps(accelerator, model, optimizer, data)
    # Measured before zero_grad would drop them: one more backward so gradients exist.
    loss = model(input_ids=data[0].to(accelerator.device), labels=data[0].to(accelerator.device)).loss
    accelerator.backward(loss)
    inner = accelerator.unwrap_model(model, keep_torch_compile=False)
    backend = accelerator._lowprec[-1][1] if spec is not None else None
    state = model_state_bytes(inner, optimizer, backend)
    optimizer.zero_grad(set_to_none=True)

    median = statistics.median(times[warmup:])
    plan = accelerator.precision_plan
    result = {
        "step_ms_median": 1000 * median,
        "tokens_per_s": data[0].numel() / median,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "losses": losses,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "model_state_bytes_per_param": state,
        "optimizer": type(getattr(optimizer, "optimizer", optimizer)).__name__,
    }
    if plan is not None:
        result.update(converted=len(plan.converted), emulated=plan.emulated, execution=plan.execution,
                      planned_bytes_per_param=plan.model_state_bytes_per_param)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="proxy")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=12, help="steps left out of the timing (compile, warm-up)")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    p.add_argument("--out", required=True)
    args = p.parse_args()
    data = batches(args.size, args.steps, args.batch, args.seq_len)
    results = {"size": args.size, "steps": args.steps, "warmup": args.warmup, "device": torch.cuda.get_device_name(),
               "torch": torch.__version__, "runs": {}}
    for label in args.runs:
        try:
            r = run_one(label, RUNS[label], args.size, data, args.warmup)
        except Exception as exc:  # record and go on: one failing run must not hide the others
            r = {"error": f"{type(exc).__name__}: {exc}"[:800], "traceback": traceback.format_exc()[-6000:]}
        results["runs"][label] = r
        print(label, json.dumps({k: v for k, v in r.items() if k not in ("losses", "traceback")}), flush=True)
        with open(args.out, "w") as fh:  # after every run: a time limit keeps what finished
            json.dump(results, fh, indent=1)
        gc.collect()
        torch.cuda.empty_cache()
        torch._dynamo.reset()
    runs = results["runs"]
    base = runs.get("bf16", {}).get("step_ms_median")
    ao = runs.get("torchao tensorwise", {}).get("step_ms_median")
    for r in runs.values():
        if "step_ms_median" in r:
            if base:
                r["speedup_vs_bf16"] = base / r["step_ms_median"]
            if ao:
                r["slowdown_vs_torchao_tensorwise"] = r["step_ms_median"] / ao - 1
    with open(args.out, "w") as fh:
        json.dump(results, fh, indent=1)
    for label, r in runs.items():
        if "step_ms_median" in r:
            b = r["model_state_bytes_per_param"]
            print(f"{label:20s} {r['step_ms_median']:8.1f} ms  x{r.get('speedup_vs_bf16', float('nan')):.3f} vs bf16  "
                  f"{r.get('slowdown_vs_torchao_tensorwise', float('nan')):+.3%} vs torchao  "
                  f"peak {r['peak_gib']:.1f} GiB  "
                  f"bytes/param all {b['all_params']['total']:.2f} linear {b['linear_weights']['total']:.2f}")
        else:
            print(f"{label:20s} {r['error']}")


if __name__ == "__main__":
    main()
