"""MS-AMP memory levels as optimizer-state precision: Adam/AdamW -> LowBitAdam(W)."""

from __future__ import annotations

import logging

import torch

from .low_bit_adam import LowBitAdam, LowBitAdamW, state_dtype

log = logging.getLogger(__name__)

STATE_NAMES = {torch.float32: "FP32", torch.bfloat16: "BF16", torch.float16: "FP16",
               torch.float8_e4m3fn: "FP8 E4M3", torch.float8_e5m2: "FP8 E5M2"}
# How FP8RecipeKwargs.optimizer_states spells each storage dtype.
SHORT_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
               torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
# optimizer_states presets -> (exp_avg, exp_avg_sq) storage; "fp8" is MS-AMP O2's pair.
STATE_PRESETS: dict[str, tuple[torch.dtype, torch.dtype]] = {
    "fp32": (torch.float32, torch.float32),
    "bf16": (torch.bfloat16, torch.bfloat16),
    "fp16": (torch.float16, torch.float16),
    "fp8": (torch.float8_e4m3fn, torch.float16),
}
# Each MS-AMP level as values of FP8RecipeKwargs' storage knobs (the table in DESIGN.md): FP16
# weights with no master copy, FP8 weight gradients, and the states msamp.initialize sets. O3 keeps
# O2's states; its FP16 weight is the master that the engine shards and all-gathers in FP8
# (lowprec.backends.msamp.fsdp), which no knob expresses.
LEVEL_ROWS: dict[str, dict[str, str]] = {
    "O1": {"weight_dtype": "fp16", "weight_grad_dtype": "fp8", "optimizer_states": "fp32"},
    "O2": {"weight_dtype": "fp16", "weight_grad_dtype": "fp8", "optimizer_states": "fp8"},
    "O3": {"weight_dtype": "fp16", "weight_grad_dtype": "fp8", "optimizer_states": "fp8"},
}
LEVEL_STATES = {level: row["optimizer_states"] for level, row in LEVEL_ROWS.items()}
# The moments TransformerEngine's FusedAdam keeps (its exp_avg_dtype / exp_avg_sq_dtype; FP8 E4M3 is its uint8, one
# FP32 scale per tensor): what optimizer_states may choose where FusedAdam is the optimizer (te's fp8_weights).
FUSED_ADAM_STATE_DTYPES: dict[torch.dtype, torch.dtype] = {
    torch.float32: torch.float32, torch.bfloat16: torch.bfloat16, torch.float16: torch.float16,
    torch.float8_e4m3fn: torch.uint8,
}
_FROM_FUSED_ADAM = {v: k for k, v in FUSED_ADAM_STATE_DTYPES.items()}
LEVEL_STATE_DTYPES: dict[str, tuple[torch.dtype, torch.dtype]] = {
    level: STATE_PRESETS[LEVEL_STATES[level]] for level in LEVEL_ROWS
}


def parse_states(option: str, value) -> str:
    """A preset name ('fp8') or 'm+v' ('e4m3+e4m3') from a preset, a pair of names or dtypes, or
    'e4m3,fp16' / 'e4m3+fp16'. Raises ValueError naming `option` and what it accepts."""
    accepted = (f"one of {', '.join(repr(p) for p in STATE_PRESETS)}, or a pair (exp_avg, exp_avg_sq) of "
                f"{', '.join(repr(n) for n in SHORT_NAMES.values())} such as ('e4m3', 'fp16') or 'e4m3+fp16'")
    given = value  # the value as written, for the message
    if isinstance(value, str):
        text = value.strip().lower()
        if text in STATE_PRESETS:
            return text
        value = text.replace(",", "+").split("+")
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise ValueError(f"{option}={given!r} is not {accepted}")
    try:
        pair = tuple(state_dtype(option, v.strip() if isinstance(v, str) else v) for v in value)
    except ValueError:
        raise ValueError(f"{option}={given!r} is not {accepted}") from None
    preset = next((name for name, dtypes in STATE_PRESETS.items() if dtypes == pair), None)
    return preset or "+".join(SHORT_NAMES[d] for d in pair)


def state_pair(choice) -> tuple[torch.dtype, torch.dtype]:
    """(exp_avg, exp_avg_sq) dtypes of a level ('O1', 'O2', 'O3'), a preset ('fp8'), or a pair as it is."""
    if isinstance(choice, str):
        if choice in LEVEL_STATE_DTYPES:
            return LEVEL_STATE_DTYPES[choice]
        if choice in STATE_PRESETS:
            return STATE_PRESETS[choice]
        choice = choice.split("+")  # "e4m3+e4m3", as FP8RecipeKwargs.optimizer_states spells a pair
    m, v = choice
    return state_dtype("exp_avg_dtype", m), state_dtype("exp_avg_sq_dtype", v)


def fused_adam_moments_problem(recipe_name: str | None, states: str | None) -> str | None:
    """Why TE's FusedAdam cannot keep `states` under TE's `recipe_name` with fp8_weights, or None. Both moments in
    BF16 go to its kernels as stored, and the kernel that steps delayed-scaling FP8 weights (`multi_tensor_adam_fp8`)
    takes FP32 moments only; any other choice is unscaled to FP32 for it."""
    if recipe_name != "delayed" or states is None:
        return None
    if {FUSED_ADAM_STATE_DTYPES.get(d) for d in state_pair(states)} == {torch.bfloat16}:
        return (f"FP8RecipeKwargs(backend='te', recipe='delayed', fp8_weights=True, optimizer_states={states!r}): "
                "TE's FusedAdam hands BF16 moments to its kernel as stored, and its kernel for delayed-scaling FP8 "
                "weights takes FP32 moments only; use recipe='current', or optimizer_states 'fp16', 'fp8' or a pair "
                "that is not both 'bf16'")
    return None


