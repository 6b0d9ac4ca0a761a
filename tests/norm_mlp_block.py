"""A residual norm-MLP block, the small transformer-like layer several CPU tests train (a norm, two Linears around a
GELU): one definition, so that the tests that share it build the same parameters in the same order."""

from __future__ import annotations

from torch import nn


class NormMLPBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))
