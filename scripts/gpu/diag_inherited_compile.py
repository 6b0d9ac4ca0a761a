"""Issue 26's d2048 observations, reproduced: an "eager" Accelerator built after a compiled one in the same process.

    python3 scripts/gpu/diag_inherited_compile.py OUT.json

Accelerate keeps one AcceleratorState per process, so an Accelerator built after one with
dynamo_backend=INDUCTOR compiles its model too, whatever it was asked. On the headline proxy at d2048
(benchmarks/headline.py) this builds BF16 compiled, then FP8RecipeKwargs(backend="te") and then
FP8RecipeKwargs() (auto) with no dynamo argument and no state reset, as a script comparing configurations
in one process does, and records what lowprec planned (model mode, FP8 Linears, the backend auto chose)
and what it warned. Before the fix this planned a compiled model silently: TE's compiled-model rule kept
all 17 Linears in BF16 and auto chose torchao.
"""

from __future__ import annotations

import json
import sys
import warnings

import torch
from accelerate.utils import TorchDynamoPlugin

sys.path.insert(0, "benchmarks")
from headline import WIDTHS, Proxy  # noqa: E402

from lowprec import Accelerator, FP8RecipeKwargs  # noqa: E402


def build():
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        return Proxy(*WIDTHS["d2048" if torch.cuda.is_available() else "tiny"])


def main(out: str) -> None:
    record = {}
    first = Accelerator(mixed_precision="bf16", dynamo_plugin=TorchDynamoPlugin(backend="inductor"))
    first.prepare(build())
    record["first"] = str(first.state.dynamo_plugin.backend)
    for label, handler in (("te", FP8RecipeKwargs(backend="te")), ("auto", FP8RecipeKwargs())):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[handler])
            accelerator.prepare(build())
        plan = accelerator.precision_plan
        record[label] = {
            "dynamo_backend": str(accelerator.state.dynamo_plugin.backend),
            "model_mode": plan.model_mode, "backend": plan.backend, "recipe": plan.recipe, "choice": plan.choice,
            "fp8_linears": sum(m.convert for m in plan.modules if m.kind == "linear"),
            "linears": sum(m.kind == "linear" for m in plan.modules),
            "warnings": [str(w.message) for w in caught if "lowprec" in str(w.message)],
        }
    try:
        Accelerator(mixed_precision="fp8", kwargs_handlers=[FP8RecipeKwargs(backend="te")], dynamo_backend="no")
        record["explicit_no"] = "accepted"
    except ValueError as exc:
        record["explicit_no"] = f"ValueError: {exc}"
    print(json.dumps(record, indent=1))
    with open(out, "w") as fh:
        json.dump(record, fh, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
