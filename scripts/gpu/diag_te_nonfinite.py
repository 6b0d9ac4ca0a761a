"""What TransformerEngine's FP8 casts do with inf and NaN, and what keeping them visible costs (issue 27).

    python3 scripts/gpu/diag_te_nonfinite.py OUT.json

For each recipe (delayed, current) and each place an FP8 cast happens (the forward input, E4M3; the
backward output gradient, E5M2 under HYBRID): put one inf or one NaN in, and record whether the
output (forward) or the input and weight gradients (backward) stay finite. Then time te.Linear's forward
and backward at the headline's QKV shape as TE's te.Linear and as lowprec's (which adds the guard of
lowprec/backends/te/guard.py).
"""

from __future__ import annotations

import json
import sys

import torch
import transformer_engine
import transformer_engine.pytorch as te
from transformer_engine.common import recipe as te_recipe

RECIPES = {"delayed": lambda: te_recipe.DelayedScaling(fp8_format=te_recipe.Format.HYBRID),
           "current": lambda: te_recipe.Float8CurrentScaling(fp8_format=te_recipe.Format.HYBRID)}


def linear_class(guarded: bool) -> type:
    from lowprec.backends.te.modules import module_classes

    return module_classes()["linear"] if guarded else te.Linear


def probe(recipe_name: str, where: str, value: float, guarded: bool) -> dict:
    torch.manual_seed(0)
    layer = linear_class(guarded)(1024, 1024, params_dtype=torch.bfloat16).cuda()
    x = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16)
    if where == "forward":
        x.data[3, 5] = value
    else:
        g[3, 5] = value
    with te.autocast(enabled=True, recipe=RECIPES[recipe_name]()):
        y = layer(x)
    y.backward(g)
    return {"recipe": recipe_name, "where": where, "value": str(value), "guarded": guarded,
            "output_finite": bool(torch.isfinite(y).all()), "dgrad_finite": bool(torch.isfinite(x.grad).all()),
            "wgrad_finite": bool(torch.isfinite(layer.weight.grad).all())}


def timing(guarded: bool, recipe_name: str, steps: int = 50) -> float:
    layer = linear_class(guarded)(4096, 12288, params_dtype=torch.bfloat16).cuda()
    x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(8192, 12288, device="cuda", dtype=torch.bfloat16)

    def step():
        with te.autocast(enabled=True, recipe=RECIPES[recipe_name]()):
            y = layer(x)
        y.backward(g)

    for _ in range(10):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def main(out: str) -> None:
    rows = [probe(r, w, v, guarded) for r in RECIPES for w in ("forward", "backward")
            for v in (float("inf"), float("nan")) for guarded in (False, True)]
    times = {f"{r} {'guarded' if gd else 'plain'}": timing(gd, r) for r in RECIPES for gd in (False, True)}
    times.update({f"{r} {'guarded' if gd else 'plain'} (again)": timing(gd, r) for r in RECIPES
                  for gd in (True, False)})
    result = {"probes": rows, "ms_per_fwd_bwd_8192x4096x12288": times, "te": transformer_engine.__version__,
              "torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
    for row in rows:
        print(row)
    for k, v in times.items():
        print(f"{k}: {v:.3f} ms")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
