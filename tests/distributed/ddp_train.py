"""Run under `accelerate launch --multi_gpu --num_processes 2 --cpu` by tests/test_accelerator.py.

Each rank trains the same FP8 model on its shard; the result file says whether the parameters
stayed identical across ranks (DDP all-reduced the gradients) and whether the loss fell.
"""

import json
import sys

import torch
from teardown import end_ranks  # beside this script: torchrun puts its folder on sys.path
from torch import nn

from lowprec import Accelerator, FP8RecipeKwargs


def main(out_path: str) -> None:
    # The recipe comes from the handler; mixed_precision=fp8 came from the launcher.
    accelerator = Accelerator(kwargs_handlers=[FP8RecipeKwargs(backend="torchao", skip_slow_shapes=False)])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                          nn.Linear(64, 16))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 32, generator=g)
    y = torch.tanh(x @ (torch.randn(32, 16, generator=g) / 4))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    losses = []
    for _ in range(4):
        for xb, yb in loader:
            loss = nn.functional.mse_loss(model(xb).float(), yb)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(accelerator.reduce(loss.detach(), reduction="mean").item())

    flat = torch.cat([p.detach().flatten() for p in accelerator.unwrap_model(model).parameters()])
    gathered = accelerator.gather(flat.unsqueeze(0))
    plan = accelerator.precision_plan
    if accelerator.is_main_process:
        with open(out_path, "w") as fh:
            json.dump({
                "world_size": accelerator.num_processes,
                "engine": plan.engine,
                "fp8_modules": [n for n, m in accelerator.unwrap_model(model).named_modules()
                                if type(m).__name__ == "Float8Linear"],
                "max_param_diff_across_ranks": (gathered[0] - gathered[1]).abs().max().item(),
                "first_loss": sum(losses[:4]) / 4,
                "last_loss": sum(losses[-4:]) / 4,
            }, fh)
    end_ranks()


if __name__ == "__main__":
    main(sys.argv[1])
