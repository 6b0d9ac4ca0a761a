"""Which of a model's O3 layers FSDP2 shards together: a transformer block's FP8 Linears as one group (one all-gather
of their E4M3 bytes, cast in one call by `fsdp._GroupCast`, and one reduce-scatter per block), and whether a block
holds little enough beside them that its norms can go to the root's group."""

from __future__ import annotations

from torch import nn

from .fsdp import GROUP_CAST_ATTR, FP8MasterWeight, _GroupCast


def fp8_layer_groups(model: nn.Module, block_classes: tuple[str, ...] = ()) -> list[list[nn.Module]]:
    """The O3 layers of `model` (those whose weight is an `FP8MasterWeight`, not sharded yet) in FSDP2
    groups: the layers inside one transformer block form one group, a layer outside every block (or inside
    a list of modules within one: experts that may not run) is a group of its own. A block is a module whose
    class is named in `block_classes` (the classes the FSDP plugin wraps), or else an entry of the model's
    block list (`planning.selection.find_blocks`)."""
    from torch.distributed.fsdp import FSDPModule

    from ...planning.selection import find_blocks

    blocks = [m for m in model.modules() if type(m).__name__ in block_classes]
    if not blocks:
        found = find_blocks(model)
        blocks = list(found[1]) if found is not None else []
    # By the weight, not by FP8Linear: an O3 layer's is an FP8MasterWeight, and linear.py imports this module
    def is_layer(m):
        return isinstance(getattr(m, "weight", None), FP8MasterWeight) and not isinstance(m, FSDPModule)

    in_block = {}
    for block in blocks:
        # A layer inside a list or dict of modules within the block (a mixture of experts' experts) may sit out
        # a forward: FSDP2 reshards a group only once every member has run, so one idle expert would keep its
        # whole block's gathered weights until the model's forward ends. Those layers are groups of their own.
        optional = {id(m) for c in block.modules() if isinstance(c, (nn.ModuleList, nn.ModuleDict))
                    for m in c.modules()}
        for m in block.modules():
            if is_layer(m) and id(m) not in optional:
                in_block.setdefault(id(m), id(block))  # the outermost block, for blocks inside blocks
    groups: dict[int, list[nn.Module]] = {}
    for m in model.modules():
        if is_layer(m):
            groups.setdefault(in_block.get(id(m), id(m)), []).append(m)
    return list(groups.values())


def blocks_rest_is_small(model: nn.Module, block_classes: tuple[str, ...], share: float = 0.01) -> bool:
    """Whether every block (a module of a class in `block_classes`) holds, outside its `fully_shard`-ed FP8 layers,
    at most `share` of its parameters (a transformer block's norms), and there is a block at all."""
    from ...utils.modules import group_members

    blocks = [m for m in model.modules() if type(m).__name__ in block_classes]
    for block in blocks:
        rest = sum(p.numel() for m in group_members(block) for p in m.parameters(recurse=False))
        if rest > share * sum(p.numel() for p in block.parameters()):
            return False
    return bool(blocks)


def fully_shard_fp8_layers(model: nn.Module, block_classes: tuple[str, ...] = (),
                           **fsdp_kwargs) -> list[nn.Module]:
    """`fully_shard` the O3 `FP8Linear`s of `model` with `fsdp_kwargs` (mesh, mp_policy,
    reshard_after_forward, ...), those of one transformer block as one FSDP2 group (`fp8_layer_groups`):
    one all-gather of their E4M3 bytes and one reduce-scatter of their gradients per block, as FSDP2 does
    for a BF16 block, instead of one per layer. Call it before sharding the blocks and the root: FSDP2
    needs one parameter dtype per group, and the layers' FP16 masters would otherwise share a group with
    the model's FP32 norms. Returns the layers sharded."""
    from torch.distributed.fsdp import fully_shard

    groups = fp8_layer_groups(model, block_classes)
    for group in groups:
        fully_shard(group if len(group) > 1 else group[0], **fsdp_kwargs)
        if len(group) > 1:
            cast = _GroupCast(group)
            for layer in group:
                setattr(layer, GROUP_CAST_ATTR, cast)
    return [layer for group in groups for layer in group]
