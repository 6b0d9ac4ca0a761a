"""Facts about modules that survive the engines' wrapping."""

from __future__ import annotations

from torch import nn


def own_class(module: nn.Module) -> type:
    """`module`'s class as its library defined it. FSDP2's `fully_shard` swaps in a subclass of its own
    (`FSDP<Name>`, defined in torch's FSDP module, with `FSDPModule` and the class as bases), so a check by class
    name or defining module would no longer recognise a sharded FP8 Linear."""
    cls = type(module)
    if cls.__name__.startswith("FSDP") and len(cls.__bases__) == 2:
        fsdp, own = cls.__bases__
        if fsdp.__name__ == "FSDPModule":
            return own
    return cls


def group_members(module: nn.Module) -> list[nn.Module]:
    """`module` and the submodules whose parameters its FSDP2 group manages: all but those under a nested
    `fully_shard`-ed module (which is a group of its own, or a member of one)."""
    from torch.distributed.fsdp import FSDPModule

    members, stack = [], [module]
    while stack:
        m = stack.pop()
        members.append(m)
        stack.extend(c for c in m.children() if not isinstance(c, FSDPModule))
    return members
