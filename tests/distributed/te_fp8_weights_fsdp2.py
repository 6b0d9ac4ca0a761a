"""Run under `torchrun --nproc_per_node 2` (gloo, CPU) by tests/backends/test_te_fsdp2.py.

`FP8RecipeKwargs(backend='te', fp8_weights=True)` through the steps of Accelerate's FSDP2 preparation
(its FSDP path needs GPUs, so they are taken one by one as in fsdp2_o3.py), with the TE test double
(tests/backends/fake_te.py) and real `fully_shard`: the adapter's hooks around Accelerate, not TE's
kernels (tests/gpu/test_te_gpu.py runs those). The converted weights' `data_ptr()` is taken as 0, as
it is for TE's Float8Tensor (a wrapper subclass with no storage of its own).
"""

import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
from teardown import end_ranks, write_ranks  # beside this script: torchrun puts its folder on sys.path
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "backends"))
import fake_te  # noqa: E402

from lowprec import FP8RecipeKwargs, RunContext, build_plan  # noqa: E402
from lowprec.backends import create_backend  # noqa: E402
from lowprec.backends.te import TEBackend  # noqa: E402
from lowprec.planning.hardware import DeviceInfo  # noqa: E402

H100 = DeviceInfo("cuda", "H100", (9, 0))


class Block(nn.Module):
    def __init__(self, d: int = 32):
        super().__init__()
        self.up, self.down, self.norm = nn.Linear(d, 2 * d), nn.Linear(2 * d, d), nn.LayerNorm(d)

    def forward(self, x):
        return self.norm(x + self.down(torch.relu(self.up(x))))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(32, 48)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def prepare(with_hooks: bool) -> dict:
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model, fsdp2_switch_optimizer_parameters
    from torch.distributed.tensor import DTensor

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Model().to(torch.bfloat16)  # a BF16 model: Accelerate upcasts the rest, never the FP8 weights
    originals = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=["Block"])
    accelerator = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin), mixed_precision="bf16",
                                  is_main_process=rank == 0, torch_device_mesh=None, parallelism_config=None)
    recipe = FP8RecipeKwargs(backend="te", recipe="current", fp8_weights=True, skip_first_last=False,
                             skip_slow_shapes=False)
    context = RunContext(device=H100, engine="fsdp2", world_size=dist.get_world_size())
    backend = create_backend(recipe, context, require_package=False)
    plan = build_plan(model, recipe, context=context, backend=backend)
    model = backend.convert(model, plan)
    fp8_names = sorted(n + ".weight" for n, m in model.named_modules() if backend.converted_kind(m) == "linear")
    decay = [p for n, p in model.named_parameters() if n in fp8_names]
    rest = [p for n, p in model.named_parameters() if n not in fp8_names]
    optimizer = backend.wrap_optimizer(torch.optim.AdamW([{"params": rest, "weight_decay": 0.0},
                                                          {"params": decay}], lr=1e-3), plan)
    names_of = {id(p): n for n, p in model.named_parameters()}
    groups_before = [[names_of[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    if with_hooks:
        backend.before_engine_prepare([model, optimizer], accelerator)
    # AcceleratedOptimizer's device placement: the optimizer's state dict loaded back, which gives it new group
    # dicts (torch's load_state_dict); a weight put back into a group dict held from before was in no group
    optimizer.load_state_dict(optimizer.state_dict())

    # Accelerate's _prepare_fsdp2 around fsdp2_prepare_model: optimizer parameters keyed by data_ptr()
    # before wrapping, swapped for the wrapped ones by name; Float8Tensor weights report 0.
    def pointer(name, p):
        if name in fp8_names:
            return 0
        return p._local_tensor.data_ptr() if isinstance(p, DTensor) else p.data_ptr()

    pointers = {id(p): pointer(n, p) for n, p in model.named_parameters()}
    old = {n: pointers[id(p)] for n, p in model.named_parameters()}
    for group in optimizer.param_groups:
        for i, p in enumerate(group["params"]):
            group["params"][i] = torch.empty(1)
            group["params"][i].data_ptr = pointers[id(p)]
    model = fsdp2_prepare_model(accelerator, model)
    new = dict(model.named_parameters())
    fsdp2_switch_optimizer_parameters(optimizer, {old[n]: new[n] for n in old})
    if with_hooks:
        backend.setup_communication(model, plan)
        backend.setup_grad_stores(model)
        backend.setup_grad_comm(model)
    names_of = {id(p): n for n, p in model.named_parameters()}
    groups_after = [[names_of[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    masters = {}
    for n in fp8_names:
        p = new[n]
        seeded = optimizer.scaled_state.get((id(p), "master_param"))
        expected = torch.chunk(originals[n], dist.get_world_size(), dim=0)[rank]
        masters[n] = seeded is not None and torch.equal(seeded, expected)
    out = model(torch.randn(4, 32, generator=torch.Generator().manual_seed(rank)))
    out.float().pow(2).mean().backward()
    return {
        "groups_before": groups_before, "groups_after": groups_after,
        "fp8_weights": {n: [type(new[n]).__name__, str(new[n].dtype), list(new[n]._local_tensor.shape)]
                        for n in fp8_names},
        "masters_are_this_ranks_rows": masters,
        "other_dtypes": sorted({str(p.dtype) for n, p in new.items() if n not in fp8_names}),
        "grads": all(new[n].grad is not None for n in fp8_names),
        # the optimizer's own groups, as it steps and zeroes them
        "stepped": sorted(names_of[id(p)] for g in optimizer.param_groups for p in g["params"] if id(p) in names_of),
        "quantized_init_calls": len(fake_te.quantized_init_calls),
    }


def main(out_path: str) -> None:

    import pytest
    from accelerate import PartialState

    dist.init_process_group("gloo")
    PartialState(cpu=True)  # Accelerate's logging (its upcast of the BF16 rest) needs it
    torch.set_num_threads(1)
    patch = pytest.MonkeyPatch()
    fake_te.install(patch)
    patch.setattr(TEBackend, "fp8_weight_device", staticmethod(lambda: torch.device("cpu")))
    result = {"hooks": prepare(with_hooks=True), "no_hooks": prepare(with_hooks=False)}
    write_ranks(result, out_path)
    end_ranks()


if __name__ == "__main__":
    main(sys.argv[1])
