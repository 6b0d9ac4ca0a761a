"""Which modules become FP8, and why the others stay in high precision."""

from __future__ import annotations

import re
from dataclasses import dataclass
from difflib import get_close_matches
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from ..frontend.recipe import FP8RecipeKwargs


class SelectionBackend(Protocol):
    """What `select_modules` asks of a backend: a `lowprec.backends.Backend` answers all of it. A protocol, not
    the class itself, so that selection names nothing from the adapters, which import the plan and through it
    this module (issue 28: no import circle, not even one of type names)."""

    @property
    def name(self) -> str: ...
    @property
    def pads_inner_dim(self) -> bool: ...
    @property
    def reuses_parameters(self) -> bool: ...
    def candidate_kind(self, module: nn.Module) -> str | None: ...
    def constraint(self, module: nn.Module) -> str | None: ...
    def slow_shape(self, module: nn.Module) -> str | None: ...
    def slow_replacement(self, module: nn.Module, kind: str) -> str | None: ...
    def is_converted(self, module: nn.Module) -> bool: ...
    def converted_kind(self, module: nn.Module) -> str | None: ...


@dataclass(frozen=True)
class ModuleDecision:
    """One candidate module: converted to FP8 or kept in high precision, and why."""

    fqn: str
    kind: str  # "linear", "layernorm", "rmsnorm"
    shape: tuple[int, ...]  # (out_features, in_features) for linears, normalized shape for norms
    params: int
    convert: bool
    reason: str
    # For a module kept in high precision: the rule that kept it (exclude, include, module_filter_fn,
    # skip_first_last, skip_first_blocks, skip_last_blocks, tied, constraint, skip_slow_shapes) and the recipe
    # option that would convert it.
    rule: str = ""
    option: str = ""


