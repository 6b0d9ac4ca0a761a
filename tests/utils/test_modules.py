"""`own_class`: a module's class seen through FSDP2's class swap."""

from __future__ import annotations

from torch import nn

from lowprec.utils.modules import own_class


def test_own_class_sees_through_fully_shard():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    class Named(nn.Linear):
        pass

    class FSDPLike(nn.Linear):  # a user's class named like FSDP2's is its own
        pass

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        layer = Named(4, 4)
        assert own_class(layer) is Named and own_class(FSDPLike(4, 4)) is FSDPLike
        fully_shard(layer, mesh=init_device_mesh("cpu", (1,)))
        assert isinstance(layer, FSDPModule) and type(layer) is not Named and own_class(layer) is Named
    finally:
        dist.destroy_process_group()
