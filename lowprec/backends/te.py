"""TransformerEngine adapter (not in this version: see `TEBackend.not_implemented_message`)."""

from __future__ import annotations

from typing import ClassVar

from .base import Backend, RecipeInfo


class TEBackend(Backend):
    name = "te"
    display_name = "NVIDIA TransformerEngine"
    package = "transformer_engine"
    implemented: ClassVar[bool] = False
    default_recipe = "delayed"
    recipes = {
        "delayed": RecipeInfo("delayed", "per-tensor scales from an amax history", ("HYBRID", "E4M3"), delayed=True),
        "current": RecipeInfo("current", "per-tensor scales from the current tensor", ("HYBRID", "E4M3")),
        "block": RecipeInfo("block", "1x128 / 128x128 block scales", ("E4M3",), min_capability=(9, 0)),
        "mxfp8": RecipeInfo("mxfp8", "MXFP8 1x32 blocks, E8M0 scales", ("E4M3",), min_capability=(10, 0)),
    }