def state_description(choice) -> str:
    """'FP8 E4M3+FP16' for O2 / 'fp8': the optimizer-state column of the precision table."""
    m, v = state_pair(choice)
    return f"{STATE_NAMES[m]}+{STATE_NAMES[v]}"


def state_bytes(choice) -> int:
    m, v = state_pair(choice)
    return m.itemsize + v.itemsize


def check_optimizer(optimizer: torch.optim.Optimizer, choice, *, backend: str, asked: str | None = None) -> None:
    """Raise ValueError if `optimizer` cannot become a low-bit Adam with the states `choice` names.

    `asked` is the FP8RecipeKwargs option that asked for low-bit Adam as the user set it, for the message
    (`choice` may be what it implies: FP32 states for weight_dtype='fp16'); None: `choice` itself.
    """
    if isinstance(optimizer, LowBitAdamW):
        return
    if asked is None:
        shown = choice if isinstance(choice, str) else state_description(choice)
        asked = f"{'opt_level' if choice in LEVEL_ROWS else 'optimizer_states'}={shown!r}"
    needs = (f"FP8RecipeKwargs(backend={backend!r}): {asked} needs lowprec's low-bit Adam (optimizer states "
             f"{state_description(choice)})")
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise ValueError(
            f"{needs}: pass torch.optim.Adam or torch.optim.AdamW (replaced by LowBitAdam / LowBitAdamW) or "
            f"lowprec.optim.LowBitAdamW; got {type(optimizer).__name__}"
        )
    if optimizer.defaults.get("amsgrad"):
        raise ValueError(f"{needs}, which has no AMSGrad variant (MS-AMP's neither); use amsgrad=False")


def low_bit_optimizer(optimizer: torch.optim.Optimizer, choice, *, backend: str,
                      asked: str | None = None) -> LowBitAdamW:
    """The LowBitAdam(W) that replaces `optimizer` with the states `choice` names (a level, a
    preset or a dtype pair); a LowBitAdamW is returned as is.

    Hyper-parameters and extra group keys (a scheduler's `initial_lr`) are kept; torch's
    implementation switches (foreach, fused, capturable, ...) are dropped.
    """
    if isinstance(optimizer, LowBitAdamW):
        return optimizer  # the user chose its state dtypes
    check_optimizer(optimizer, choice, backend=backend, asked=asked)
    defaults = optimizer.defaults
    decoupled = isinstance(optimizer, torch.optim.AdamW) or defaults.get("decoupled_weight_decay", False)
    m_dtype, v_dtype = state_pair(choice)
    switches = set(defaults) - {"lr", "betas", "eps", "weight_decay", "maximize"}
    groups = [{k: v for k, v in group.items() if k not in switches} for group in optimizer.param_groups]
    cls = LowBitAdamW if decoupled else LowBitAdam
    new = cls(groups, lr=float(defaults["lr"]), betas=tuple(defaults["betas"]), eps=defaults["eps"],
              weight_decay=defaults["weight_decay"], exp_avg_dtype=m_dtype, exp_avg_sq_dtype=v_dtype,
              maximize=defaults.get("maximize", False))
    if optimizer.state:
        log.warning("lowprec: the optimizer passed to prepare() had state; %s starts from fresh moments", cls.__name__)
    log.info("lowprec: %s -> %s (states %s)", type(optimizer).__name__, cls.__name__, state_description(choice))
    return new


def built_states(optimizer: torch.optim.Optimizer, param_dtype: str) -> str:
    """What `optimizer` stores its moments in, as the plan writes it ('FP8 E4M3+FP16', 'FP32+FP32').

    A LowBitAdam(W) says per group; TE's FusedAdam with master weights in its `exp_avg_dtype` / `exp_avg_sq_dtype`
    (uint8: FP8 E4M3); torch's own optimizers keep states in the parameters' dtype.
    """
    moments = fused_adam_moments(optimizer)
    if moments is not None:
        return state_description(moments)
    if not isinstance(optimizer, LowBitAdamW):
        return f"{param_dtype}+{param_dtype}"
    kinds = {state_description((g["exp_avg_dtype"], g["exp_avg_sq_dtype"])) for g in optimizer.param_groups}
    return " / ".join(sorted(kinds))


def fused_adam_moments(optimizer: torch.optim.Optimizer) -> tuple[torch.dtype, torch.dtype] | None:
    """(exp_avg, exp_avg_sq) storage of TE's FusedAdam keeping master weights (te's fp8_weights), E4M3 for its uint8;
    None for any other optimizer."""
    if not getattr(optimizer, "master_weights", False):
        return None
    dtypes = (getattr(optimizer, "exp_avg_dtype", None), getattr(optimizer, "exp_avg_sq_dtype", None))
    if not all(d in _FROM_FUSED_ADAM for d in dtypes):
        return None
    return _FROM_FUSED_ADAM[dtypes[0]], _FROM_FUSED_ADAM[dtypes[1]]
