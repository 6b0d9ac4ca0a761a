"""MS-AMP-style levels O1/O2/O3 implemented natively (not in this version)."""

from __future__ import annotations

from typing import ClassVar

from ..base import Backend, RecipeInfo


class MSAMPBackend(Backend):
    name = "msamp"
    display_name = "MS-AMP levels (native)"
    package = None
    implemented: ClassVar[bool] = False
    default_recipe = "delayed"
    recipes = {
        "delayed": RecipeInfo(
            "delayed", "activations/output grads from an amax history, weights current", ("HYBRID", "E4M3"), delayed=True
        ),
    }
    opt_levels = ("O1", "O2", "O3")
