"""Optimizer-state precision on the d4096 proxy: step time and model-state bytes per parameter.

    python benchmarks/optimizer_states.py --out optimizer_states.json [--size proxy] [--steps 50]

Same parameters (the Llama-style proxy of ../shared/reference/gpu-baselines.md, FP32) and the same
random gradients for every optimizer, one process:
- "torch AdamW fused":   torch.optim.AdamW(fused=True), the bar (FP32 states)
- "lowprec fp32 states": lowprec.optim.LowBitAdamW with FP32/FP32 states (MS-AMP O1's states)
- "lowprec fp8 states":  LowBitAdamW with E4M3 exp_avg + FP16 exp_avg_sq (optimizer_states="fp8", O2)

Reported per optimizer: median optimizer-step time over `--steps` CUDA-event-timed steps after
warm-up, the measured bytes of optimizer state per parameter (moments and their scales), and the
model-state bytes per parameter (FP32 weights + FP32 gradients + optimizer states).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics

import torch

OPTIMIZERS = {
    "torch AdamW fused": None,
    "lowprec fp32 states": (torch.float32, torch.float32),
    "lowprec fp8 states": (torch.float8_e4m3fn, torch.float16),
}


def make_optimizer(name: str, params, lr: float = 1e-4):
    from lowprec.optim import LowBitAdamW

    states = OPTIMIZERS[name]
    if states is None:
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.1, fused=True)
    return LowBitAdamW(params, lr=lr, weight_decay=0.1, exp_avg_dtype=states[0], exp_avg_sq_dtype=states[1])


def state_bytes(optimizer) -> int:
    return sum(t.numel() * t.element_size() for state in optimizer.state.values() for k, t in state.items()
               if k != "step" and isinstance(t, torch.Tensor))


def step_times_ms(optimizer, steps: int, warmup: int) -> list[float]:
    """CUDA-event times of `steps` optimizer steps after `warmup` untimed ones."""
    times = []
    for i in range(warmup + steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        optimizer.step()
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return times


def measure(name: str, size: str, steps: int, warmup: int) -> dict:
    from lowprec.demo.model import PRESETS, build_model

    torch.manual_seed(0)
    model = build_model(PRESETS[size]).cuda()
    params = [p for p in model.parameters() if p.requires_grad]
    n = sum(p.numel() for p in params)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for p in params:
        p.grad = torch.randn(p.shape, device="cuda", generator=gen) * 1e-3
    optimizer = make_optimizer(name, params)
    times = step_times_ms(optimizer, steps, warmup)
    weights = sum(p.numel() * p.element_size() for p in params)
    grads = sum(p.grad.numel() * p.grad.element_size() for p in params)
    states = state_bytes(optimizer)
    result = {
        "optimizer": name,
        "parameters": n,
        "step_ms_median": statistics.median(times),
        "step_ms_min": min(times),
        "optimizer_state_bytes_per_param": states / n,
        "model_state_bytes_per_param": (weights + grads + states) / n,
        "state_dtypes": sorted({str(t.dtype) for s in optimizer.state.values() for k, t in s.items()
                                if k in ("exp_avg", "exp_avg_sq")}),
    }
    del optimizer, model, params
    gc.collect()
    torch.cuda.empty_cache()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--size", default="proxy")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    args = p.parse_args()
    results = [measure(name, args.size, args.steps, args.warmup) for name in OPTIMIZERS]
    base = results[0]["step_ms_median"]
    for r in results:
        r["step_time_vs_torch_fused"] = r["step_ms_median"] / base
        print(f"{r['optimizer']:<22} {r['step_ms_median']:8.2f} ms  x{r['step_time_vs_torch_fused']:.2f}  "
              f"states {r['optimizer_state_bytes_per_param']:.3f} B/param  model state "
              f"{r['model_state_bytes_per_param']:.3f} B/param", flush=True)
    with open(args.out, "w") as fh:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "size": args.size,
                   "steps": args.steps, "results": results}, fh, indent=1)


if __name__ == "__main__":
    main()
