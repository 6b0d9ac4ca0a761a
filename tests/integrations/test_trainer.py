"""FP8Trainer: `transformers.Trainer` training in FP8 through lowprec.Accelerator (CPU, emulated)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchao")
transformers = pytest.importorskip("transformers")

from lowprec import Accelerator, FP8RecipeKwargs  # noqa: E402
from lowprec.integrations.trainer import FP8Trainer  # noqa: E402


class Samples(torch.utils.data.Dataset):
    def __init__(self, n: int = 64, seq: int = 32):
        g = torch.Generator().manual_seed(0)
        # a learnable pattern: each sequence counts up from a random start
        starts = torch.randint(0, 200, (n, 1), generator=g)
        self.ids = (starts + torch.arange(seq)) % 256

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64))


def training_args(tmp_path, **overrides):
    from transformers import TrainingArguments

    kwargs = dict(output_dir=str(tmp_path), max_steps=12, per_device_train_batch_size=8, learning_rate=3e-3,
                  lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                  dataloader_num_workers=0)
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


def fp8_forwards(model) -> list[int]:
    calls = []
    for module in model.modules():
        if type(module).__name__ == "Float8Linear":
            module.register_forward_hook(lambda *_: calls.append(1))
    return calls


@pytest.mark.parametrize("level, optimizer", [(None, "AdamW"), ("O2", "LowBitAdamW")])
def test_fp8_trainer_trains_in_fp8(fresh_accelerate_state, tmp_path, level, optimizer):
    import transformers.trainer as trainer_module

    recipe = FP8RecipeKwargs(backend="torchao", opt_level=level, skip_first_last=False, skip_slow_shapes=False)
    trainer = FP8Trainer(model=llama(), args=training_args(tmp_path), train_dataset=Samples(), fp8_recipe=recipe)
    assert isinstance(trainer.accelerator, Accelerator) and trainer.accelerator.fp8_enabled
    assert trainer_module.Accelerator.__module__.startswith("accelerate")  # the swap lasted one call
    trainer.train()
    plan = trainer.precision_plan
    assert plan.backend == "torchao" and plan.opt_level == level and len(plan.converted) == 15
    model = trainer.accelerator.unwrap_model(trainer.model)
    calls = fp8_forwards(model)
    trainer.evaluate(Samples(16))
    assert calls, "the model Trainer evaluates is the converted one"
    assert type(getattr(trainer.optimizer, "optimizer", trainer.optimizer)).__name__ == optimizer
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert losses[-1] < 0.8 * losses[0], losses


def test_plain_trainer_leaves_fp8_off_which_is_why_fp8_trainer_exists(fresh_accelerate_state, tmp_path):
    from transformers import Trainer

    trainer = Trainer(model=llama(), args=training_args(tmp_path, max_steps=2), train_dataset=Samples())
    trainer.train()
    assert not any(type(m).__name__ == "Float8Linear" for m in trainer.model.modules())


def test_fp8_trainer_refuses_fp16(fresh_accelerate_state, tmp_path):
    with pytest.raises(ValueError, match=r"TrainingArguments\(fp16=True\) conflicts with FP8 training.*bf16=True"):
        FP8Trainer(model=llama(), args=training_args(tmp_path, fp16=True, use_cpu=False), train_dataset=Samples(),
                   fp8_recipe=FP8RecipeKwargs(backend="torchao"))


def test_fp8_trainer_takes_only_lowprecs_recipe(fresh_accelerate_state, tmp_path):
    from accelerate.utils import AORecipeKwargs

    with pytest.raises(TypeError, match="takes a lowprec.FP8RecipeKwargs, got AORecipeKwargs"):
        FP8Trainer(model=llama(), args=training_args(tmp_path), fp8_recipe=AORecipeKwargs())
