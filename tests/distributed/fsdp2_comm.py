"""Run under `torchrun --nproc_per_node 2` (gloo, CPU) by tests/optim/test_fsdp_comm.py.

1. `FP8ReduceScatter` on hand-made buffers against the exact FP32 reduce-scatter of the same values
   (SUM and AVG, FP32 and BF16 buffers, a shard length that is no multiple of the block), against a
   one-scale-per-shard cast, and with an inf on one rank.
2. FSDP2 (`fully_shard`, BF16 reduce dtype as Accelerate sets it) training a torchao-converted MLP
   with grad_comm_dtype None, "bf16", "fp32" and "fp8": what the plugin or the comm does, and the loss.
   Accelerate builds FSDP only on GPUs, so this drives `fully_shard` and the backend's hooks directly.
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
from lowprec.optim.comm_hooks import FP8ReduceScatter
from lowprec.planning.hardware import device_info


def exact_reduce_scatter(local: torch.Tensor, average: bool) -> torch.Tensor:
    n, rank = dist.get_world_size(), dist.get_rank()
    gathered = [torch.empty_like(local, dtype=torch.float32) for _ in range(n)]
    dist.all_gather(gathered, local.float())
    total = torch.stack(gathered).sum(0)
    if average:
        total /= n
    return total.view(n, -1)[rank]


def comm_numerics() -> dict:
    n, rank = dist.get_world_size(), dist.get_rank()
    chunk = 3001  # not a multiple of the 1024-element block
    g = torch.Generator().manual_seed(0)
    # Gradients of different layers sit side by side in one buffer: three decades of magnitude along
    # it, and in every shard every third 1024-element block a tensor 10**6 below its neighbours (E4M3
    # spans 2**17 from its largest value to its smallest subnormal, so one scale per shard flushes
    # those to zero). Blocks start at each shard's start: a tensor gets its own scales where it fills
    # whole blocks, as the large weights of real layers do.
    index = torch.arange(n * chunk)
    tiny = ((index % chunk) // 1024) % 3 == 2
    shared = torch.randn(n * chunk, generator=g) * torch.where(tiny, 1e-6, torch.logspace(-3, 0, n * chunk))
    mine = shared * (1 + 0.1 * torch.randn(n * chunk, generator=torch.Generator().manual_seed(1 + rank)))
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            average = op == dist.ReduceOp.AVG
            local = mine.to(dtype)
            exact = exact_reduce_scatter(local, average)
            errors = {}
            for name, block in (("block", 1024), ("per_shard", chunk)):
                comm = FP8ReduceScatter(block=block)
                result = comm.allocate((chunk,), dtype=dtype, device=local.device)
                comm(result, local.clone(), group=None, op=op)
                errors[name] = float((result.float() - exact).norm() / exact.norm())
                small = tiny.view(n, chunk)[rank]
                errors[name + "_tiny"] = float((result.float() - exact)[small].norm() / exact[small].norm())
            out[f"{dtype}-{'avg' if average else 'sum'}"] = {"dtype": str(result.dtype), **errors,
                                                              "nonfinite": int(comm.nonfinite_blocks)}
    bad = mine.clone()
    if rank == 1:
        bad[5] = float("inf")  # in rank 0's shard, block 0
    comm = FP8ReduceScatter()
    result = torch.empty(chunk)
    comm(result, bad, group=None, op=dist.ReduceOp.AVG)
    out["inf"] = {"nan_at_5": bool(torch.isnan(result[5])) if rank == 0 else None,
                  "finite_outside_block_0": bool(torch.isfinite(result[1024:]).all()),
                  "finite_everywhere": bool(torch.isfinite(result).all()),
                  "nonfinite_blocks": int(comm.nonfinite_blocks)}
    return out


def sharded_fp8_model(grad_comm_dtype: str | None = "fp8", optimizer_states: str | None = None):
    """The MLP converted by lowprec's torchao adapter for FSDP2, each Linear and the root `fully_shard`-ed
    with the reduce dtype Accelerate's plugin would carry, lowprec's communication and optimizer in place.
    Returns (model, optimizer, post-step hook, backend, plan)."""
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 16))
    recipe = FP8RecipeKwargs(backend="torchao", skip_slow_shapes=False, skip_first_last=False,
                             grad_comm_dtype=grad_comm_dtype, optimizer_states=optimizer_states)
    context = RunContext(device=device_info("cpu"), engine="fsdp2", world_size=world)
    backend = create_backend(recipe, context)
    plan = build_plan(model, recipe, context=context, backend=backend)
    model = backend.convert(model, plan)
    reduce_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(grad_comm_dtype, torch.bfloat16)
    policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)  # what apply_grad_comm_dtype makes of the plugin's
    for module in model:
        if isinstance(module, nn.Linear):
            fully_shard(module, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    backend.setup_grad_comm(model)
    optimizer = backend.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=3e-3), plan)
    return model, optimizer, backend.post_optimizer_step(model), backend, plan


def train(grad_comm_dtype: str | None, optimizer_states: str | None = None) -> dict:
    model, optimizer, hook, backend, plan = sharded_fp8_model(grad_comm_dtype, optimizer_states)
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(64, 32, generator=g), torch.tanh(torch.randn(64, 16, generator=g))
    losses = []
    for _ in range(10):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        hook()
        losses.append(loss.item())
    comm = backend.comm_state
    params = [p.full_tensor().float().sum().item() for p in model.parameters()]  # collectives: every rank
    return {"losses": losses, "grad_comm": plan.tensor("grad_comm").dtype,
            "comm": type(comm).__name__ if comm is not None else None,
            "comm_calls": getattr(comm, "calls", None),
            "nonfinite_blocks": int(comm.nonfinite_blocks) if getattr(comm, "nonfinite_blocks", None) is not None
            else None,
            "param_sums": params, "optimizer": type(optimizer).__name__,
            "state": sorted({f"{type(v).__name__} {v.dtype}" for s in optimizer.state.values() for k, v in s.items()
                             if k.startswith("exp_avg") and not k.endswith("scale")})}


def _steps(model, optimizer, hook, steps: range) -> list[float]:
    losses = []
    for step in steps:
        g = torch.Generator().manual_seed(100 * step + dist.get_rank())
        x = torch.randn(16, 32, generator=g)
        loss = nn.functional.mse_loss(model(x), torch.tanh(x[:, :16]))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        hook()
        losses.append(loss.item())
    return losses


def checkpoint() -> dict:
    """A sharded FP8 run (torchao weights all-gathered in FP8, FP8 reduce-scatter) through torch's
    distributed state-dict API: the full model state dict loads into the plain model on one process,
    and the sharded state dicts resume training with the same losses."""
    import copy

    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    model, optimizer, hook, _, _ = sharded_fp8_model()
    _steps(model, optimizer, hook, range(5))
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    sharded = StateDictOptions()
    model_state = copy.deepcopy(get_model_state_dict(model, options=sharded))
    optim_state = copy.deepcopy(get_optimizer_state_dict(model, optimizer, options=sharded))
    continued = _steps(model, optimizer, hook, range(5, 8))
    record = {"continued": continued}
    if dist.get_rank() == 0:
        plain = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 16))
        plain.load_state_dict(full, strict=True)
        record["full_types"] = sorted({type(v).__name__ for v in full.values()})
        record["full_keys"] = sorted(full)
    model2, optimizer2, hook2, _, _ = sharded_fp8_model()
    set_model_state_dict(model2, model_state, options=sharded)
    set_optimizer_state_dict(model2, optimizer2, optim_state, options=sharded)
    record["resumed"] = _steps(model2, optimizer2, hook2, range(5, 8))
    return record


def main(out_path: str) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    result = {"numerics": comm_numerics(), "train": {}}
    for choice in (None, "bf16", "fp32", "fp8"):
        result["train"][str(choice)] = train(choice)
    result["train"]["fp8_states"] = train("fp8", optimizer_states="fp8")
    result["checkpoint"] = checkpoint()
    write_ranks(result, out_path)
    end_ranks()


if __name__ == "__main__":
    main(sys.argv[1])
