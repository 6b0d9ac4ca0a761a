"""Rewrite docs/support-matrix.md from the support-matrix cells that tests/test_support_matrix.py checks.

    python scripts/support_matrix.py [--check]

Each cell is decided as `prepare()` decides it (tests/support_matrix_cells.py); --check exits 1 when
the page is stale instead of writing it.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")

from support_matrix_cells import PAGE, all_cells, render  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="exit 1 if the page differs, write nothing")
    args = p.parse_args()
    text = render(all_cells())
    current = open(PAGE).read() if os.path.exists(PAGE) else ""
    if args.check:
        sys.exit(0 if current == text else 1)
    with open(PAGE, "w") as fh:
        fh.write(text)
    print(f"{'unchanged' if current == text else 'wrote'} {os.path.relpath(PAGE)}")


if __name__ == "__main__":
    main()
