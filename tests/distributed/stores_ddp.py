"""Two-process CPU (gloo) run of te/torchao-style FP8 weight-gradient stores under DDP.

Run by tests/optim/test_grad_store_ddp.py:

    python -m torch.distributed.run --nproc_per_node 2 tests/distributed/stores_ddp.py OUT.json

`lowprec.Accelerator` with FP8RecipeKwargs(backend="torchao", ...) under DDP, each rank on its own
half of every global batch, for each scenario below. Nothing is asserted here: every rank records
raw values (digests of parameters and stored gradients, losses, what DDP ignores) and rank 0 writes
them to OUT.json for the pytest side. A scenario that raises is recorded as an error.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import sys
import traceback

import torch
import torch.distributed as dist
from torch import nn

D_IN, D_HIDDEN, D_OUT = 32, 64, 16
GLOBAL_BATCH = 32
STEPS = 12
SCENARIOS = {
    "O1": dict(opt_level="O1"),
    "O2": dict(opt_level="O2"),
    "fp8_grads": dict(weight_grad_dtype="fp8"),
    "O2_accumulate": dict(opt_level="O2", accumulation=2),
}


def digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().cpu().contiguous()
        h.update(str((t.dtype, tuple(t.shape))).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:24]


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
    return record


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
    if dist.get_rank() == 0:
        with open(out_path, "w") as fh:
            json.dump({"world_size": dist.get_world_size(), "scenarios": results}, fh)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv)
