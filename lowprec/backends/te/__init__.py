"""NVIDIA TransformerEngine backend: the adapter (`adapter.py`), the TE modules it swaps in (`modules.py`), its
storage part for `fp8_weights` (`storage.py`) and its communication part for `fp8_weights` under FSDP2
(`fsdp.py`)."""

from .adapter import TEBackend

__all__ = ["TEBackend"]
