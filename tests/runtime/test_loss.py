"""activation_dtype='fp8' gives a Hugging Face causal LM a loss without FP32 copies of the logits
(lowprec/runtime/loss.py): the model's loss and gradients as with Hugging Face's own, and the plan says which loss
runs; a loss the user set, and models of other kinds, are left alone."""

from __future__ import annotations

import pytest
import torch
from conftest import causal_lm_losses
from torch import nn

from lowprec import Accelerator, FP8RecipeKwargs
from lowprec.kernels.cross_entropy import causal_lm_loss
from lowprec.runtime import loss as runtime_loss

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


def tiny_llama(seed: int = 0) -> nn.Module:
    from lowprec.demo.model import PRESETS, build_model

    torch.manual_seed(seed)
    return build_model(PRESETS["tiny"])


def prepare(model: nn.Module, activation_dtype, backend: str = "msamp"):
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    recipe = FP8RecipeKwargs(backend=backend, opt_level="O2" if backend == "msamp" else None,
                             skip_slow_shapes=False, activation_dtype=activation_dtype)
    accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[recipe])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    prepared, _ = accelerator.prepare(model, optimizer)
    return accelerator, prepared


def loss_line(accelerator) -> str:
    return next(line for line in accelerator.precision_plan.activations.lines() if line.lstrip().startswith("loss"))


def test_fp8_activations_give_a_hf_causal_lm_the_chunked_loss_with_its_gradients():
    from transformers.loss.loss_utils import ForCausalLMLoss

    # torchao: its weight gradients are plain .grad (msamp O2 keeps them in FP8 stores of its own)
    accelerator, model = prepare(tiny_llama(), "fp8", backend="torchao")
    inner = accelerator.unwrap_model(model)
    assert inner.loss_function is causal_lm_loss
    assert runtime_loss.SWAPPED in loss_line(accelerator)
    ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[:, :5] = -100
    grads = []
    for use_hf in (False, True):
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=None if use_hf else labels)
        loss = ForCausalLMLoss(out.logits, labels, inner.config.vocab_size) if use_hf else out.loss
        accelerator.backward(loss)
        grads.append((loss.detach(), {n: p.grad.detach().double().clone() for n, p in model.named_parameters()}))
    (loss, ours), (ref_loss, theirs) = grads
    assert torch.isfinite(loss) and abs(float(loss - ref_loss)) <= 1e-6 * float(ref_loss)
    for name, ref in theirs.items():
        assert float((ours[name] - ref).norm() / ref.norm()) <= 1e-5, name


def test_without_fp8_activations_the_models_loss_is_left_alone():
    accelerator, model = prepare(tiny_llama(), None)
    inner = accelerator.unwrap_model(model)
    assert "_loss_function" not in vars(inner) and inner.loss_function is not causal_lm_loss
    assert runtime_loss.KEPT_PLAIN in loss_line(accelerator)


def test_a_loss_the_user_set_is_kept():
    def mine(logits, labels, vocab_size, **kwargs):
        return logits.float().mean()

    model = tiny_llama()
    model.loss_function = mine
    accelerator, model = prepare(model, "fp8")
    assert accelerator.unwrap_model(model).loss_function is mine
    assert runtime_loss.KEPT_OTHER in loss_line(accelerator)


def test_a_model_of_another_kind_is_left_alone():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128))
    accelerator, model = prepare(plain, "fp8", backend="torchao")
    assert runtime_loss.KEPT_OTHER in loss_line(accelerator)
    model(torch.randn(256, 128)).float().square().mean().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_under_regional_compilation_the_model_that_runs_computes_the_chunked_loss(monkeypatch):
    # Accelerate compiles a copy of the model block by block and keeps the model as _orig_mod: the copy runs
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import TorchDynamoPlugin

    from lowprec.kernels import cross_entropy

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    calls = []
    apply = cross_entropy._LogitsCrossEntropy.apply
    monkeypatch.setattr(cross_entropy._LogitsCrossEntropy, "apply", lambda *a: calls.append(a[0].shape) or apply(*a))
    recipe = FP8RecipeKwargs(backend="torchao", skip_slow_shapes=False, activation_dtype="fp8")
    plugin = TorchDynamoPlugin(backend="aot_eager", use_regional_compilation=True)
    accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[recipe], dynamo_plugin=plugin)
    model = accelerator.prepare(tiny_llama())
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=ids, labels=ids).loss
    accelerator.backward(loss)
    assert calls == [torch.Size([64, 256])] and torch.isfinite(loss)
    assert all(m.loss_function is causal_lm_loss for m in runtime_loss_models(model))


def runtime_loss_models(model):
    from lowprec.runtime.wrapping import models_of

    return [m for m in models_of(model) if hasattr(type(m), "loss_function")]


class PeftLike(nn.Module):
    """A wrapper as PEFT's PeftModel is to this code: the Hugging Face model behind `get_base_model()`, not at
    `.module` or `_orig_mod`."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.base_model = nn.ModuleDict({"model": model})

    def get_base_model(self) -> nn.Module:
        return self.base_model["model"]

    def forward(self, *args, **kwargs):
        return self.get_base_model()(*args, **kwargs)


def test_a_wrapped_models_loss_is_swapped_and_the_plan_says_so():
    model = tiny_llama()
    accelerator, prepared = prepare(PeftLike(model), "fp8", backend="torchao")
    assert model.loss_function is causal_lm_loss
    assert runtime_loss.SWAPPED in loss_line(accelerator)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(prepared(input_ids=ids, labels=ids).loss)


def test_a_model_with_no_causal_lm_loss_type_is_left_alone_without_a_warning(recwarn):
    from transformers import LlamaModel

    from lowprec.demo.model import PRESETS, llama_config

    decoder = LlamaModel(llama_config(PRESETS["tiny"]))
    assert not runtime_loss.swap_causal_lm_loss(decoder)
    assert "_loss_function" not in vars(decoder)
    assert runtime_loss.loss_storage(decoder, "fp8") == runtime_loss.KEPT_OTHER
    assert not [w for w in recwarn if "loss_type" in str(w.message)]


def test_training_with_the_chunked_loss_follows_hugging_faces_loss_curve():
    # the same run twice, with and without the swap (deterministic on CPU): the losses agree step by step within
    # FP32 summation order, compounded over the steps
    from lowprec.demo.data import Windows, stdlib_corpus

    corpus = stdlib_corpus(max_bytes=2**20)
    curves = []
    for keep_hf in (False, True):
        model = tiny_llama()
        if keep_hf:
            from transformers.loss.loss_utils import ForCausalLMLoss

            model.loss_function = ForCausalLMLoss  # set before prepare(): lowprec keeps it
        accelerator, prepared = prepare(model, "fp8", backend="torchao")
        optimizer = accelerator._optimizers[0]
        loader = torch.utils.data.DataLoader(Windows(corpus.train, 64, 8 * 12, seed=0), batch_size=8)
        curves.append(causal_lm_losses(accelerator, prepared, optimizer, loader))
    ours, theirs = curves
    assert len(ours) == 12 and ours[-1] < ours[0] - 0.5
    assert max(abs(a - b) / b for a, b in zip(ours, theirs)) <= 1e-4, (ours, theirs)
