"""Host time of one FP8 Linear call, eager against compiled, with BF16's `nn.Linear` beside it.

    python benchmarks/layer_host.py --out layer_host.json [--dim 4096] [--tokens 256] [--calls 300]

msamp O3 under FSDP2 is bound by the host on two H200s (results/gpu/2026-11-27-h200x2-o3fsdp2-*: the forward's host
time equals its device time), so what one layer call costs the host decides its speed. Each variant runs `--calls`
training calls back to back without a synchronisation, a token count small enough that the GPU keeps up, and reports
the best of five rounds in microseconds per call (forward only, and forward with backward), the kernels one forward
and backward launch, and the GPU time they take (so a variant bound by the GPU shows as such):

- `bf16`: `nn.Linear` with a BF16 weight, the baseline every FP8 layer is paid against;
- `o2 eager` / `o2 compiled`: msamp's `FP8Linear` at O2 (FP16 weight cast at each forward, FP8 weight gradient
  kept on the layer), as `compile_fp8_layers` False / True make it;
- `o3 eager` / `o3 compiled`: the same layer at O3 as FSDP2 hands it its weight, an `FP8GatheredWeight` (E4M3
  bytes and scale, no cast), its gradient returned through autograd.

Every FP8 layer is past its warm-up (delayed scales), as in all but a run's first 16 steps. Needs a CUDA device for
the numbers that matter; on a CPU it runs (emulated GEMMs) as a smoke test.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch import nn

VARIANTS = ("bf16", "o2 eager", "o2 compiled", "o3 eager", "o3 compiled")


def build(variant: str, dim: int, device: torch.device) -> nn.Module:
    from lowprec.backends.execution import raise_recompile_limit
    from lowprec.backends.msamp.fsdp import FP8GatheredWeight
    from lowprec.backends.msamp.linear import E4M3, FP8Linear
    from lowprec.kernels.scaling import compute_scale, quantize

    if variant == "bf16":
        return nn.Linear(dim, dim, bias=False, device=device, dtype=torch.bfloat16)
    level, mode = variant.split()
    emulate = device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9)
    layer = FP8Linear(dim, dim, bias=False, emulate=emulate, device=device, sharded_master=level == "o3")
    master = torch.randn(dim, dim, device=device) * 0.02
    if level == "o3":
        scale = compute_scale(master.abs().amax(), E4M3)
        gathered = FP8GatheredWeight(quantize(master, scale, E4M3), scale, torch.float16)
        layer.weight = nn.Parameter(gathered)  # what FSDP2's all-gather leaves on the layer
    else:
        with torch.no_grad():
            layer.weight.copy_(master)
    layer._count_step(layer.amax_history_len)  # past the warm-up: delayed scales
    if mode == "compiled":
        raise_recompile_limit(8)
        from lowprec.backends.msamp import MSAMPBackend

        layer.compile(backend=MSAMPBackend.LAYER_COMPILE_BACKEND, dynamic=MSAMPBackend.LAYER_COMPILE_DYNAMIC)
    return layer


def per_call_us(fn, calls: int, rounds: int = 5) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(10):
        fn()
    sync()
    best = float("inf")
    for _ in range(rounds):
        sync()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls * 1e6)  # host time: the GPU is not waited for
        sync()
    return best


def kernels_and_gpu_us(fn) -> tuple[int, float]:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    fn()
    with profile(activities=activities) as prof:
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return len(events), sum(e.device_time for e in events)


def host_profile(fn, path: str, calls: int) -> None:
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    fn()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(40)
    with profile(activities=[ProfilerActivity.CPU]) as ops:
        for _ in range(10):
            fn()
    with open(path, "w") as fh:
        fh.write(f"cProfile, {calls} calls\n{text.getvalue()}\ntorch.profiler, 10 calls\n")
        fh.write(ops.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of: {', '.join(VARIANTS)}")
    p.add_argument("--out", required=True)
    p.add_argument("--profile", action="store_true",
                   help="also write OUT.VARIANT.txt: the host's own time per function (cProfile) and per op (torch)")
    args = p.parse_args()
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        p.error(f"--variants: {', '.join(map(repr, unknown))} not among {', '.join(map(repr, VARIANTS))}")
    for name in ("dim", "tokens", "calls"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    x = torch.randn(args.tokens, args.dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(args.tokens, args.dim, device=device, dtype=torch.bfloat16)
    results = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "dim": args.dim,
               "tokens": args.tokens, "calls": args.calls, "torch": torch.__version__, "variants": {}}
    for variant in args.variants.split(","):
        layer = build(variant, args.dim, device)

        def forward(layer=layer):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                return layer(x)

        def train(forward=forward):
            forward().backward(grad)

        row = {"forward_us": per_call_us(forward, args.calls), "train_us": per_call_us(train, args.calls)}
        row["kernels"], row["gpu_us"] = kernels_and_gpu_us(train)
        results["variants"][variant] = row
        if args.profile:
            host_profile(train, f"{args.out}.{variant.replace(' ', '_')}.txt", args.calls)
        print(f"{variant:14s} forward {row['forward_us']:7.1f} us  forward+backward {row['train_us']:7.1f} us  "
              f"{row['kernels']} kernels, {row['gpu_us']:.1f} us on the GPU", flush=True)
    with open(args.out, "w") as fh:
        json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
