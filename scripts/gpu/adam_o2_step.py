"""Time the fused low-bit Adam step as msamp O2 runs it, on the d4096 proxy's FP8 Linear weights.

    PYTHONPATH=$PWD python scripts/gpu/adam_o2_step.py --out adam_o2_step.json [--baseline OLD_adam_triton.py]

FP16 weights, E4M3 weight gradients with their scales and presence flags (msamp's gradient stores), E4M3 + FP16
Adam moments: `lowprec.kernels.adam.fused_low_bit_adam_step` over the 17 weights of benchmarks/headline.py's d4096
proxy (4 blocks and the head, 1.1B parameters), with stochastic rounding on and off, for several CHUNKs (elements
per program). `--baseline` times another version of `lowprec/kernels/adam_triton.py` the same way (the file
before a change), so that both are measured in one process on one GPU. Median of CUDA-event-timed steps.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import types

import torch

from benchmarks.optimizer_states import step_times_ms  # run from the repository root (PYTHONPATH=$PWD)
from lowprec.kernels import adam

D, FF, LAYERS, VOCAB = 4096, 14336, 4, 32000
SHAPES = [(3 * D, D), (D, D), (2 * FF, D), (D, FF)] * LAYERS + [(VOCAB, D)]


def items(device: str) -> list[adam.AdamItem]:
    gen = torch.Generator(device=device).manual_seed(0)
    out = []
    for ordinal, shape in enumerate(SHAPES):
        p = (torch.randn(shape, device=device, generator=gen) * 0.02).half()
        g = (torch.randn(shape, device=device, generator=gen) * 100).to(torch.float8_e4m3fn)
        state = {"step": torch.zeros((), device=device),
                 "exp_avg": torch.zeros(shape, device=device, dtype=torch.float8_e4m3fn),
                 "exp_avg_scale": torch.ones((), device=device),
                 "exp_avg_sq": torch.zeros(shape, device=device, dtype=torch.float16),
                 "exp_avg_sq_scale": torch.ones((), device=device)}
        out.append(adam.AdamItem(p, g, torch.full((), 1e4, device=device), state, torch.ones((), device=device),
                                 ordinal))
    return out


def time_steps(batch: list[adam.AdamItem], rounding: bool, steps: int, warmup: int = 3) -> float:
    group = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "maximize": False}

    def step() -> None:
        adam.count_present_steps(batch)
        adam.fused_low_bit_adam_step(batch, group, decoupled=True, stochastic_rounding=rounding)

    return statistics.median(step_times_ms(types.SimpleNamespace(step=step), steps, warmup))


def kernels_from(path: str):
    spec = importlib.util.spec_from_file_location("baseline_adam_triton", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.amax_pass, module.reduce_pass, module.update_pass, module.scale_kernel


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--chunks", type=int, nargs="+", default=[2048, 8192, 32768])
    p.add_argument("--baseline", help="another adam_triton.py to time beside this tree's")
    args = p.parse_args()
    batch = items("cuda")
    n = sum(item.param.numel() for item in batch)
    # bytes the update must move at the least: FP16 weight read + written, E4M3 gradient, E4M3 + FP16 moments read
    # and written; the amax pass reads the gradient and both moments once more
    least = n * (2 + 2 + 1 + 1 + 1 + 2 + 2) + n * (1 + 1 + 2)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "parameters": n,
               "least_bytes": least, "rows": []}
    versions = [("tree", adam._get_kernels())]
    if args.baseline:
        versions.append(("baseline", kernels_from(args.baseline)))
    for chunk in args.chunks:
        for name, kernels in versions:
            for rounding in (True, False):
                adam.CHUNK, adam._kernels = chunk, kernels
                ms = time_steps(batch, rounding, args.steps)
                row = {"kernels": name, "chunk": chunk, "stochastic_rounding": rounding, "ms": round(ms, 3),
                       "gb_per_s": round(least / ms / 1e6, 1)}
                print(json.dumps(row), flush=True)
                results["rows"].append(row)
    with open(args.out, "w") as fh:
        json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
