"""Parsing of `FP8RecipeKwargs` field values, from code or from the environment, into their canonical form;
every error names the field and what it accepts."""

from __future__ import annotations

import ast
import re
from collections.abc import Sequence
from typing import Any

from ..optim.levels import parse_states
from .specs import canonical_name

FP8_FORMATS = ("HYBRID", "E4M3")
AMAX_COMPUTE_ALGOS = ("max", "most_recent")
OPT_LEVELS = ("O1", "O2", "O3")
WEIGHT_DTYPES = ("fp32", "fp16", "bf16")
WEIGHT_GRAD_DTYPES = ("fp32", "bf16", "fp8")
GRAD_COMM_DTYPES = ("fp32", "bf16", "fp8")
# Saved activations are either left as autograd saves them (None) or stored in FP8; a 16-bit "choice" would
# only restate the autocast dtype, so those spellings are refused rather than silently meaning "off".
ACTIVATION_DTYPES = ("fp8",)
ACTIVATION_OFF = ("", "none", "off", "false", "0")
# TE takes any int for both (MS-AMP fixes margin at 0): past these bounds a run does not fail where the value is
# written, it trains badly or runs out of memory later.
# margin backs the scale off by 2**margin, so the amax lands near 448 * 2**-margin in E4M3, whose normals span
# 2**-6..448: at 8 the amax sits near 1 and only the top 7 of ~15 binades stay normal (8 also means room for a
# 256x amax jump between steps, far past what delayed scaling needs). Beyond it values go subnormal: from 16
# the amax itself does (forward error 57% on Gaussian data, 87-112% measured on a model; 100% at 20), and past
# ~150 the FP32 scale underflows to 0 and training turns NaN.
MAX_MARGIN = 8
MARGIN_WHY = ("a power-of-2 backoff of the scale: beyond 8 most of E4M3's range (2**-6..448) is left unused "
              "and values underflow")
# The history is kept per scaled tensor on the device and reduced every step: 64x TE's default (1024) and 4096x
# MS-AMP's (16) is already a window longer than most runs, while 10**9 steps would be 4 GB per tensor.
MAX_AMAX_HISTORY_LEN = 65536
AMAX_HISTORY_WHY = ("steps of amax history, kept per scaled tensor on the device: TE's default is 1024 and "
                    "MS-AMP's 16; a longer window outlasts most runs and only costs memory")
# No upper bound here: the recipe does not know the model, planning checks the sum against its block count.
BLOCKS_WHY = "a number of whole transformer blocks kept in high precision, 0 for none"

_INTEGER = re.compile(r"[+-]?[0-9]+", re.ASCII)

_DTYPE_ALIASES = {"float32": "fp32", "torch.float32": "fp32", "float": "fp32", "float16": "fp16", "half": "fp16",
                  "torch.float16": "fp16", "bfloat16": "bf16", "torch.bfloat16": "bf16", "e4m3": "fp8",
                  "float8_e4m3fn": "fp8", "torch.float8_e4m3fn": "fp8"}


def _parse_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        v = value.strip().lower()
        if v in ("1", "true", "yes", "on"):
            return True
        if v in ("0", "false", "no", "off"):
            return False
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ValueError(f"FP8RecipeKwargs.{name}={value!r} is not a boolean (True/False, or '1'/'0', 'true'/'false')")


def _parse_int(name: str, value: Any, minimum: int, maximum: int | None, why: str) -> int:
    bounds = f">= {minimum}" + (f" and <= {maximum}" if maximum is not None else "")
    message = f"FP8RecipeKwargs.{name}={value!r} must be an integer {bounds} ({why})"
    # ASCII digits only: str.isdigit() also passes "²" and "٣", which int() then refuses (or reads) on its own terms
    if isinstance(value, str) and _INTEGER.fullmatch(value.strip()):
        try:
            value = int(value)
        except ValueError:  # more digits than int() converts (sys.set_int_max_str_digits)
            raise ValueError(message) from None
    if (isinstance(value, bool) or not isinstance(value, int) or value < minimum
            or (maximum is not None and value > maximum)):
        raise ValueError(message)
    return value


def _parse_choice(name: str, value: Any, choices: Sequence[str], *, upper: bool, written: Any = None) -> str:
    """`value` as one of `choices`; the error quotes `written` where given (what the user wrote, before an alias
    mapped it)."""
    text = str(value).strip()
    text = text.upper() if upper else text.lower()
    if text not in choices:
        hint = ""
        if name == "fp8_format" and text == "E5M2":
            hint = " (pure E5M2 training is not supported by any backend: E5M2 is used for gradients by 'HYBRID')"
        shown = value if written is None else written
        raise ValueError(
            f"FP8RecipeKwargs.{name}={shown!r} is not one of {', '.join(repr(c) for c in choices)}{hint}"
        )
    return text


