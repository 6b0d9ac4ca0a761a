"""Run under `torchrun --nproc_per_node 2` (gloo, CPU) by tests/backends/test_torchao.py.

FSDP2 (`fully_shard`) on a model converted by lowprec's torchao adapter for engine "fsdp2": weights
are all-gathered in FP8, and the adapter's post-step hook precomputes every weight's scale with one
all-reduce; after wrapping, the adapter gives each shard its one-kernel cast (trained again without it:
the same losses). Accelerate builds FSDP only on GPUs, so this drives FSDP2 directly.
"""

import json
import sys

import torch
import torch.distributed as dist
from teardown import end_ranks  # beside this script: torchrun puts its folder on sys.path
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from lowprec import FP8RecipeKwargs, RunContext, build_plan
from lowprec.backends import create_backend
from lowprec.backends.torchao_gather import fused_gather_casts
from lowprec.planning.hardware import device_info


def train(mesh, rank: int, world: int, fuse: bool) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 16))
    recipe = FP8RecipeKwargs(backend="torchao", skip_slow_shapes=False, skip_first_last=False)
    context = RunContext(device=device_info("cpu"), engine="fsdp2", world_size=world)
    backend = create_backend(recipe, context)
    plan = build_plan(model, recipe, context=context, backend=backend)
    model = backend.convert(model, plan)
    weight_types = sorted({type(m.weight).__name__ for m in model if isinstance(m, nn.Linear)})
    for module in model:
        if isinstance(module, nn.Linear):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if fuse:  # what lowprec.Accelerator does once the engine wrapped the model
        backend.setup_communication(model, plan)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    hook = backend.post_optimizer_step(model)

    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(64, 32, generator=g), torch.tanh(torch.randn(64, 16, generator=g))
    losses, scale_errors = [], []
    for _ in range(8):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        hook()
        losses.append(loss.item())
        for module in model:
            if isinstance(module, nn.Linear):
                full = module.weight.full_tensor()  # a collective: every rank takes part
                full = getattr(full, "_tensor", full)
                expected = torch.finfo(torch.float8_e4m3fn).max / full.abs().max().double()
                scale = module.weight._local_tensor._precomputed_scale
                scale_errors.append(abs(scale.item() - expected.item()) / expected.item())
    scales = torch.stack([m.weight._local_tensor._precomputed_scale.float() for m in model if isinstance(m, nn.Linear)])
    gathered = [torch.zeros_like(scales) for _ in range(world)]
    dist.all_gather(gathered, scales)
    return {
        "notes": plan.notes,
        "weight_types": weight_types,
        "fused_gather_casts": fused_gather_casts(model),
        "max_scale_rel_error": max(scale_errors),
        "scales_equal_across_ranks": all(torch.equal(gathered[0], t) for t in gathered[1:]),
        "losses": losses,
        "first_loss": losses[0],
        "last_loss": losses[-1],
    }


def main(out_path: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    result = train(mesh, rank, world, fuse=True)
    # torchao's own cast of each shard before the all-gather: the same bytes, so the same training to the bit
    result["torchaos_cast_losses"] = train(mesh, rank, world, fuse=False)["losses"]
    if rank == 0:
        with open(out_path, "w") as fh:
            json.dump(result, fh)
    end_ranks()


if __name__ == "__main__":
    main(sys.argv[1])
