"""Run on two CPU processes (torchrun, gloo) by tests/test_activations_in_graph.py: FP8 saved activations under
DDP with Accelerate's regional compilation, encoded inside the compiled graphs (LOWPREC_FP8_ACTIVATIONS_IN_GRAPH=1,
asked for: under DDP the default is the Python hooks) and through the Python hooks (=0), one after the other in
each rank. The result says, per run: the losses, what the storage counted, and whether the ranks' weights agree.
"""

import json
import os
import sys
from types import SimpleNamespace

import torch
from teardown import end_ranks  # beside this script: torchrun puts its folder on sys.path
from torch import nn

WIDTH, BATCH, STEPS = 256, 128, 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(WIDTH, 16)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def train(switch: str, activation_dtype: str | None = "fp8") -> dict:
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import TorchDynamoPlugin

    from lowprec import Accelerator, FP8RecipeKwargs
    from lowprec.runtime.activations import ActivationCounts, activation_storage

    os.environ["LOWPREC_FP8_ACTIVATIONS_IN_GRAPH"] = switch
    torch._dynamo.reset()
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    recipe = FP8RecipeKwargs(backend="torchao", skip_slow_shapes=False, activation_dtype=activation_dtype)
    accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[recipe], cpu=True,
                              dynamo_plugin=TorchDynamoPlugin(backend="inductor", use_regional_compilation=True))
    rank = accelerator.process_index
    torch.manual_seed(0)
    model = Model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    storage = activation_storage(model)
    if activation_dtype is None:
        storage = SimpleNamespace(in_graph=False, counts=ActivationCounts())
    g = torch.Generator().manual_seed(1 + rank)  # each rank its own batch: DDP must average them
    losses, first_grads = [], None
    for _ in range(STEPS):
        x, y = torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, 16, generator=g)
        loss = nn.functional.mse_loss(model(x).float(), y)
        accelerator.backward(loss)
        if first_grads is None:  # averaged over the ranks by DDP
            first_grads = {n: p.grad.float().flatten().tolist() for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    flat = torch.cat([p.detach().float().flatten() for p in accelerator.unwrap_model(model).parameters()])
    gathered = accelerator.gather(flat.unsqueeze(0))
    counts = storage.counts
    return {"engine": accelerator.precision_plan.engine, "in_graph": storage.in_graph, "losses": losses,
            "packed": counts.packed, "traced_packed": counts.traced_packed, "traced_kept": counts.traced_kept,
            "plan_says_in_graph": "inside the graph" in accelerator.precision_plan.activations.other_tensors,
            "max_param_diff_across_ranks": (gathered[0] - gathered[1]).abs().max().item(), "first_grads": first_grads}


def main(out_path: str) -> None:
    runs = {switch: train(switch) for switch in ("1", "0")}
    runs["reference"] = train("0", activation_dtype=None)
    if int(os.environ.get("RANK", "0")) == 0:
        with open(out_path, "w") as fh:
            json.dump(runs, fh)
    end_ranks()


if __name__ == "__main__":
    main(sys.argv[1])
