"""Choose the fused low-bit Adam kernel's launch shape on this GPU (lowprec/kernels/adam.py).

    PYTHONPATH=$PWD python scripts/gpu/tune_adam.py --out tune_adam.json

On the d4096 proxy's parameters (FP32, random gradients), times torch's fused AdamW and the fused
LowBitAdamW step with FP32 states and with FP8 states (E4M3 + FP16) for each (CHUNK, BLOCK,
num_warps): CHUNK elements per program, BLOCK per loop iteration. Median of CUDA-event-timed steps.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics

import torch

from benchmarks.optimizer_states import step_times_ms  # run from the repository root (PYTHONPATH=$PWD)
from lowprec.kernels import adam
from lowprec.optim import LowBitAdamW


def timed(optimizer, steps: int, warmup: int = 3) -> float:
    return statistics.median(step_times_ms(optimizer, steps, warmup))


def main() -> None:
    from lowprec.demo.model import PRESETS, build_model

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--size", default="proxy")
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    torch.manual_seed(0)
    params = [q for q in build_model(PRESETS[args.size]).cuda().parameters()]
    for q in params:
        q.grad = torch.randn_like(q) * 1e-3
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "parameters": sum(q.numel() for q in params), "configs": []}
    torch_ms = timed(torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=True), args.steps)
    results["torch_adamw_fused_ms"] = torch_ms
    print(f"torch AdamW fused {torch_ms:.2f} ms", flush=True)
    for chunk, block, warps in itertools.product([1024, 2048, 4096], [1024, 2048], [4, 8]):
        if block > chunk:
            continue
        adam.CHUNK, adam.BLOCK, adam.NUM_WARPS = chunk, block, warps
        row = {"chunk": chunk, "block": block, "num_warps": warps}
        for name, states in (("fp32", ("fp32", "fp32")), ("fp8", ("e4m3", "fp16"))):
            opt = LowBitAdamW(params, lr=1e-4, weight_decay=0.1, exp_avg_dtype=states[0], exp_avg_sq_dtype=states[1])
            row[f"{name}_ms"] = timed(opt, args.steps)
            row[f"{name}_vs_torch"] = row[f"{name}_ms"] / torch_ms
            del opt
            torch.cuda.empty_cache()
        print(json.dumps(row), flush=True)
        results["configs"].append(row)
    with open(args.out, "w") as fh:
        json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
