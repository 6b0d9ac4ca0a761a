"""`FP8RecipeKwargs(optimizer_in_backward=True)` on a CUDA GPU with torchao's real FP8 GEMMs: the same weights as
`optimizer.step()` after backward (fused AdamW, the GPU's kernel), and a lower peak by about the FP32 gradients it
never holds all at once. The CPU test (tests/runtime/test_steps_in_backward.py) checks the arithmetic bit for bit
with several optimizers; this one the memory, which only a GPU's allocator measures. Run with `pytest -m gpu` on a
GPU host; skipped elsewhere."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
        reason="needs an FP8 GPU (sm_89 or newer)",
    ),
    pytest.mark.usefixtures("fresh_accelerate_state"),
]
WIDTH, LAYERS = 4096, 4


def _run(in_backward: bool, steps: int = 3):
    """(the weights after `steps` steps, the peak allocated in the last step's backward over what the model state
    held before it, the FP32 gradients' bytes)."""
    from accelerate.state import AcceleratorState, GradientState

    from lowprec import Accelerator, FP8RecipeKwargs

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)]).cuda()
    recipe = FP8RecipeKwargs(backend="torchao", skip_slow_shapes=False, optimizer_in_backward=in_backward or None)
    accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[recipe], lowprec_quiet=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    # few tokens: the activations are small beside the gradients (64 MiB a layer), so the backward's peak is its end
    x = torch.randn(256, WIDTH, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    rise = 0
    for _ in range(steps):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        accelerator.backward(model(x).float().square().mean())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        rise = torch.cuda.max_memory_allocated() - before
    grads = sum(p.numel() * 4 for p in model.parameters())
    return [p.detach().clone() for p in model.parameters()], rise, grads


def test_steps_in_backward_on_the_gpu_train_the_same_weights_below_the_gradients_peak():
    plain, plain_rise, grads = _run(False)
    stepped, rise, _ = _run(True)
    for a, b in zip(plain, stepped):
        assert torch.equal(a, b)
    # without: every FP32 gradient (256 MiB here) exists at the backward's end; with: one layer's at a time (and
    # the transients that make it), so the rise is lower by at least half of them
    assert rise <= plain_rise - grads / 2, (rise, plain_rise, grads)
