"""Two-process CPU (gloo) run of te/torchao-style FP8 weight-gradient stores under DDP.

Run by tests/optim/test_grad_store_ddp.py:

    python -m torch.distributed.run --nproc_per_node 2 tests/distributed/stores_ddp.py OUT.json

`lowprec.Accelerator` with FP8RecipeKwargs(backend="torchao", ...) under DDP, each rank on its own
half of every global batch, for each scenario below. Nothing is asserted here: every rank records
raw values (digests of parameters and stored gradients, losses, what DDP ignores) and rank 0 writes
them to OUT.json for the pytest side. A scenario that raises is recorded as an error.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import sys
import traceback

import torch
import torch.distributed as dist
from msamp_ddp import digest  # beside this script: torchrun puts its folder on sys.path
from teardown import end_ranks  # beside this script: torchrun puts its folder on sys.path
from torch import nn

D_IN, D_HIDDEN, D_OUT = 32, 64, 16
GLOBAL_BATCH = 32
STEPS = 12
SCENARIOS = {
    "O1": dict(opt_level="O1"),
    "O2": dict(opt_level="O2"),
    "fp8_grads": dict(weight_grad_dtype="fp8"),
    "O2_accumulate": dict(opt_level="O2", accumulation=2),
    "comm_fp8": dict(grad_comm_dtype="fp8"),
    "comm_bf16": dict(grad_comm_dtype="bf16"),
    "comm_fp32": dict(grad_comm_dtype="fp32"),
    "O1_comm_fp8": dict(opt_level="O1", grad_comm_dtype="fp8"),
}


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(D_IN, D_HIDDEN), nn.GELU(), nn.Linear(D_HIDDEN, D_HIDDEN), nn.GELU(),
                         nn.Linear(D_HIDDEN, D_OUT))


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(STEPS * GLOBAL_BATCH, D_IN, generator=g)
    return x, torch.tanh(x @ (torch.randn(D_IN, D_OUT, generator=g) / 4))


def train(accumulation: int = 1, **knobs) -> dict:
    from accelerate.utils import InitProcessGroupKwargs

    from lowprec import Accelerator, FP8RecipeKwargs

    recipe = FP8RecipeKwargs(backend="torchao", skip_first_last=False, skip_slow_shapes=False, **knobs)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulation,
                              kwargs_handlers=[recipe, InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=60))])
    rank, world = accelerator.process_index, accelerator.num_processes
    torch.manual_seed(rank)  # different initial weights: the broadcast must make them equal
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    inner = accelerator.unwrap_model(model)
    backend = accelerator._lowprec[-1][1]
    stores = backend.grad_stores
    record = {
        "rank": rank, "world_size": world, "engine": accelerator.precision_plan.engine,
        "wrapped": type(model).__name__, "stores": [str(s.dtype) for s in stores],
        "reducer": None if backend.store_reducer is None else backend.store_reducer.method,
        "ddp_ignores": sorted(getattr(inner, "_ddp_params_and_buffers_to_ignore", [])),
        "weight_dtypes": sorted({str(s.weight.dtype) for s in stores}),
        "optimizer": type(getattr(optimizer, "optimizer", optimizer)).__name__,
        "init_params": digest(*inner.parameters()),
        "grad_comm": accelerator.precision_plan.tensor("grad_comm").dtype,
        "comm_hook": None if backend.comm_state is None else type(backend.comm_state).__name__,
        "steps": [],
    }
    x, y = make_data()
    share = GLOBAL_BATCH // world
    micro = share // accumulation
    for step in range(STEPS):
        base = step * GLOBAL_BATCH + rank * share
        entry = {"losses": []}
        for k in range(accumulation):
            rows = slice(base + k * micro, base + (k + 1) * micro)
            with accelerator.accumulate(model):
                loss = nn.functional.mse_loss(model(x[rows]).float(), y[rows])
                accelerator.backward(loss)
                entry["losses"].append(loss.item())
                if accelerator.sync_gradients:
                    entry["clip_norm"] = float(accelerator.clip_grad_norm_(model.parameters(), 1.0))
                    entry["stored_grads"] = digest(*[t for s in stores for t in (s.fp8_grad_data, s.fp8_grad_scale)])
                    entry["dense_grads"] = digest(*[p.grad for p in inner.parameters() if p.grad is not None])
                optimizer.step()
                optimizer.zero_grad()
        entry["params"] = digest(*inner.parameters())
        record["steps"].append(entry)
    blocks = None if backend.comm_state is None else backend.comm_state.nonfinite_blocks
    record["nonfinite_blocks"] = None if blocks is None else int(blocks)
    return record


class _Bucket:
    def __init__(self, buffer: torch.Tensor):
        self._buffer = buffer

    def buffer(self) -> torch.Tensor:
        return self._buffer


@contextlib.contextmanager
def _host_reads():
    """Count the calls of host-reading tensor methods (`.item()`, `bool()`, ...) inside the block."""
    reads: list[str] = []
    names = ("item", "tolist", "cpu", "__bool__", "__float__", "__int__")
    originals = {name: getattr(torch.Tensor, name) for name in names}

    def spy(name):
        def method(self, *args, **kwargs):
            reads.append(name)
            return originals[name](self, *args, **kwargs)
        return method

    for name in names:
        setattr(torch.Tensor, name, spy(name))
    try:
        yield reads
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def hook_numerics() -> dict:
    """fp8_allreduce_hook on hand-made buckets against the exact FP32 mean of the ranks' values."""
    from lowprec.optim.comm_hooks import FP8CommState, fp8_allreduce_hook

    rank = dist.get_rank()
    g = torch.Generator().manual_seed(0)
    shared = torch.randn(10_001, generator=g) * torch.logspace(-3, 0, 10_001)  # four decades of magnitude
    mine = shared + 0.1 * torch.randn(10_001, generator=torch.Generator().manual_seed(1 + rank))
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        state = FP8CommState()
        local = mine.to(dtype)
        exact = local.float().clone()
        dist.all_reduce(exact)
        exact /= dist.get_world_size()
        result = fp8_allreduce_hook(state, _Bucket(local.clone())).wait()
        err = (result.float() - exact).norm() / exact.norm()
        out[str(dtype)] = {"dtype": str(result.dtype), "rel_l2": float(err), "digest": digest(result),
                           "nonfinite_blocks": int(state.nonfinite_blocks)}
    # A tensor 10**6 below its neighbours in the same bucket, filling whole blocks of each rank's shard:
    # its own block scales keep it (one scale per bucket would flush it to zero, E4M3 spanning 2**17)
    n = dist.get_world_size()
    chunk = -(-mine.numel() // n)
    tiny = ((torch.arange(mine.numel()) % chunk) // 1024) % 3 == 2
    mixed = torch.where(tiny, mine * 1e-6, mine)
    exact = mixed.clone()
    dist.all_reduce(exact)
    exact /= n
    result = fp8_allreduce_hook(FP8CommState(), _Bucket(mixed.clone())).wait()
    out["tiny_rel_l2"] = float((result - exact)[tiny].norm() / exact[tiny].norm())
    state = FP8CommState()
    bad = mine.clone()
    if rank == 1:
        bad[7] = float("inf")
    with _host_reads() as reads:  # on a GPU each would wait for the backward queued before the hook
        future = fp8_allreduce_hook(state, _Bucket(bad))
    result = future.wait()
    block = FP8CommState().block  # element 7 is in rank 0's first block, whatever the world size
    out["inf"] = {"value_7": float(result[7]), "finite_elsewhere": bool(torch.isfinite(result[8:]).all()),
                  "first_block_finite_but_7": bool(torch.isfinite(result[:block][torch.arange(block) != 7]).all()),
                  "nonfinite_blocks": int(state.nonfinite_blocks), "host_reads": reads}
    return out


def main(argv: list[str]) -> None:
    from accelerate.state import AcceleratorState, GradientState

    out_path = argv[1]
    torch.set_num_threads(1)
    results = {}
    for name, kwargs in SCENARIOS.items():
        AcceleratorState._reset_state()
        GradientState._reset_state()
        try:
            record = train(**kwargs)
            ranks = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, record)
            results[name] = {"ranks": ranks}
        except Exception:  # noqa: BLE001
            results[name] = {"error": traceback.format_exc()[-3000:]}
    try:
        numerics = [None] * dist.get_world_size()
        dist.all_gather_object(numerics, hook_numerics())
    except Exception:  # noqa: BLE001
        numerics = {"error": traceback.format_exc()[-3000:]}
    if dist.get_rank() == 0:
        with open(out_path, "w") as fh:
            json.dump({"world_size": dist.get_world_size(), "scenarios": results, "hook": numerics}, fh)
    end_ranks()


if __name__ == "__main__":
    main(sys.argv)