def _matches(fqn: str, patterns) -> str | None:
    """The first pattern naming `fqn` or a module that contains it ("mlp" covers "layers.0.mlp.up")."""
    parts = fqn.split(".")
    names = [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
    for pattern in patterns:
        # Globs match a whole name; a bare name ("lm_head") also matches as the last component.
        if any(fnmatchcase(name, pattern) or fnmatchcase(name, f"*.{pattern}") for name in names):
            return pattern
    return None


def check_patterns_match(model: nn.Module, patterns, field: str) -> None:
    """Raise ValueError for an exclude (or include) pattern that names no module of `model`: a typo
    ("lm_haed") would otherwise leave the module it meant in FP8 (out of FP8) with nothing said."""
    names = [fqn or "<root>" for fqn, _ in model.named_modules()]
    effect = ("keeps nothing in high precision" if field == "exclude" else
              "converts nothing (the other patterns still do)")
    for pattern in patterns:
        if any(_matches(name, (pattern,)) for name in names):
            continue
        # Compare with every dotted suffix too: a bare name matches the last components of a full name.
        suffixes = {".".join(name.split(".")[i:]) for name in names for i in range(name.count(".") + 1)}
        close = get_close_matches(pattern, sorted(suffixes), n=3, cutoff=0.6)
        raise ValueError(
            f"FP8RecipeKwargs.{field} has {pattern!r}, which matches no module of {type(model).__name__}: patterns "
            "are fnmatch-style module names (a bare name also matches the last components, 'lm_head' covers "
            f"'model.lm_head'), and one that matches nothing {effect}. "
            + (f"Closest module names: {', '.join(map(repr, close))}" if close
               else "No module name is close; print(model) lists them")
        )


BLOCK_RULES = ("skip_first_blocks", "skip_last_blocks")
# One block's reason, written by _kept_blocks and read back by blocks_label to name a run of blocks at once.
_BLOCK_REASON = re.compile(r"in block (\d+) of (.+) \(((?:skip_first_blocks|skip_last_blocks)=\d+)\)")


def find_blocks(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The model's list of transformer blocks, as (name, list), or None.

    The rule: of every nn.ModuleList in the model (at any depth: `model.layers`, `transformer.h`,
    `model.decoder.layers`) whose two or more children are all of one class, the one holding the most
    parameters; a tie goes to the one with more children, then to the first registered. One class only,
    because a list of different modules (heads, adapters) is not a stack of repeated layers; the most
    parameters, because a decoder's layers hold nearly all of them, while lists of the same class inside a
    block (MoE experts) or beside the stack (one head per codebook) hold a fraction. A list with no
    parameters has no layer to keep in high precision, so it does not count.
    """
    best, best_key = None, None
    for fqn, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 2 or len({type(c) for c in module}) != 1:
            continue
        params = sum(p.numel() for p in module.parameters())
        key = (params, len(module))
        if params and (best_key is None or key > best_key):
            best, best_key = (fqn, module), key
    return best


def _kept_blocks(model: nn.Module, recipe: FP8RecipeKwargs) -> dict[str, tuple[str, str]]:
    """name of each block skip_first_blocks / skip_last_blocks keep -> (reason, rule); empty when both are 0.

    Raises ValueError when they ask for blocks and the model has no block list, or fewer blocks than asked."""
    first, last = recipe.skip_first_blocks or 0, recipe.skip_last_blocks or 0
    if not first and not last:
        return {}
    found = find_blocks(model)
    if found is None:
        asked = [f"{name}={n}" for name, n in (("skip_first_blocks", first), ("skip_last_blocks", last)) if n]
        raise ValueError(
            f"FP8RecipeKwargs.{' and '.join(asked)} {'keep' if len(asked) > 1 else 'keeps'} whole transformer "
            "blocks in high precision, but "
            f"{type(model).__name__} has no block list: lowprec looks for an nn.ModuleList of two or more modules "
            "of one class that hold parameters (as transformers models keep their layers: model.layers, "
            "transformer.h, model.decoder.layers). Name the modules to keep with exclude instead "
            "(e.g. exclude=['layers.0.*'])"
        )
    name, blocks = found
    count, kind = len(blocks), type(blocks[0]).__name__
    if first + last > count:
        raise ValueError(
            f"FP8RecipeKwargs.skip_first_blocks={first} and skip_last_blocks={last} keep {first + last} blocks in "
            f"high precision, but {type(model).__name__} has {count} ({kind} in {name or '<root>'}): together they "
            f"can keep at most {count}"
        )
    kept = {}
    for index in range(count):
        if index < first:
            rule, n = "skip_first_blocks", first
        elif index >= count - last:
            rule, n = "skip_last_blocks", last
        else:
            continue
        kept[f"{name}.{index}" if name else str(index)] = (f"in block {index} of {name or '<root>'} ({rule}={n})", rule)
    return kept


def _in_block(fqn: str, kept: dict[str, tuple[str, str]]) -> tuple[str, str] | None:
    """(reason, rule) if `fqn` is a kept block or lies inside one."""
    if not kept:
        return None
    parts = fqn.split(".")
    for i in range(1, len(parts) + 1):
        if (hit := kept.get(".".join(parts[:i]))) is not None:
            return hit
    return None


def blocks_label(reasons: list[str]) -> str | None:
    """'blocks 0-1 of model.layers (skip_first_blocks=2)' for block reasons of one list and one option
    ("in block 0 of model.layers (skip_first_blocks=2)", ...), the reason itself for one block; None for any
    other reasons."""
    matches = [_BLOCK_REASON.fullmatch(r) for r in reasons]
    if not matches or not all(matches) or len({m.group(2, 3) for m in matches}) != 1:
        return None
    numbers = {int(m.group(1)) for m in matches}
    if len(numbers) == 1:
        return reasons[0]
    return f"blocks {number_runs(numbers)} of {matches[0].group(2)} ({matches[0].group(3)})"


def number_runs(numbers) -> str:
    """'0,2-5' for {0, 2, 3, 4, 5}."""
    numbers = sorted(numbers)
    runs, start = [], numbers[0]
    for prev, cur in zip(numbers, [*numbers[1:], None]):
        if cur != prev + 1:
            runs.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
    return ",".join(runs)


def block_reason_key(reason: str) -> str:
    """`reason` with its block number taken out, so the modules of several kept blocks group together."""
    return _BLOCK_REASON.sub(lambda m: f"in a block of {m.group(2)} ({m.group(3)})", reason)


def _shape(module: nn.Module, kind: str) -> tuple[int, ...]:
    if kind == "linear":
        return (module.out_features, module.in_features)
    shape = getattr(module, "normalized_shape", None)
    if shape is None and getattr(module, "weight", None) is not None:
        shape = module.weight.shape
    return tuple(shape or ())


def select_modules(model: nn.Module, recipe: FP8RecipeKwargs, backend: SelectionBackend) -> list[ModuleDecision]:
    """Decide every candidate module of `model` for `backend`, in registration order.

    The checks run in a fixed order and the first that keeps a module in high precision is its
    reported reason: exclude, include, module_filter_fn, skip_first_last, skip_first_blocks /
    skip_last_blocks, a weight tied elsewhere, the backend's hard constraint (shape), then the speed rule
    (skip_slow_shapes). Each module is decided on its own: one unfit module never affects its siblings.
    Raises ValueError for an exclude pattern naming no module, and for skip_first_blocks / skip_last_blocks
    on a model with no block list or fewer blocks than they keep.
    """
    check_patterns_match(model, recipe.exclude, "exclude")
    if recipe.include is not None:
        check_patterns_match(model, recipe.include, "include")
    kept_blocks = _kept_blocks(model, recipe)
    candidates = []
    for fqn, module in model.named_modules():
        kind = "converted" if backend.is_converted(module) else backend.candidate_kind(module)
        if kind is None and _is_conv1d(module):
            kind = "conv1d"
        if kind is not None:
            candidates.append((fqn, module, kind))
    owners = _parameter_owners(model)
    linears = [fqn for fqn, _, kind in candidates if kind == "linear"]
    edge = {linears[0]: "first", linears[-1]: "last"} if linears else {}

    decisions = []
    for fqn, module, kind in candidates:
        if kind == "converted":
            decisions.append(
                ModuleDecision(fqn, backend.converted_kind(module) or "linear", (),
                               sum(p.numel() for p in module.parameters(recurse=False)), True, "already an FP8 module")
            )
            continue
        name = fqn or "<root>"
        params = sum(p.numel() for p in module.parameters(recurse=False))
        if kind == "conv1d":
            # listed, not passed over: a GPT-2 plan must not read as if the model had no Linear layers
            n_in, n_out = module.weight.shape
            decisions.append(ModuleDecision(name, "linear", (n_out, n_in), params, False, CONV1D_REASON, "conv1d",
                                            CONV1D_OPTION))
            continue
        reason = rule = None
        if (pattern := _matches(name, recipe.exclude)) is not None:
            reason, rule = f"excluded by pattern {pattern!r}", "exclude"
        elif recipe.include is not None and _matches(name, recipe.include) is None:
            reason, rule = "not matched by any include pattern", "include"
        elif recipe.module_filter_fn is not None and not recipe.module_filter_fn(module, fqn):
            reason, rule = "module_filter_fn returned False", "module_filter_fn"
        elif kind == "linear" and recipe.skip_first_last and fqn in edge:
            reason, rule = f"{edge[fqn]} Linear layer (skip_first_last=True)", "skip_first_last"
        elif (block := _in_block(fqn, kept_blocks)) is not None:
            reason, rule = block
        elif not backend.reuses_parameters and (tied := _tied_to(module, owners)) is not None:
            reason = (f"weight shared with {tied!r} ({backend.name} builds new parameters, so converting would untie "
                      "them)")
            rule = "tied"
        elif (why := backend.constraint(module)) is not None:
            reason, rule = why, "constraint"
        elif recipe.skip_slow_shapes and (why := backend.slow_shape(module) if kind == "linear"
                                          else backend.slow_replacement(module, kind)):
            reason, rule = f"{why} (skip_slow_shapes=True)", "skip_slow_shapes"
        decisions.append(
            ModuleDecision(name, kind, _shape(module, kind), params, reason is None, reason or "FP8",
                           rule or "", _option(rule, backend, kind, pattern) if rule else "")
        )
    return decisions


CONV1D_REASON = "transformers Conv1D (GPT-2's Linear, its weight stored transposed): no FP8 backend replaces it"
CONV1D_OPTION = "none in lowprec: the same layer as an nn.Linear (weight transposed) would run in FP8"


def _is_conv1d(module: nn.Module) -> bool:
    """transformers' `Conv1D` (GPT-2, GPT-J's ancestors): a Linear whose (in, out) weight is transposed."""
    weight = getattr(module, "weight", None)
    return type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor) and weight.dim() == 2


def _option(rule: str, backend: SelectionBackend, kind: str, pattern: str | None) -> str:
    """The recipe option (and value) that would convert a module `rule` kept in high precision."""
    if rule == "exclude":
        return f"remove {pattern!r} from exclude"
    if rule == "constraint":
        if kind != "linear":
            return ""  # a norm the backend's module cannot stand in for; no option changes that
        # A Linear's constraint is its dimensions, which only padding can change.
        if backend.pads_inner_dim:
            return "pad_inner_dim=True pads them to what the FP8 GEMMs need"
        return (f"backend {backend.name!r} cannot pad them (only backend='torchao' has pad_inner_dim=True); "
                "resize them to fit")
    return {
        "include": "add a pattern naming them to include (include=None considers every module)",
        "module_filter_fn": "let module_filter_fn return True for them (or module_filter_fn=None)",
        "skip_first_last": "skip_first_last=False converts them",
        "skip_first_blocks": "skip_first_blocks=0 converts them",
        "skip_last_blocks": "skip_last_blocks=0 converts them",
        "tied": "untie the weights, or backend='torchao' (it keeps the shared Parameter)",
        "skip_slow_shapes": ("skip_slow_shapes=False converts them anyway (FP8, though slower at these shapes)"
                             if kind == "linear" else "skip_slow_shapes=False replaces them anyway (though slower)"),
    }[rule]


def _parameter_owners(model: nn.Module) -> dict[int, list[tuple[str, nn.Module]]]:
    """id(parameter) -> every (name, module) that registers it (tied weights have several)."""
    owners: dict[int, list[tuple[str, nn.Module]]] = {}
    for fqn, module in model.named_modules(remove_duplicate=False):
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), []).append((fqn, module))
    return owners


def _tied_to(module: nn.Module, owners: dict[int, list[tuple[str, nn.Module]]]) -> str | None:
    """Another module sharing a parameter with `module` (one module registered twice is not a tie)."""
    for p in module.parameters(recurse=False):
        for fqn, other in owners.get(id(p), []):
            if other is not module:
                return fqn or "<root>"
    return None
