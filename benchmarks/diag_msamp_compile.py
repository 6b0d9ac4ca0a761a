"""Which part of msamp's FP8Linear stops `torch.compile` of the layer alone (compile_fp8_layers), on a GPU.

    python benchmarks/diag_msamp_compile.py --out diag.json

Each case compiles FP8Linear layers (O2 storage: FP16 weight, HYBRID formats, FP8 gradient buffers) with
`nn.Module.compile()` and trains them a few steps under BF16 autocast, as an eager model with
`compile_fp8_layers` would; a case that raises records the exception and the end of its traceback.
"""

from __future__ import annotations

import argparse
import json
import traceback

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def layers(shapes, dynamic=None, **kw):
    from lowprec.backends.msamp.linear import FP8Linear

    out = []
    for k, n in shapes:
        m = FP8Linear(k, n, bias=False, device=DEVICE, emulate=DEVICE == "cpu", **kw)
        with torch.no_grad():
            m.weight.normal_(0, 0.02)
        m.compile(backend="inductor", dynamic=dynamic)
        out.append(m)
    return out


def train(mods, steps: int, tokens: int) -> None:
    k = mods[0].in_features
    for step in range(steps):
        x = torch.randn(tokens, k, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            y = x
            for m in mods:
                y = m(y)
        y.float().square().mean().backward()
        for m in mods:  # what the backend does after each optimizer step
            m.reset_fp8_grad()
            m._count_step(step + 1)
    if DEVICE == "cuda":
        torch.cuda.synchronize()


CASES = {
    # one shape, a few steps (the amax history warms up: the in-time scaling turns into delayed scaling)
    "one layer": lambda: train(layers([(1024, 2048)]), 4, 256),
    "one layer, 20 steps": lambda: train(layers([(1024, 2048)]), 20, 256),
    # two shapes through one code object: the second recompiles (automatic dynamic shapes)
    "two shapes": lambda: train(layers([(1024, 2048), (2048, 1024)]), 4, 256),
    "three shapes": lambda: train(layers([(1024, 2048), (2048, 1536), (1536, 1024)]), 4, 256),
    "two shapes, static (dynamic=False)": lambda: train(layers([(1024, 2048), (2048, 1024)], dynamic=False), 4, 256),
    "two shapes, dynamic=True": lambda: train(layers([(1024, 2048), (2048, 1024)], dynamic=True), 4, 256),
    "proxy MLP shapes": lambda: train(layers([(4096, 14336), (14336, 4096)]), 4, 8192),
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    args = p.parse_args()
    results = {"torch": torch.__version__}
    for name in args.cases:
        torch._dynamo.reset()
        try:
            CASES[name]()
            results[name] = {"ok": True}
        except Exception as exc:  # noqa: BLE001 -- recorded, the next case runs
            results[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:600],
                             "traceback": traceback.format_exc()[-4000:]}
        print(name, json.dumps({k: v for k, v in results[name].items() if k != "traceback"}), flush=True)
    with open(args.out, "w") as fh:
        json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
