"""The demo's training protocol: AdamW's settings and the learning-rate schedule, one definition for `lowprec bench`
and the two-GPU harness (tests/distributed/gpu_engines.py), so that their held-out losses mean the same thing."""

from __future__ import annotations

import math
from collections.abc import Callable

# AdamW as GPT-style pre-training runs it (and `lowprec bench` since its first convergence runs)
ADAMW_SETTINGS = {"weight_decay": 0.1, "betas": (0.9, 0.95)}
DESCRIPTION = "AdamW(weight_decay=0.1, betas=(0.9, 0.95)); lr warmed up over a fifth of the steps, cosine to a tenth"


def lr_schedule(total: int) -> Callable[[int], float]:
    """The learning rate's factor at each of `total` steps, for `torch.optim.lr_scheduler.LambdaLR`: a linear warm-up
    over a fifth of the run, then a cosine decay to a tenth."""
    # Adam's first steps move every weight by ~lr regardless of the gradient, which at d=4096 spikes the loss if the
    # learning rate arrives at once (6.3 -> 19 at step 1 in the harness's runs without the warm-up, 2026-11-29)
    warm = max(2, total // 5)

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, total - warm)))

    return factor
