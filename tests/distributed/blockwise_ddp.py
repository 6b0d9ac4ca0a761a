"""Two CPU processes (gloo): DDP's stored FP8 weight gradients averaged block by block during the backward
(`LOWPREC_FP8_GRAD_OVERLAP=1`, `lowprec.optim.grad_overlap.BlockwiseReduction`) against once after it.

Run by tests/optim/test_grad_overlap.py:

    python -m torch.distributed.run --nproc_per_node 2 tests/distributed/blockwise_ddp.py run OUT.json
    python -m torch.distributed.run --nproc_per_node 2 tests/distributed/blockwise_ddp.py cuda OUT.json  # 2 GPUs
    DS_ACCELERATOR=cpu ACCELERATE_USE_DEEPSPEED=true \
        python -m torch.distributed.run --nproc_per_node 2 tests/distributed/blockwise_ddp.py zero OUT.json

(`zero`: msamp O3 under DeepSpeed ZeRO-2, whose FP8 layers' gradients lowprec averages beside DeepSpeed;
`zero-cuda` the same on two GPUs.)

(`cuda`: NCCL and real FP8 on two GPUs, the side stream in use: tests/gpu/test_grad_overlap_gpu.py.)

Each scenario trains a small model with a block list through lowprec.Accelerator (msamp O2, or torchao
with FP8 gradient stores) twice, with the overlap off and on, each rank on its own half of every global
batch, and records after every backward the FP8 gradients' digest and how many blocks' buckets started
before the backward ended; after every step the parameters' digest. Nothing is asserted here: rank 0
writes both ranks' records to OUT.json.
"""

from __future__ import annotations

import datetime
import os
import sys
import traceback

import torch
import torch.distributed as dist
from msamp_ddp import digest  # beside this script: torchrun puts its folder on sys.path
from teardown import end_ranks, write_ranks
from torch import nn
from torch.utils.checkpoint import checkpoint

TIMEOUT = datetime.timedelta(seconds=60)
WIDTH, BLOCKS, GLOBAL_BATCH, LR = 32, 3, 64, 1e-2


class Block(nn.Module):
    def __init__(self, recompute: bool):
        super().__init__()
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)
        self.recompute = recompute

    def _inner(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))

    def forward(self, x):
        if self.recompute:
            return x + checkpoint(self._inner, x, use_reentrant=False)
        return x + self._inner(x)


class Net(nn.Module):
    """`embed` makes block 0's input need a gradient; without it (`embed=False`) block 0 is fed the data."""

    def __init__(self, embed: bool = True, recompute: bool = False):
        super().__init__()
        self.embed = nn.Linear(WIDTH, WIDTH) if embed else nn.Identity()
        self.blocks = nn.ModuleList(Block(recompute) for _ in range(BLOCKS))
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def stored_grads(backend) -> str:
    zero = getattr(backend, "zero", None)
    # under ZeRO each layer's mean is its owner's alone (the single pass sends the others nothing): the owned ones
    stores = [s for i, s in enumerate(zero.layers) if zero.owners[i] == zero.rank] if zero is not None \
        else backend.grad_stores
    return digest(*[t for s in stores for t in (s.fp8_grad_data, s.fp8_grad_scale, s.fp8_grad_valid)])


def deepspeed_plugin(accumulation: int):
    from accelerate.utils import DeepSpeedPlugin

    micro = GLOBAL_BATCH // dist.get_world_size() // accumulation
    # below the run's gradient norms (0.07-0.11): every step clips, so the FP8 weights' clip (the owners' norms
    # summed over the ranks) is part of what the two averaging paths must agree on
    return DeepSpeedPlugin(hf_ds_config={
        "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accumulation,
        "train_batch_size": GLOBAL_BATCH, "gradient_clipping": 0.05, "zero_optimization": {"stage": 2},
        "bf16": {"enabled": "auto"}})


