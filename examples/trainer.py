"""FP8 with Hugging Face `Trainer`: `lowprec.integrations.trainer.FP8Trainer` in place of `Trainer`.

    python examples/trainer.py --backend torchao --steps 50
    accelerate launch --config_file examples/configs/ddp.yaml examples/trainer.py   # recipe from fp8_config

`Trainer` on its own never turns FP8 on (it builds a plain `accelerate.Accelerator` without an FP8
handler); `FP8Trainer` is the explicit opt-in. The same Llama and corpus as train_llama.py; the
precision plan is printed after training, with the held-out loss from `trainer.evaluate()`.
"""

from __future__ import annotations

import argparse

import torch
from transformers import TrainingArguments

from lowprec import FP8RecipeKwargs
from lowprec.demo.data import Windows, stdlib_corpus
from lowprec.demo.model import PRESETS, build_model
from lowprec.integrations.trainer import FP8Trainer


class Samples(torch.utils.data.Dataset):
    """Trainer wants dicts: each window is its own label (causal LM)."""

    def __init__(self, windows: Windows):
        self.windows = windows

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.windows[i]
        return {"input_ids": ids, "labels": ids}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default=None)
    p.add_argument("--recipe", default=None)
    p.add_argument("--opt-level", default=None)
    p.add_argument("--size", default=None, choices=sorted(PRESETS))
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--out", default="runs/trainer")
    args = p.parse_args()

    gpu = torch.cuda.is_available()
    preset = PRESETS[args.size or ("proxy" if gpu else "tiny")]
    torch.manual_seed(0)
    model = build_model(preset)
    corpus = stdlib_corpus(max_bytes=8 * 2**20)
    train = Samples(Windows(corpus.train, preset.seq_len, args.steps * preset.batch * 8, seed=0))
    heldout = Samples(Windows(corpus.heldout, preset.seq_len, 8 * preset.batch, seed=1))
    training_args = TrainingArguments(
        output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=preset.batch,
        per_device_eval_batch_size=preset.batch, learning_rate=preset.lr, weight_decay=0.1, max_grad_norm=1.0,
        lr_scheduler_type="constant", logging_steps=10, save_strategy="no", report_to=[], bf16=gpu,
        use_cpu=not gpu, dataloader_num_workers=0,
    )
    recipe = FP8RecipeKwargs(backend=args.backend, recipe=args.recipe, opt_level=args.opt_level)
    trainer = FP8Trainer(model=model, args=training_args, train_dataset=train, eval_dataset=heldout,
                         fp8_recipe=recipe)
    trainer.train()
    metrics = trainer.evaluate()
    if trainer.is_world_process_zero():
        print(trainer.precision_plan)
        print(f"held-out loss {metrics['eval_loss']:.4f}")


if __name__ == "__main__":
    main()
