"""lowprec's inductor joint-graph passes: one instance each, set around a compiled model's forward in a slot of
inductor's config where the user has set no pass of their own (which is left alone, lowprec's then not run)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

_PASSES: dict[str, object] = {}


def joint_graph_pass(name: str, run: Callable[[torch.fx.Graph], object], source_file: str):
    """The one `CustomGraphPass` named `name` that calls `run(graph)`. Its uuid hashes `source_file`: inductor keys
    its caches on it, and compares configs by value (one instance, not one a forward)."""
    if name not in _PASSES:
        from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

        class JointGraphPass(CustomGraphPass):
            def __call__(self, graph: torch.fx.Graph) -> None:
                run(graph)

            def uuid(self) -> bytes:
                return get_hash_for_files((source_file,))

        JointGraphPass.__name__ = JointGraphPass.__qualname__ = name
        _PASSES[name] = JointGraphPass()
    return _PASSES[name]


@contextlib.contextmanager
def joint_pass_set(slot: str, graph_pass) -> Iterator[bool]:
    """Inside, inductor's `slot` ("joint_custom_pre_pass" or "joint_custom_post_pass") is `graph_pass` where it was
    unset; yields whether it is lowprec's."""
    import torch._inductor.config as inductor_config

    # a torch without the slot runs no pass of lowprec's rather than failing every forward
    if not hasattr(inductor_config, slot) or getattr(inductor_config, slot) is not None:
        yield False
        return
    with inductor_config.patch(**{slot: graph_pass}):
        yield True
