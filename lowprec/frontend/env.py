"""Reading FP8 options from `ACCELERATE_FP8_*` environment variables.

`accelerate launch` turns every key of a config file's `fp8_config:` section into
`ACCELERATE_FP8_<KEY>`. It also exports its own CLI defaults for a fixed set of keys whenever
`--mixed_precision fp8` is on, whether or not the user chose them (checked against accelerate 1.15:
`OPT_LEVEL=O2`, `PAD_INNER_DIM=1`, `AMAX_COMPUTE_ALGO=most_recent`, ...). Taken at face value those
would silently pick an MS-AMP memory level or contradict a torchao recipe, so when the launcher's
marker is present, a value equal to the launcher's default is treated as "not chosen": set aside,
neither applied nor warned about (the plan's notes name those that would change the run). Any other
value can only come from the user and is applied. A key written as `ACCELERATE_FP8_LOWPREC_<KEY>`
(config file: `lowprec_<key>:`) is always taken as chosen.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from .named_recipes import name_key
from .parsing import parse_field
from .specs import TE_REMOVED_OPTIONS

log = logging.getLogger(__name__)

PREFIX = "ACCELERATE_FP8_"
LOWPREC_PREFIX = "ACCELERATE_FP8_LOWPREC_"

# Exported by `accelerate launch --mixed_precision fp8` from argparse defaults (accelerate 1.15,
# commands/launch.py "FP8 Arguments"; values as `str()` of the parsed default).
LAUNCHER_DEFAULTS: dict[str, str] = {
    "USE_AUTOCAST_DURING_EVAL": "False",
    "MARGIN": "0",
    "INTERVAL": "1",
    "FORMAT": "HYBRID",
    "AMAX_HISTORY_LEN": "1024",
    "AMAX_COMPUTE_ALGO": "most_recent",
    "OVERRIDE_FPROP": "False",
    "OVERRIDE_DGRAD": "False",
    "OVERRIDE_WGRAD": "False",
    "OPT_LEVEL": "O2",
    "ENABLE_FSDP_FLOAT8_ALL_GATHER": "1",
    "PAD_INNER_DIM": "1",
}
# Only the launcher sets this one, and it always does.
LAUNCHER_MARKER = PREFIX + "OVERRIDE_FPROP"

# field -> accepted keys (after the prefix). Later names are aliases: the ones accelerate's
# `accelerate config` wizard writes by mistake, which accelerate itself never reads.
FIELD_KEYS: dict[str, tuple[str, ...]] = {
    "backend": ("BACKEND",),
    "recipe": ("RECIPE",),
    "fp8_format": ("FORMAT", "FP8_FORMAT"),
    "margin": ("MARGIN",),
    "amax_history_len": ("AMAX_HISTORY_LEN", "AMAX_HISTORY_LENGTH"),
    "amax_compute_algo": ("AMAX_COMPUTE_ALGO", "AMAX_COMPUTE_ALGORITHM"),
    "opt_level": ("OPT_LEVEL", "OPTIMIZATION_LEVEL"),
    "optimizer_states": ("OPTIMIZER_STATES",),
    "include": ("INCLUDE",),
    "exclude": ("EXCLUDE",),
    "skip_first_last": ("SKIP_FIRST_LAST",),
    "skip_first_blocks": ("SKIP_FIRST_BLOCKS",),
    "skip_last_blocks": ("SKIP_LAST_BLOCKS",),
    "skip_slow_shapes": ("SKIP_SLOW_SHAPES",),
    "pad_inner_dim": ("PAD_INNER_DIM",),
    "enable_fsdp_float8_all_gather": ("ENABLE_FSDP_FLOAT8_ALL_GATHER",),
    "use_autocast_during_eval": ("USE_AUTOCAST_DURING_EVAL",),
    "fp8_weights": ("FP8_WEIGHTS",),
    "weight_dtype": ("WEIGHT_DTYPE",),
    "weight_grad_dtype": ("WEIGHT_GRAD_DTYPE",),
    "grad_comm_dtype": ("GRAD_COMM_DTYPE",),
    "emulate": ("EMULATE",),
    "compile_fp8_layers": ("COMPILE_FP8_LAYERS",),
    "name": ("RECIPE_NAME", "NAME"),
    "activation_dtype": ("ACTIVATION_DTYPE",),
    "reduce_amax": ("REDUCE_AMAX",),
    "optimizer_in_backward": ("OPTIMIZER_IN_BACKWARD",),
}
# Accelerate-only keys: TE removed these options, so they are accepted only at their no-op values.
REMOVED_TE_KEYS = {
    "INTERVAL": ("1", TE_REMOVED_OPTIONS["interval"]),
    "OVERRIDE_FPROP": ("False", TE_REMOVED_OPTIONS["override_linear_precision"]),
    "OVERRIDE_DGRAD": ("False", TE_REMOVED_OPTIONS["override_linear_precision"]),
    "OVERRIDE_WGRAD": ("False", TE_REMOVED_OPTIONS["override_linear_precision"]),
}
MXFP8_KEY = "USE_MXFP8_BLOCK_SCALING"


_told_about_launcher = False


@dataclass
class EnvOptions:
    """Raw string values found in the environment, by field name."""

    values: dict[str, str] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)  # field -> variable it came from
    launcher_defaults_ignored: list[str] = field(default_factory=list)
    # field -> (variable, value) of each launcher default set aside, for the plan's notes
    launcher_defaults: dict[str, tuple[str, str]] = field(default_factory=dict)


def _meaning(name: str, value: str):
    """What `value` of field `name` means, so that two spellings of one choice ('hybrid', 'HYBRID') agree; the
    raw text where it does not parse (FP8RecipeKwargs says why when it reads it)."""
    if name == "name":
        return name_key(value)
    try:
        meaning = parse_field(name, value)
    except ValueError:
        return value
    return repr(meaning)  # hashable, whatever the field's type


def _false(value: str) -> bool:
    return value.strip().lower() in ("0", "false", "no", "off", "")


def read_fp8_env(environ: Mapping[str, str] | None = None) -> EnvOptions:
    """Collect FP8 options from `environ` (default `os.environ`).

    Raises:
        ValueError: an unknown `ACCELERATE_FP8_*` key, two spellings of one option that disagree,
            or an option TransformerEngine removed set to a value other than its no-op.
    """
    env = os.environ if environ is None else environ
    from_launcher = LAUNCHER_MARKER in env
    out = EnvOptions()
    known = {key for keys in FIELD_KEYS.values() for key in keys} | set(REMOVED_TE_KEYS) | {MXFP8_KEY}

    for var in env:
        if not var.startswith(PREFIX):
            continue
        key = var[len(LOWPREC_PREFIX):] if var.startswith(LOWPREC_PREFIX) else var[len(PREFIX):]
        if key not in known:
            raise ValueError(
                f"environment variable {var} is not an FP8 option lowprec knows "
                f"(from an `fp8_config:` key {key.lower()!r}?). Known keys: "
                + ", ".join(sorted(k.lower() for keys in FIELD_KEYS.values() for k in keys[:1]))
            )

    for key, (noop, why) in REMOVED_TE_KEYS.items():
        for var in (PREFIX + key, LOWPREC_PREFIX + key):
            value = env.get(var)
            if value is None:
                continue
            is_noop = value.strip() == noop if noop == "1" else _false(value)
            if not is_noop:
                raise ValueError(f"{var}={value!r} cannot be honoured: {why}. Remove it from fp8_config.")

    for name, keys in FIELD_KEYS.items():
        found: dict[str, str] = {}
        for key in keys:
            explicit = env.get(LOWPREC_PREFIX + key)
            if explicit is not None:
                found[LOWPREC_PREFIX + key] = explicit
            value = env.get(PREFIX + key)
            if value is None:
                continue
            if from_launcher and LAUNCHER_DEFAULTS.get(key) == value:
                out.launcher_defaults_ignored.append(f"{PREFIX}{key}={value}")
                out.launcher_defaults[name] = (PREFIX + key, value)
                continue
            found[PREFIX + key] = value
        if len({_meaning(name, v) for v in found.values()}) > 1:
            raise ValueError(
                f"FP8RecipeKwargs.{name} is set twice in the environment with different values: "
                + ", ".join(f"{k}={v!r}" for k, v in found.items())
            )
        if found:
            # The LOWPREC_ spelling, when present, names the source (it is the one written on purpose).
            var = next((v for v in found if v.startswith(LOWPREC_PREFIX)), next(iter(found)))
            value = found[var]
            out.values[name], out.sources[name] = value, var

    mxfp8_var = next((v for v in (LOWPREC_PREFIX + MXFP8_KEY, PREFIX + MXFP8_KEY) if v in env), None)
    mxfp8 = env.get(mxfp8_var) if mxfp8_var else None
    if mxfp8 is not None and not _false(mxfp8) and mxfp8.strip().lower() not in ("1", "true", "yes", "on"):
        raise ValueError(f"{mxfp8_var}={mxfp8!r} is not a boolean: '1'/'true'/'yes'/'on' asks for the MXFP8 recipe, "
                         "'0'/'false'/'no'/'off' (or empty) does not")
    if mxfp8 is not None and not _false(mxfp8):
        if out.values.get("recipe", "mxfp8").lower() != "mxfp8":
            raise ValueError(
                f"{mxfp8_var}={mxfp8!r} asks for the MXFP8 recipe but "
                f"{out.sources['recipe']}={out.values['recipe']!r} asks for another one"
            )
        out.values["recipe"], out.sources["recipe"] = "mxfp8", mxfp8_var

    global _told_about_launcher
    if out.launcher_defaults_ignored and not _told_about_launcher:
        _told_about_launcher = True
        log.info(
            "lowprec: ignoring accelerate launch's exported defaults %s (they are exported whether or not "
            "they were chosen; write `lowprec_<key>:` in fp8_config to insist on one)",
            ", ".join(out.launcher_defaults_ignored),
        )
    return out
