"""Shared fixtures: a clean ACCELERATE_* environment and a fresh Accelerate state per test."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

# torchao's optional CUDA extensions cannot load into a CPU build of torch; it says so on import.
if not torch.cuda.is_available():
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
warnings.filterwarnings("ignore", message=".*is an Enum subclass and is now natively supported.*")


@pytest.fixture(autouse=True)
def clean_accelerate_env(monkeypatch):
    """No ACCELERATE_* variable leaks into a test from the shell or from another test."""
    for name in list(os.environ):
        if name.startswith("ACCELERATE_"):
            monkeypatch.delenv(name, raising=False)
    yield


@pytest.fixture
def fresh_accelerate_state():
    """Accelerate keeps process-wide singletons; reset them around tests that build an Accelerator."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def free_port() -> int:
    """A TCP port nothing listens on now, for torchrun's rendezvous (fixed ports collide)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
