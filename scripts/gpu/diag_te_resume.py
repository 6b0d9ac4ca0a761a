"""Why did TE's exact-resume GPU test differ once (3.15972 vs 3.15968)? Issue 16, item 6.

Trains the GPU test's small Llama with TE DelayedScaling for 6 steps, saves with `save_state`, then
runs steps 6..12 three times: continuing the live run (A), and twice after `load_state` into a fresh
Accelerator (B, C). Lost state shows as B == C != A; nondeterministic kernels as B != C. Each
variant is repeated with deterministic algorithms (`torch.use_deterministic_algorithms` and the
math SDPA kernel), so the cause is measured rather than guessed.

    python scripts/gpu/diag_te_resume.py OUT.json
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts: deterministic cuBLAS

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests", "gpu"))
from test_te_gpu import accelerator_for, llama_training, run_steps  # noqa: E402


def te_state(model) -> list[bytes]:
    import transformer_engine.pytorch as te

    return [bytes(m.get_extra_state().cpu().numpy().tobytes()) for m in model.modules() if isinstance(m, te.Linear)]


def experiment(deterministic: bool) -> dict:
    sdpa = contextlib.nullcontext()
    if deterministic:
        torch.use_deterministic_algorithms(True)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        sdpa = sdpa_kernel([SDPBackend.MATH])
    else:
        torch.use_deterministic_algorithms(False)
    with sdpa, tempfile.TemporaryDirectory() as tmp:
        accelerator = accelerator_for("delayed", amax_history_len=16)
        model, optimizer, loader = llama_training(accelerator, steps=12)
        batches = list(loader)
        run_steps(accelerator, model, optimizer, batches[:6])
        accelerator.save_state(tmp)
        saved = te_state(accelerator.unwrap_model(model))
        runs = {"A_continued": run_steps(accelerator, model, optimizer, batches[6:])}
        loaded_equal = []
        for name in ("B_resumed", "C_resumed_again"):
            accelerator = accelerator_for("delayed", amax_history_len=16)
            model, optimizer, _ = llama_training(accelerator, steps=12)
            accelerator.load_state(tmp)
            loaded_equal.append(te_state(accelerator.unwrap_model(model)) == saved)
            runs[name] = run_steps(accelerator, model, optimizer, batches[6:])
    a, b, c = (runs[k] for k in ("A_continued", "B_resumed", "C_resumed_again"))
    return {
        "deterministic": deterministic,
        "losses": runs,
        "te_extra_state_equal_after_load": loaded_equal,
        "A_equals_B": a == b,
        "B_equals_C": b == c,
        "max_abs_A_B": max(abs(x - y) for x, y in zip(a, b)),
        "max_abs_B_C": max(abs(x - y) for x, y in zip(b, c)),
    }


def main(out: str) -> None:
    results = [experiment(False), experiment(True), experiment(False)]
    for r in results:
        print({k: v for k, v in r.items() if k != "losses"}, flush=True)
    with open(out, "w") as fh:
        json.dump({"torch": torch.__version__, "device": torch.cuda.get_device_name(), "results": results}, fh,
                  indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
