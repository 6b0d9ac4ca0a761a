"""lowprec's own on/off environment switches (`LOWPREC_*=0|1`), read one way everywhere."""

from __future__ import annotations

import os


def switch(name: str, meaning: str) -> bool | None:
    """The switch `name`: True for '1', False for '0', None where unset or blank; anything else is refused with a
    message naming the variable, the values it takes and `meaning` (what each does)."""
    value = os.environ.get(name, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{name}={value!r} is not one of '0', '1' ({meaning})")
    return None if value == "" else value == "1"
