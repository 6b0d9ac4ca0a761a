"""The whole-tensor reductions lowprec runs outside compiled graphs, at the d4096 proxy's weight shapes.

    python benchmarks/fused_reductions.py --out fused_reductions.json

`cuda_fused` compiles each function once for every length (inductor, dynamic shapes). Each is first called
on a 16x16 tensor, the case in which inductor's split of a whole-tensor reduction, decided at that first
compile, left later weights to one program (results/gpu/2026-11-27-h200x2-profile-85a7575), then timed
(median of --iters, CUDA events) on each weight shape, compiled and as its eager definition, with the bytes
it reads and writes per second. Functions: the stored FP8 gradient's norm (clipping under DDP and ZeRO,
`optim.grad_store._stored_norm`) and the O3 weight's requantisation under DeepSpeed
(`backends.msamp.fsdp._scaled_cast`) and a store's accumulation of a BF16 weight gradient into its FP8 one (te's and
torchao's O1/O2, `optim.grad_store.accumulated`).

Then the same hazard inside a compiled layer: msamp's FP8Linear (4096x4096) compiled as `compile_fp8_layers`
compiles it (dynamic shapes), its forward and backward timed at 8 x 2048 tokens after a first call of one
16-token batch (an evaluation or a generation before training) and, after `torch._dynamo.reset()`, after a
first call at the training size. Its amaxes of activations and gradients reduce over rows when traced
(`kernels.scaling.tensor_amax`), so the two should match.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from lowprec.backends.msamp.fsdp import _scaled_cast
from lowprec.optim.grad_store import _stored_norm, accumulated

SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336)]


def _median_ms(call, fn, iters: int) -> float:
    """Median time of `call(fn)` over `iters` runs."""
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call(fn)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _cases(shape):
    """(name, call(fn), bytes moved) for each function on a tensor of `shape`."""
    g = torch.Generator(device="cuda").manual_seed(0)
    grad = (torch.randn(shape, device="cuda", generator=g) * 8).to(torch.float8_e4m3fn)
    master = torch.randn(shape, device="cuda", generator=g)
    one, scale = torch.ones((), device="cuda"), torch.tensor(4.0, device="cuda")
    wgrad = torch.randn(shape, device="cuda", generator=g, dtype=torch.bfloat16)
    numel = grad.numel()
    return [
        ("stored_norm", _stored_norm, lambda f: f(grad, scale, one, 2.0), numel),
        ("scaled_cast", _scaled_cast, lambda f: f(master, scale, 0), numel * 4 * 2 + numel),  # amax read, cast
        # the stored bytes and the gradient read twice (the amax, the cast), the new bytes written once
        ("accumulated", accumulated, lambda f: f(grad, scale, one, wgrad), numel * 3 * 2 + numel),
    ]


TOKENS = 8 * 2048


def _layer_ms(first_tokens: int, iters: int) -> float:
    """Forward and backward of a compiled msamp FP8Linear on TOKENS tokens, after a first call on `first_tokens`."""
    from lowprec.backends.msamp import MSAMPBackend
    from lowprec.backends.msamp.linear import FP8Linear

    torch._dynamo.reset()
    layer = FP8Linear(4096, 4096, bias=False, device="cuda")
    torch.nn.init.normal_(layer.weight, std=0.02)
    layer.compile(dynamic=MSAMPBackend.LAYER_COMPILE_DYNAMIC)

    def step(tokens: int) -> None:
        x = torch.randn(tokens, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        layer(x).float().sum().backward()

    step(first_tokens)
    for _ in range(3):
        step(TOKENS)
    return _median_ms(lambda _: step(TOKENS), None, iters)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    for _, fn, call, _ in _cases((16, 16)):
        call(fn)  # the short first call: the compile a later length reuses
    rows = []
    for shape in SHAPES:
        for name, fn, call, moved in _cases(shape):
            for _ in range(3):
                call(fn), call(fn.eager)
            fused, eager = _median_ms(call, fn, args.iters), _median_ms(call, fn.eager, args.iters)
            rows.append({"function": name, "shape": list(shape), "fused_ms": fused, "eager_ms": eager,
                         "fused_gb_per_s": moved / fused / 1e6, "first_call_shape": [16, 16]})
            print(f"{name:12s} {str(shape):14s} fused {fused:8.3f} ms ({moved / fused / 1e6:7.0f} GB/s)"
                  f"  eager {eager:8.3f} ms")
    layers = {first: _layer_ms(first, args.iters) for first in (16, TOKENS)}
    print(f"FP8Linear 4096x4096, {TOKENS} tokens, fwd+bwd: {layers[16]:.3f} ms after a 16-token first call, "
          f"{layers[TOKENS]:.3f} ms after a {TOKENS}-token one")
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows,
              "fp8_linear_fwd_bwd_ms_by_first_tokens": layers}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
