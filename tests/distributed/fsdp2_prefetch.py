"""Run under `torchrun --nproc_per_node 2` (gloo, CPU) by tests/runtime/test_fsdp_prefetch.py.

`lowprec.runtime.fsdp_prefetch.ForwardPrefetch` on a model of three blocks whose forward runs them in the reverse of
their registration order, FP32 and msamp O3 (its FP8 layers sharded in one FSDP2 group per block, as under
Accelerate): the chain follows the first training forward's order; from the second forward on each group's forward
issues the next group's all-gather (FSDP2's `FSDP::forward_prefetch` record in a profile); the losses and weights of
four steps are those of the run without it, bit for bit.
"""

import sys

import torch
import torch.distributed as dist
from teardown import end_ranks, write_ranks  # beside this script: torchrun puts its folder on sys.path
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from lowprec import FP8RecipeKwargs, RunContext, build_plan
from lowprec.backends import create_backend
from lowprec.backends.msamp.fsdp_groups import fully_shard_fp8_layers
from lowprec.planning.hardware import device_info
from lowprec.runtime.fsdp_prefetch import ForwardPrefetch


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.norm, self.down = nn.Linear(32, 64), nn.LayerNorm(64), nn.Linear(64, 32)

    def forward(self, x):
        return x + self.down(torch.relu(self.norm(self.up(x))))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(32, 16)

    def forward(self, x):
        for block in reversed(self.blocks):  # not the registration order: the chain must follow the forward's
            x = block(x)
        return self.head(x)


def build(level: str, mesh):
    torch.manual_seed(0)
    model = Model()
    policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    if level == "O3":
        recipe = FP8RecipeKwargs(backend="msamp", opt_level="O3", skip_slow_shapes=False, skip_first_last=False)
        context = RunContext(device=device_info("cpu"), engine="fsdp2", world_size=dist.get_world_size())
        backend = create_backend(recipe, context)
        plan = build_plan(model, recipe, context=context, backend=backend)
        model = backend.convert(model, plan)
        fully_shard_fp8_layers(model, ("Block",), mesh=mesh, mp_policy=policy)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    if level == "O3":
        optimizer = backend.wrap_optimizer(optimizer, plan)
        return model, optimizer, backend.post_optimizer_step(model)
    return model, optimizer, (lambda: None)


def run(level: str, mesh, prefetch: int) -> dict:
    rank = dist.get_rank()
    model, optimizer, hook = build(level, mesh)
    chain = ForwardPrefetch(model, depth=prefetch) if prefetch else None
    record = {"losses": [], "prefetches": []}
    with torch.no_grad():  # an evaluation forward before training records nothing
        model.eval()
        model(torch.randn(4, 32))
        model.train()
    record["order_after_eval"] = list(chain.order) if chain else None
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(16, 32, generator=g)[8 * rank:8 * (rank + 1)]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            loss = nn.functional.mse_loss(model(x), torch.tanh(x[:, :16]))
        names = (e.name for e in prof.events())
        record["prefetches"].append(sorted(n for n in names if n.startswith("FSDP::forward_prefetch")))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        hook()
        record["losses"].append(float(loss))
        if step == 0 and chain:
            record["order"] = chain.order
            record["hooks_left"] = len(chain._handles)
    record["weights"] = [float(p.full_tensor().float().double().sum()) if hasattr(p, "full_tensor") else
                         float(p.float().double().sum()) for p in model.parameters()]
    return record


def main():
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    result = {f"{level}_{depth}": run(level, mesh, depth) for level in ("fp32", "O3") for depth in (0, 1, 2)}
    write_ranks(result, sys.argv[1])
    end_ranks()


if __name__ == "__main__":
    main()
