"""Train a Llama (`transformers`, built from a config) in FP8 through lowprec, on one process or many.

One script for every engine; the backend and level come from the command line or from the
`fp8_config:` section of an `accelerate launch` config file (command-line flags win):

    python examples/train_llama.py --backend torchao --opt-level O2
    accelerate launch --config_file examples/configs/single_gpu.yaml examples/train_llama.py
    accelerate launch --config_file examples/configs/ddp.yaml examples/train_llama.py
    accelerate launch --config_file examples/configs/fsdp2.yaml examples/train_llama.py
    accelerate launch --config_file examples/configs/deepspeed_zero2.yaml examples/train_llama.py

On a CPU-only host (FP8 emulated), two processes through torchrun, which Accelerate then sees:

    ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 examples/train_llama.py --size tiny --steps 20

Data: the Python standard library's source, bytes as tokens, with a held-out split (no download).
The script prints the precision plan, the loss every few steps and the held-out loss at the end, and
with --out writes the trained weights loadable by a plain `transformers` model (`save_model`).
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from torch.utils.data import DataLoader

from lowprec import Accelerator, FP8RecipeKwargs
from lowprec.demo.data import Windows, stdlib_corpus
from lowprec.demo.model import PRESETS, build_model


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default=None, help="te, torchao, msamp or auto (default: fp8_config, else auto)")
    p.add_argument("--recipe", default=None)
    p.add_argument("--opt-level", default=None, help="O1 or O2 (default: fp8_config, else none)")
    p.add_argument("--size", default=None, choices=sorted(PRESETS),
                   help="model size (default: proxy on a GPU, tiny on CPU)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--compile", action="store_true", help="torch.compile the model (what torchao needs for speed)")
    p.add_argument("--out", default=None, help="directory for the trained weights (save_model)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    # Fields left None are read from ACCELERATE_FP8_* (the config file's fp8_config section).
    recipe = FP8RecipeKwargs(backend=args.backend, recipe=args.recipe, opt_level=args.opt_level)
    kwargs = {}
    if args.compile:
        from accelerate.utils import TorchDynamoPlugin

        kwargs["dynamo_plugin"] = TorchDynamoPlugin(backend="inductor")
    accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[recipe], **kwargs)
    preset = PRESETS[args.size or ("proxy" if accelerator.device.type == "cuda" else "tiny")]

    torch.manual_seed(0)
    model = build_model(preset)
    corpus = stdlib_corpus(max_bytes=8 * 2**20)
    world = accelerator.num_processes
    train = Windows(corpus.train, preset.seq_len, args.steps * preset.batch * world, seed=0)
    heldout = Windows(corpus.heldout, preset.seq_len, 8 * preset.batch * world, seed=1)
    train_loader = DataLoader(train, batch_size=preset.batch)
    eval_loader = DataLoader(heldout, batch_size=preset.batch)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr or preset.lr, weight_decay=0.1)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)
    if accelerator.is_main_process:
        print(accelerator.precision_plan)

    model.train()
    start = time.perf_counter()
    for step, ids in enumerate(train_loader, 1):
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)  # counts FP8 weight gradients too
        optimizer.step()
        optimizer.zero_grad()
        if step % 10 == 0 or step == 1:
            mean = accelerator.reduce(loss.detach(), reduction="mean").item()
            accelerator.print(f"step {step:4d}  loss {mean:.4f}  {time.perf_counter() - start:.1f}s")

    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for ids in eval_loader:
            loss = model(input_ids=ids, labels=ids).loss
            total += accelerator.reduce(loss.detach(), reduction="mean").item()
            count += 1
    heldout_loss = total / max(count, 1)
    accelerator.print(f"held-out loss {heldout_loss:.4f} (perplexity {math.exp(heldout_loss):.2f})")
    if args.out:
        accelerator.save_model(model, args.out)  # loads into the plain, unconverted model
        accelerator.print(f"weights written to {args.out}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