def train(overlap: bool, *, backend: str = "msamp", embed: bool = True, recompute: bool = False,
          accumulation: int = 1, backwards: int = 1, steps: int = 3, cuda: bool = False, zero: bool = False,
          direct: bool = False, preview: bool = False) -> dict:
    """One run; `direct`: `loss.backward()` instead of `accelerator.backward`; `preview`: rank 0 alone runs a
    forward with gradients on between the backward and the step (a sample preview written carelessly)."""
    from accelerate.utils import InitProcessGroupKwargs

    from lowprec import Accelerator, FP8RecipeKwargs

    os.environ["LOWPREC_FP8_GRAD_OVERLAP"] = "1" if overlap else "0"
    # the layers run eager: the hooks sit on the blocks, outside any compiled layer, and compiling costs minutes
    common = dict(skip_first_last=False, skip_slow_shapes=False, compile_fp8_layers=False)
    if backend == "msamp":
        recipe = FP8RecipeKwargs(backend="msamp", opt_level="O3" if zero else "O2", **common)
    else:
        recipe = FP8RecipeKwargs(backend="torchao", recipe="tensorwise", weight_grad_dtype="fp8", pad_inner_dim=True,
                                 **common)
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    extra = dict(deepspeed_plugin=deepspeed_plugin(accumulation)) if zero else dict(cpu=not cuda)
    accelerator = Accelerator(mixed_precision="fp8", gradient_accumulation_steps=accumulation,
                              kwargs_handlers=[recipe, InitProcessGroupKwargs(timeout=TIMEOUT)], **extra)
    # torch.distributed's ranks: on a CPU host Accelerate counts one process under DeepSpeed
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Net(embed=embed, recompute=recompute)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model, optimizer = accelerator.prepare(model, optimizer)
    lowprec_backend = accelerator._lowprec[-1][1]
    blockwise = lowprec_backend.zero.blockwise if zero else lowprec_backend.weight_storage.blockwise
    g = torch.Generator().manual_seed(1)
    x = torch.randn(steps * GLOBAL_BATCH, WIDTH, generator=g).to(accelerator.device)
    y = torch.tanh(x.flip(-1))
    share = GLOBAL_BATCH // world
    micro = share // accumulation
    part = micro // backwards
    record = {"blockwise": blockwise is not None, "grad_comm": accelerator.precision_plan.tensor("grad_comm").scaling,
              "side_stream": blockwise is not None and blockwise.stream is not None,
              "buckets": None if blockwise is None else [len(blockwise.reducers[i].layers) for i in blockwise.order],
              "rest": None if blockwise is None or blockwise.rest is None else len(blockwise.rest.layers),
              "backwards": [], "params": []}
    for step in range(steps):
        base = step * GLOBAL_BATCH + rank * share
        for k in range(accumulation):
            with accelerator.accumulate(model):
                for j in range(backwards):
                    rows = slice(base + k * micro + j * part, base + k * micro + (j + 1) * part)
                    loss = nn.functional.mse_loss(model(x[rows]).float(), y[rows]) / backwards
                    if direct:
                        loss.backward()
                    else:
                        accelerator.backward(loss)
                    record["backwards"].append({"sync": accelerator.sync_gradients,
                                                "early": None if blockwise is None else blockwise.last_early,
                                                "grads": stored_grads(lowprec_backend)})
                    if blockwise is not None:
                        blockwise.last_early = 0  # a backward without sync leaves it as the last one set it
                if preview and rank == 0:
                    accelerator.unwrap_model(model)(x[:4])
                optimizer.step()
                optimizer.zero_grad()
        record["params"].append(digest(*[p.detach().float() for p in accelerator.unwrap_model(model).parameters()]))
    if blockwise is not None:
        blockwise.remove()
    accelerator.wait_for_everyone()
    return record


SCENARIOS = {
    "plain": dict(),
    "accumulation": dict(accumulation=2, steps=2),
    "two_backwards": dict(backwards=2, steps=2),
    "recompute": dict(recompute=True),
    "data_into_block0": dict(embed=False),
    "stores": dict(backend="torchao"),
    # loss.backward() twice per step: each backward ends its own round (a second one added local gradient
    # that no one averaged, and ranks diverged)
    "direct_two_backwards": dict(backwards=2, steps=2, direct=True),
    # a forward on rank 0 alone between backward and step: nothing is sent for it (rank 0 sent a round that
    # rank 1 never joined, and the job hung)
    "preview_on_rank0": dict(preview=True),
    # torchao's FP8 gradient stores with loss.backward(): nothing marked them pending after a step, so from the
    # second step on they were never averaged (ranks diverged), with or without the overlap
    "stores_direct": dict(backend="torchao", direct=True),
}


ZERO_SCENARIOS = {"plain": dict(), "accumulation": dict(accumulation=2, steps=2), "recompute": dict(recompute=True)}


SLEEP_CYCLES = 50_000_000  # ~30 ms of a GPU's clock


def slow_down_the_streams() -> None:
    """On the GPUs, make the two races the streams must be ordered against real: every FP8 gradient is written
    ~30 ms late on the stream that writes it, and every bucket on the side stream starts ~30 ms late. A small
    model's kernels finish before Python launches the next, so without this a missing wait (the side stream
    for the gradients, the main stream for the averaged bytes) would go unseen."""
    import lowprec.backends.msamp.linear as msamp_linear
    import lowprec.optim.grad_store as grad_store
    from lowprec.optim.grad_reduce import FP8GradReducer

    accumulate = grad_store.accumulate_into

    def late_accumulate(*args, **kwargs):
        torch.cuda._sleep(SLEEP_CYCLES)
        return accumulate(*args, **kwargs)

    reduce = FP8GradReducer.reduce

    def late_reduce(self):
        if torch.cuda.current_stream() != torch.cuda.default_stream():  # a bucket on the side stream
            torch.cuda._sleep(SLEEP_CYCLES)
        return reduce(self)

    grad_store.accumulate_into = msamp_linear.accumulate_into = late_accumulate
    FP8GradReducer.reduce = late_reduce


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    cuda, zero = mode in ("cuda", "zero-cuda"), mode.startswith("zero")
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        slow_down_the_streams()
    dist.init_process_group("nccl" if cuda else "gloo", timeout=TIMEOUT)
    results = {}
    for name, kwargs in (ZERO_SCENARIOS if zero else SCENARIOS).items():
        kwargs = dict(kwargs, cuda=cuda, zero=zero)
        try:
            results[name] = {"off": train(False, **kwargs), "on": train(True, **kwargs)}
        except Exception:  # noqa: BLE001
            results[name] = {"error": traceback.format_exc()[-3000:]}
    write_ranks({"world_size": dist.get_world_size(), "scenarios": results}, out)
    end_ranks()


if __name__ == "__main__":
    main()
