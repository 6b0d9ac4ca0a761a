"""Optimizers with low-precision states, and the MS-AMP memory levels built on them."""

from .levels import LEVEL_STATE_DTYPES, low_bit_optimizer
from .low_bit_adam import LowBitAdam, LowBitAdamW

__all__ = ["LEVEL_STATE_DTYPES", "LowBitAdam", "LowBitAdamW", "low_bit_optimizer"]
