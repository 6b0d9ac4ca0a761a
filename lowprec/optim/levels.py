"""MS-AMP memory levels as optimizer-state precision: Adam/AdamW -> LowBitAdam(W)."""

from __future__ import annotations

import logging

import torch

from .low_bit_adam import LowBitAdam, LowBitAdamW

log = logging.getLogger(__name__)

# (exp_avg, exp_avg_sq) storage per level, as msamp.initialize sets it.
LEVEL_STATE_DTYPES: dict[str, tuple[torch.dtype, torch.dtype]] = {
    "O1": (torch.float32, torch.float32),
    "O2": (torch.float8_e4m3fn, torch.float16),
}
STATE_NAMES = {torch.float32: "FP32", torch.bfloat16: "BF16", torch.float16: "FP16",
               torch.float8_e4m3fn: "FP8 E4M3", torch.float8_e5m2: "FP8 E5M2"}


def state_description(level: str) -> str:
    """'FP8 E4M3+FP16' for O2: the optimizer-state column of the precision table."""
    m, v = LEVEL_STATE_DTYPES[level]
    return f"{STATE_NAMES[m]}+{STATE_NAMES[v]}"


def state_bytes(level: str) -> int:
    m, v = LEVEL_STATE_DTYPES[level]
    return m.itemsize + v.itemsize


def check_optimizer(optimizer: torch.optim.Optimizer, level: str, *, backend: str) -> None:
    """Raise ValueError if `optimizer` cannot become a low-bit Adam at `level`."""
    if isinstance(optimizer, LowBitAdamW):
        return
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise ValueError(
            f"FP8RecipeKwargs(backend={backend!r}, opt_level={level!r}) stores optimizer states in low precision "
            "through lowprec's low-bit Adam: pass torch.optim.Adam or torch.optim.AdamW (replaced by "
            f"LowBitAdam / LowBitAdamW) or lowprec.optim.LowBitAdamW; got {type(optimizer).__name__}"
        )
    if optimizer.defaults.get("amsgrad"):
        raise ValueError(f"opt_level={level!r}: low-bit Adam has no AMSGrad variant (MS-AMP neither); use amsgrad=False")


def low_bit_optimizer(optimizer: torch.optim.Optimizer, level: str, *, backend: str) -> LowBitAdamW:
    """The LowBitAdam(W) that replaces `optimizer` at `level`; a LowBitAdamW is returned as is.

    Hyper-parameters and extra group keys (a scheduler's `initial_lr`) are kept; torch's
    implementation switches (foreach, fused, capturable, ...) are dropped.
    """
    if isinstance(optimizer, LowBitAdamW):
        return optimizer  # the user chose its state dtypes
    check_optimizer(optimizer, level, backend=backend)
    defaults = optimizer.defaults
    decoupled = isinstance(optimizer, torch.optim.AdamW) or defaults.get("decoupled_weight_decay", False)
    m_dtype, v_dtype = LEVEL_STATE_DTYPES[level]
    switches = set(defaults) - {"lr", "betas", "eps", "weight_decay", "maximize"}
    groups = [{k: v for k, v in group.items() if k not in switches} for group in optimizer.param_groups]
    cls = LowBitAdamW if decoupled else LowBitAdam
    new = cls(groups, lr=float(defaults["lr"]), betas=tuple(defaults["betas"]), eps=defaults["eps"],
              weight_decay=defaults["weight_decay"], exp_avg_dtype=m_dtype, exp_avg_sq_dtype=v_dtype,
              maximize=defaults.get("maximize", False))
    if optimizer.state:
        log.warning("lowprec: the optimizer passed to prepare() had state; %s starts from fresh moments", cls.__name__)
    log.info("lowprec: %s -> %s (%s states %s)", type(optimizer).__name__, cls.__name__, level, state_description(level))
    return new
