"""The migration page (docs/migration.md): every knob of the FP8 tools users come from, as lowprec spells it or why
lowprec does not offer it, kept as data (`migration_knobs`, `migration_megatron`) and rendered by
`render_markdown()`.

The page is generated so that it cannot drift from the code: tests/test_migration.py builds every row's
`FP8RecipeKwargs`, runs every Accelerate handler row through lowprec's own translation, reads Accelerate's handler
fields and `accelerate launch` flags from the installed Accelerate, and compares the committed page with this
rendering. Regenerate it from a checkout with

    python -m lowprec.frontend.migration [--check]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import textwrap
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from . import named_recipes
from .migration_knobs import ACCELERATE, LAUNCH, TE_RECIPES, Knob, Section
from .migration_megatron import AXOLOTL, MEGATRON
from .recipe import FP8RecipeKwargs
from .specs import TE_REMOVED_OPTIONS

PAGE = Path(__file__).resolve().parents[2] / "docs" / "migration.md"
COMMAND = "python -m lowprec.frontend.migration"
SECTIONS: tuple[Section, ...] = (*ACCELERATE, LAUNCH, TE_RECIPES, MEGATRON, AXOLOTL)

INTRO = f"""
Each knob of the FP8 tools you may come from, as lowprec spells it (`lowprec.FP8RecipeKwargs` fields unless a row
says otherwise), or *not offered*, with the reason. Every spelling in the lowprec column is built by the tests
(`FP8RecipeKwargs(**fields)`, validated against its backend); Accelerate's handlers are run through lowprec's own
translation and compared with their row; Accelerate's handler fields and `accelerate launch`'s FP8 flags are read
from the installed Accelerate, so a knob Accelerate adds fails the tests until it has a row here. The other tools'
knob lists were read from their sources (TransformerEngine's `transformer_engine/common/recipe`, NeMo's
`MegatronMixedPrecision`, Megatron-Bridge's `training/mixed_precision.py`, Axolotl's trainer) and are kept in
`lowprec/frontend/migration_megatron.py` and `migration_knobs.py`.

This page is generated: edit those files, then run `{COMMAND}` in a checkout (`--check` exits 1 when the page
is stale).
"""

# Fields no tool above has, with what each is for (a row may still set one to match another tool's behaviour):
# with the rows' targets they cover every FP8RecipeKwargs field.
LOWPREC_ONLY: dict[str, str] = {
    "include": "fnmatch patterns of the module names to convert; every other candidate stays in high precision",
    "skip_slow_shapes": "keeps in high precision the Linear layers whose shape FP8 was measured slower at "
                        "([performance.md](performance.md)); each is listed in the plan",
    "weight_dtype": "storage of converted Linear weights with no master copy: a part of an MS-AMP level as a knob "
                    "of its own ([levels.md](levels.md))",
    "weight_grad_dtype": "storage of converted Linear weight gradients (FP8 in levels O1 and O2), a knob of its own "
                         "([levels.md](levels.md))",
    "optimizer_states": "precision of Adam's moments, for any backend ([optimizer-states.md](optimizer-states.md))",
    "activation_dtype": "the tensors autograd saves in the forward stored in FP8 (E4M3, a power-of-2 scale per 128 "
                        "values), as COAT does; eager or compiled ([recipe.md](recipe.md))",
    "optimizer_in_backward": "each parameter's optimizer step run in backward as its gradient is accumulated, the "
                             "gradient freed there (torchtune's `optimizer_in_bwd`, torchtitan's "
                             "`early_step_in_backward`), one process ([recipe.md](recipe.md))",
}


def field_names() -> set[str]:
    """FP8RecipeKwargs' fields in this version."""
    return {f.name for f in dataclasses.fields(FP8RecipeKwargs)}


def spell(example: Mapping[str, Any]) -> str:
    """`backend='te', recipe='current'`: fields as written in Python (a function by its name)."""
    return ", ".join(f"{k}={v.__name__ if callable(v) else repr(v)}" for k, v in example.items())


def _text(text: str) -> str:
    return textwrap.dedent(text).strip()


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _row(knob: Knob, fields: set[str], where: bool) -> str:
    if knob.meanwhile and not knob.targets() <= fields:
        lowprec, note = "not offered in this version", knob.meanwhile
    elif knob.offered():
        parts = ([f"`{spell(knob.example)}`"] if knob.example else []) + ([knob.lowprec] if knob.lowprec else [])
        lowprec, note = "; ".join(parts), knob.note
    else:
        reason = TE_REMOVED_OPTIONS[knob.removed] if knob.removed else knob.not_offered
        nearest = f" Nearest: `{spell(knob.example)}`" if knob.example else ""
        lowprec, note = "not offered", f"{reason.rstrip('.')}.{nearest} {knob.note}"
    cells = ([", ".join(knob.where)] if where else []) + [f"`{knob.source}`", lowprec, note]
    return "| " + " | ".join(_cell(c) for c in cells) + " |"


def _table(section: Section, fields: set[str]) -> list[str]:
    where = bool(section.where_header)
    head = ([section.where_header] if where else []) + [section.source_header, "lowprec", "notes"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return lines + [_row(k, fields, where) for k in section.knobs]


def _named_recipes() -> list[str]:
    lines = ["| name | from | `FP8RecipeKwargs(name=...)` sets |", "|---|---|---|"]
    for name in named_recipes.names():
        recipe = named_recipes.lookup(name)
        if recipe.source != "lowprec":
            lines.append(f"| `{name}` | {recipe.source} | `{named_recipes.describe(recipe)}` |")
    lines += ["", "Names lowprec knows from Megatron-Bridge and NeMo 2 and does not offer:", "",
              "| name | why, and what to use |", "|---|---|"]
    lines += [f"| `{name}` | {_cell(why)} |" for name, why in named_recipes.not_offered_names().items()]
    return lines


def render_markdown() -> str:
    """docs/migration.md as the data and this version's FP8RecipeKwargs say now."""
    fields = field_names()
    out = ["# Migrating to lowprec", "",
           f"<!-- Generated by `{COMMAND}` from lowprec/frontend/migration_knobs.py and migration_megatron.py; "
           "tests/test_migration.py fails when this page and the code disagree. Do not edit by hand. -->", "",
           _text(INTRO), ""]
    for section in SECTIONS:
        out += [f"## {section.title}", "", _text(section.intro), "", *_table(section, fields), ""]
        if section.after:
            out += [_text(section.after), ""]
        if section.named_recipes:
            out += [*_named_recipes(), ""]
    out += ["## Only in lowprec", "", "Fields none of the tools above has:", "", "| field | what it does |",
            "|---|---|", *(f"| `{name}` | {_cell(why)} |" for name, why in LOWPREC_ONLY.items())]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=COMMAND, description="Rewrite docs/migration.md from its data.")
    p.add_argument("--check", action="store_true", help="exit 1 if the page differs, write nothing")
    p.add_argument("--out", type=Path, default=PAGE, help="the page (default: docs/migration.md of this checkout)")
    args = p.parse_args(argv)
    text = render_markdown()
    current = args.out.read_text() if args.out.exists() else ""
    if args.check:
        if current != text:
            print(f"{args.out} is stale: run `{COMMAND}`", file=sys.stderr)
        return 0 if current == text else 1
    args.out.write_text(text)
    print(f"{'unchanged' if current == text else 'wrote'} {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
