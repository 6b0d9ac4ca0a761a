"""lowprec's TE backend against raw TransformerEngine and BF16, one process, same model and data.

    python benchmarks/te_overhead.py --out te_overhead.json [--recipes delayed current block] [--steps 30]

"raw TE" is what a user would write by hand: every nn.Linear and RMSNorm of the model swapped for
te.Linear / te.RMSNorm with the weights copied, the forward run under te.autocast(recipe) inside
torch.autocast(bf16). "lowprec" is `lowprec.Accelerator` with FP8RecipeKwargs(backend="te", ...),
converting the same modules (skip_first_last / skip_slow_shapes off so both convert everything).
Median step time after warm-up; CUDA synchronised once per step by reading the loss.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch
from torch import nn


def build(size: str):
    from lowprec.demo.model import PRESETS, build_model

    torch.manual_seed(0)
    return build_model(PRESETS[size])


def batches(size: str, steps: int, batch: int | None, seq: int | None):
    from lowprec.demo.model import PRESETS

    preset = PRESETS[size]
    g = torch.Generator().manual_seed(0)
    b, t = batch or preset.batch, seq or preset.seq_len
    return [torch.randint(0, 256, (b, t), generator=g) for _ in range(steps)]


def time_steps(step_fn, data, warmup: int) -> dict:
    times, losses = [], []
    for ids in data:
        t0 = time.perf_counter()
        loss = step_fn(ids)
        losses.append(loss.item())  # synchronises
        times.append(time.perf_counter() - t0)
    timed = times[warmup:]
    tokens = data[0].numel()
    median = statistics.median(timed)
    return {"step_ms_median": 1000 * median, "tokens_per_s": tokens / median, "first_loss": losses[0],
            "last_loss": losses[-1], "peak_gib": torch.cuda.max_memory_allocated() / 2**30}


def te_recipe(name: str):
    from transformer_engine.common import recipe as R

    return {"delayed": lambda: R.DelayedScaling(fp8_format=R.Format.HYBRID),
            "current": lambda: R.Float8CurrentScaling(fp8_format=R.Format.HYBRID),
            "block": lambda: R.Float8BlockScaling()}[name]()


def raw_te(model: nn.Module) -> nn.Module:
    """Swap by hand, as a TE user would."""
    import transformer_engine.pytorch as te

    for _name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                new = te.Linear(child.in_features, child.out_features, bias=child.bias is not None,
                                params_dtype=child.weight.dtype, device="cuda")
            elif type(child).__name__.endswith("RMSNorm"):
                new = te.RMSNorm(child.weight.shape[0], eps=child.variance_epsilon, device="cuda")
            else:
                continue
            with torch.no_grad():
                new.weight.copy_(child.weight)
                if isinstance(child, nn.Linear) and child.bias is not None:
                    new.bias.copy_(child.bias)
            setattr(module, child_name, new)
    return model


def run_raw(size, data, recipe_name, compile_model, warmup):
    import transformer_engine.pytorch as te

    model = raw_te(build(size).cuda()) if recipe_name else build(size).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    recipe = te_recipe(recipe_name) if recipe_name else None

    def forward(ids):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if recipe is None:
                return model(input_ids=ids, labels=ids).loss
            with te.autocast(enabled=True, recipe=recipe):
                return model(input_ids=ids, labels=ids).loss

    fwd = torch.compile(forward) if compile_model else forward

    def step(ids):
        ids = ids.cuda(non_blocking=True)
        loss = fwd(ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return time_steps(step, data, warmup)


def run_lowprec(size, data, recipe_name, compile_model, warmup):
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import TorchDynamoPlugin

    from lowprec import Accelerator, FP8RecipeKwargs

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    extra = {"dynamo_plugin": TorchDynamoPlugin(backend="inductor")} if compile_model else {}
    recipe = FP8RecipeKwargs(backend="te", recipe=recipe_name, skip_first_last=False, skip_slow_shapes=False)
    accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[recipe], **extra)
    model = build(size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    plan = accelerator.precision_plan

    def step(ids):
        ids = ids.to(accelerator.device, non_blocking=True)
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    result = time_steps(step, data, warmup)
    result["converted"] = len(plan.converted)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="proxy")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--recipes", nargs="+", default=["delayed", "current", "block"])
    p.add_argument("--out", required=True)
    args = p.parse_args()
    data = batches(args.size, args.steps, args.batch, args.seq_len)
    runs = [("bf16", None, False, "raw"), ("bf16 compiled", None, True, "raw")]
    for r in args.recipes:
        compiled = r != "delayed"  # TE rejects DelayedScaling under torch.compile
        runs += [(f"raw TE {r}", r, compiled, "raw"), (f"lowprec te:{r}", r, compiled, "lowprec")]
    results = {"size": args.size, "steps": args.steps, "warmup": args.warmup, "device": torch.cuda.get_device_name(),
               "torch": torch.__version__, "runs": {}}
    for label, recipe_name, compiled, kind in runs:
        torch.cuda.reset_peak_memory_stats()
        fn = run_raw if kind == "raw" else run_lowprec
        try:
            r = fn(args.size, data, recipe_name, compiled, args.warmup)
        except Exception as exc:  # record and go on: one failing recipe must not hide the others
            r = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        r["compiled"] = compiled
        results["runs"][label] = r
        print(label, json.dumps(r), flush=True)
        gc.collect()
        torch.cuda.empty_cache()
        torch._dynamo.reset()
    base = results["runs"]["bf16 compiled"].get("step_ms_median")
    for r in results["runs"].values():
        if base and "step_ms_median" in r:
            r["speedup_vs_bf16_compiled"] = base / r["step_ms_median"]
    for r in args.recipes:
        raw, ours = results["runs"][f"raw TE {r}"], results["runs"][f"lowprec te:{r}"]
        if "step_ms_median" in raw and "step_ms_median" in ours:
            results.setdefault("lowprec_overhead_vs_raw_te", {})[r] = ours["step_ms_median"] / raw["step_ms_median"] - 1
    with open(args.out, "w") as fh:
        json.dump(results, fh, indent=1)
    print(json.dumps(results.get("lowprec_overhead_vs_raw_te"), indent=1))


if __name__ == "__main__":
    main()
