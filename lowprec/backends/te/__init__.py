"""NVIDIA TransformerEngine backend: the adapter (`adapter.py`) and the TE modules it swaps in (`modules.py`)."""

from .adapter import TEBackend

__all__ = ["TEBackend"]
