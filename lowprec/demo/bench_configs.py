"""`lowprec bench`'s configurations: how one is written, which ones this machine can run, and why a named one
cannot, checked before any run."""

from __future__ import annotations

import argparse

from ..runtime.activations_fp32 import POLICIES as FP32_POLICIES
from .run import AMAX_COMPUTE_ALGOS, OPTIMIZER_STATES

LEVELS = (None, "O1", "O2")


# Switches a configuration may set after a comma ("torchao:tensorwise,skip_first_last=false"), so one bench
# compares a default against the same backend with a layer rule (or the in-graph FP8 activations) turned off,
# each in its own process.
CONFIG_OPTIONS = ("skip_first_last", "skip_slow_shapes", "activations_in_graph", "te_first_scales", "fp8_weights")
_BOOLS = {"true": True, "false": False}
# Recipe fields a configuration may set to one of a few values ("msamp:delayed:O2,activation_dtype=fp8").
VALUE_OPTIONS = {"activation_dtype": ("fp8",), "activations_fp32": FP32_POLICIES,
                 "optimizer_states": OPTIMIZER_STATES, "amax_compute_algo": AMAX_COMPUTE_ALGOS}


def parse_config(text: str) -> dict:
    """'bf16' or 'backend:recipe[:level][,option=true|false...]' -> {"name", "backend", "recipe",
    "opt_level", "options"} (bf16: backend None; options: CONFIG_OPTIONS given)."""
    if text == "bf16":
        return {"name": "bf16", "backend": None, "recipe": None, "opt_level": None, "options": {}}
    head, *extras = text.split(",")
    parts = head.split(":")
    if len(parts) not in (2, 3) or not all(parts):
        raise argparse.ArgumentTypeError(f"configuration {text!r} is not 'bf16' or 'backend:recipe[:level]' "
                                         "(e.g. torchao:tensorwise, msamp:delayed:O2)")
    level = parts[2] if len(parts) == 3 else None
    if level is not None and level not in ("O1", "O2", "O3"):
        raise argparse.ArgumentTypeError(f"configuration {text!r}: level {level!r} is not one of O1, O2, O3")
    options = {}
    for extra in extras:
        key, _, value = extra.partition("=")
        if key in VALUE_OPTIONS and value.lower() in VALUE_OPTIONS[key]:
            options[key] = value.lower()
        elif key in CONFIG_OPTIONS and value.lower() in _BOOLS:
            options[key] = _BOOLS[value.lower()]
        else:
            accepted = [k + "=true|false" for k in CONFIG_OPTIONS]
            accepted += [f"{k}={'|'.join(values)}" for k, values in VALUE_OPTIONS.items()]
            raise argparse.ArgumentTypeError(
                f"configuration {text!r}: option {extra!r} is not one of {', '.join(accepted)}")
    for key in ("activations_fp32", "activations_in_graph"):
        if key in options and options.get("activation_dtype") != "fp8":
            raise argparse.ArgumentTypeError(f"configuration {text!r}: {key} says how FP8 activations are stored: "
                                             "it needs activation_dtype=fp8")
    if "te_first_scales" in options and (parts[0], parts[1]) != ("te", "delayed"):
        raise argparse.ArgumentTypeError(f"configuration {text!r}: te_first_scales says how te's DelayedScaling "
                                         "casts its first step: it needs te:delayed")
    if "fp8_weights" in options and parts[0] != "te":
        raise argparse.ArgumentTypeError(f"configuration {text!r}: fp8_weights keeps TransformerEngine's weights in "
                                         "FP8 only: it needs backend te")
    return {"name": text, "backend": parts[0], "recipe": parts[1], "opt_level": level, "options": options}


def available_configs(compiled: bool, skipped: dict[str, str] | None = None) -> list[str]:
    """Every backend x recipe x level that can run on this machine, as lowprec would decide it; with
    `skipped`, each configuration left out is recorded there with lowprec's reason."""
    from ..backends import BackendUnavailableError, RunContext, create_backend, registered_backends
    from ..frontend.recipe import FP8RecipeKwargs
    from ..planning.hardware import device_info

    context = RunContext(device=device_info(), compiled=compiled)
    names = ["bf16"]
    for cls in registered_backends():
        for recipe in cls.recipes:
            for level in LEVELS:
                try:
                    create_backend(FP8RecipeKwargs(backend=cls.name, recipe=recipe, opt_level=level), context)
                except (ValueError, BackendUnavailableError) as exc:
                    if skipped is not None:
                        skipped[f"{cls.name}:{recipe}" + (f":{level}" if level else "")] = str(exc)
                    continue
                names.append(f"{cls.name}:{recipe}" + (f":{level}" if level else ""))
    return names


# The options that are FP8RecipeKwargs fields (the others are environment switches of lowprec.demo.run)
RECIPE_OPTIONS = ("skip_first_last", "skip_slow_shapes", "activation_dtype", "optimizer_states", "amax_compute_algo",
                  "fp8_weights")


def config_problems(configs: list[dict], compiled: bool) -> tuple[list[str], bool]:
    """Why named configurations cannot run, before BF16 ran: (each problem, whether one is this bench's mode's).

    Each FP8 configuration is made into its FP8RecipeKwargs and adapter as its run would make them, so that a
    recipe its backend lacks, a level or option the recipe refuses, a missing package and TE's DelayedScaling
    compiled are each named in seconds, not after BF16's run as a failed row (torchao:nonsense once trained BF16
    first)."""
    from ..backends import BackendUnavailableError, RunContext, backend_class, create_backend
    from ..frontend.recipe import FP8RecipeKwargs
    from ..planning.hardware import device_info

    context, problems, of_mode = RunContext(device=device_info(), compiled=compiled), [], False
    for config in (c for c in configs if c["backend"] is not None):
        try:
            if config["backend"] != "auto":  # the mode's rule first: its message says how to change the mode
                mode_problem = backend_class(config["backend"]).context_problem(config["recipe"], context)
                if mode_problem:
                    problems.append(f"configuration {config['name']!r}: {mode_problem}")
                    of_mode = True
                    continue
            options = {k: v for k, v in config["options"].items() if k in RECIPE_OPTIONS}
            create_backend(FP8RecipeKwargs(backend=config["backend"], recipe=config["recipe"],
                                           opt_level=config["opt_level"], **options), context)
        except (ValueError, BackendUnavailableError) as exc:
            problems.append(f"configuration {config['name']!r}: {exc}")
    return problems, of_mode