def _parse_dtype(name: str, value: Any, choices: Sequence[str]) -> str:
    """A dtype field: its name or alias ('bfloat16', torch.float16, ...) as one of `choices`."""
    text = str(value).strip().lower()
    return _parse_choice(name, _DTYPE_ALIASES.get(text, text), choices, upper=False, written=value)


def _parse_patterns(name: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str) and value.strip()[:1] in "[(" and value.strip():
        # accelerate launch exports a yaml list as its Python repr: "['lm_head', 'layers.0.*']"
        try:
            value = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            raise ValueError(f"FP8RecipeKwargs.{name}={value!r} looks like a list but does not parse as one") from None
    if isinstance(value, str):
        items = [p.strip() for p in value.split(",")]
    elif isinstance(value, Sequence) and not isinstance(value, (bytes, bytearray)):
        items = list(value)
    else:
        raise ValueError(
            f"FP8RecipeKwargs.{name}={value!r} must be a list of module-name patterns "
            "(fnmatch style, e.g. ['lm_head', '*.mlp.*']) or a comma-separated string"
        )
    for item in items:
        if not isinstance(item, str) or not item:
            raise ValueError(f"FP8RecipeKwargs.{name} has {item!r}; every pattern must be a non-empty string")
    return tuple(items)


def _parse_states(value: Any) -> str:
    """'fp8', ('e4m3', 'fp16'), 'e4m3,fp16', torch dtypes, or the yaml list `accelerate launch`
    exports as its Python repr -> a preset name or 'm+v'."""
    if isinstance(value, str) and value.strip()[:1] in "[(":
        try:
            value = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            pass  # parse_states names what it accepts
    return parse_states("FP8RecipeKwargs.optimizer_states", value)


def _parse_activation_dtype(value: Any) -> str | None:
    text = str(value).strip().lower()
    if value is False or text in ACTIVATION_OFF:
        return None
    if _DTYPE_ALIASES.get(text, text) in ACTIVATION_DTYPES:
        return "fp8"
    raise ValueError(
        f"FP8RecipeKwargs.activation_dtype={value!r} is not one of 'fp8' (E4M3 with a power-of-2 scale per 128 "
        "values; 'e4m3' accepted) or None (saved activations stay in the dtype autograd saves them in; 'none' and "
        "'off' accepted): 16-bit activations are the autocast dtype's, not an FP8 option")


def parse_field(name: str, value: Any) -> Any:
    """`value` of field `name` in its canonical form; ValueError naming the field and what it accepts."""
    if name == "backend":
        return canonical_name(value)
    if name == "recipe":
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"FP8RecipeKwargs.recipe={value!r} must be a recipe name (a non-empty string)")
        return value.strip().lower()
    if name == "fp8_format":
        return _parse_choice(name, value, FP8_FORMATS, upper=True)
    if name == "amax_compute_algo":
        return _parse_choice(name, value, AMAX_COMPUTE_ALGOS, upper=False)
    if name == "weight_dtype":
        return _parse_dtype(name, value, WEIGHT_DTYPES)
    if name == "grad_comm_dtype":
        return _parse_dtype(name, value, GRAD_COMM_DTYPES)
    if name == "weight_grad_dtype":
        return _parse_dtype(name, value, WEIGHT_GRAD_DTYPES)
    if name == "optimizer_states":
        return _parse_states(value)
    if name == "activation_dtype":
        return _parse_activation_dtype(value)
    if name == "opt_level":
        if isinstance(value, str) and value.strip().lower() in ("", "none", "o0"):
            return None
        return _parse_choice(name, value, OPT_LEVELS, upper=True)
    if name == "margin":
        return _parse_int(name, value, 0, MAX_MARGIN, MARGIN_WHY)
    if name == "amax_history_len":
        return _parse_int(name, value, 1, MAX_AMAX_HISTORY_LEN, AMAX_HISTORY_WHY)
    if name in ("skip_first_blocks", "skip_last_blocks"):
        return _parse_int(name, value, 0, None, BLOCKS_WHY)
    if name in ("include", "exclude"):
        return _parse_patterns(name, value)
    if name in ("module_filter_fn", "name"):
        return value
    return _parse_bool(name, value)
