"""Two-process CPU (gloo) runs of lowprec.Accelerator under DeepSpeed ZeRO, through Accelerate's plugin.

Run by tests/test_deepspeed.py:

    DS_ACCELERATOR=cpu ACCELERATE_USE_DEEPSPEED=true \
        python -m torch.distributed.run --nproc_per_node 2 tests/distributed/deepspeed_train.py STAGE OUT.json

Each scenario trains a small MLP against a fixed teacher for a few steps, each rank on its own rows,
with `FP8RecipeKwargs(backend="torchao", ...)` and `DeepSpeedPlugin(zero_stage=STAGE)`. Nothing is
asserted here: every rank records raw values (FP8 forward calls, losses, parameter digests, what
DeepSpeed was configured with, the checkpoint round trip) and rank 0 writes them for pytest. A
scenario that raises is recorded with its error.

On a CPU-only host Accelerate counts one process under DeepSpeed (its state sees no GPU backend)
while DeepSpeed's own process group has both: rows are chosen here by torch.distributed's rank.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import tempfile
import traceback
import weakref

import torch
import torch.distributed as dist
from msamp_ddp import digest  # beside this script: torchrun puts its folder on sys.path
from teardown import end_ranks  # beside this script: torchrun puts its folder on sys.path
from torch import nn

D_IN, D_HIDDEN, D_OUT = 32, 64, 16
MICRO_BATCH = 16
STEPS = 10
TE_MODULES = "lowprec.backends.te.modules"
SCENARIOS = {
    "torchao": {},
    "optimizer_states_fp8": dict(optimizer_states="fp8"),
    "comm_fp32": dict(grad_comm_dtype="fp32"),
    "comm_fp8": dict(grad_comm_dtype="fp8"),  # refused: DeepSpeed cannot send FP8
    "O1": dict(opt_level="O1"),  # refused until sharded FP8 weight gradients exist
    "msamp": dict(backend="msamp"),
    # FP8 weights, owner-held FP16 masters and O2 states beside DeepSpeed's ZeRO optimizer (stages 1/2)
    "O3": dict(backend="msamp", opt_level="O3"),
    # two optimizer groups (weights + the first bias with weight decay, other biases without): the
    # weights keep their group's weight decay when O3 takes them out of DeepSpeed's optimizer
    "O3_groups": dict(backend="msamp", opt_level="O3", groups="mixed"),
    # a group of Linear weights only would be left empty (DeepSpeed drops it): refused
    "O3_weights_group": dict(backend="msamp", opt_level="O3", groups="weights"),
    # activation_dtype='fp8': the tensors autograd saves in the forward stored in E4M3 under DeepSpeed too
    "fp8_activations": dict(activation_dtype="fp8"),
    # the FP8 layers compiled one by one (inductor), the default on FP8 GPUs: trains as O3 does, resumes
    "O3_compiled": dict(backend="msamp", opt_level="O3", compile_fp8_layers=True),
    # TransformerEngine's test double on an assumed H100: lowprec's te.autocast around every forward
    # under DeepSpeed (Accelerate's own TE path ignores TERecipeKwargs there)
    "te": dict(backend="te", recipe="delayed"),
}


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D_IN, D_HIDDEN), nn.GELU(), nn.Linear(D_HIDDEN, D_HIDDEN), nn.GELU(),
                         nn.Linear(D_HIDDEN, D_OUT))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(MICRO_BATCH, D_IN, generator=g)
    teacher = torch.randn(D_IN, D_OUT, generator=torch.Generator().manual_seed(7)) / 4
    return x, torch.tanh(x @ teacher)


def accelerator_for(stage: int, accumulate: int = 1, **knobs):
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DeepSpeedPlugin

    from lowprec import Accelerator, FP8RecipeKwargs

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    world = int(os.environ["WORLD_SIZE"])
    plugin = DeepSpeedPlugin(hf_ds_config={
        "train_micro_batch_size_per_gpu": MICRO_BATCH // accumulate, "gradient_accumulation_steps": accumulate,
        "train_batch_size": MICRO_BATCH * world, "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True},
        "bf16": {"enabled": "auto"},
    })
    knobs.setdefault("backend", "torchao")
    recipe = FP8RecipeKwargs(skip_first_last=False, skip_slow_shapes=False, **knobs)
    return Accelerator(mixed_precision="fp8", kwargs_handlers=[recipe], deepspeed_plugin=plugin,
                       gradient_accumulation_steps=accumulate)


def run_steps(accelerator, model, optimizer, steps: range) -> list[float]:
    rank = dist.get_rank()
    losses = []
    for step in steps:
        x, y = batch(step, rank)
        loss = nn.functional.mse_loss(model(x.to(accelerator.device)).float(), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def accumulated_losses(stage: int, knobs: dict, micro: int = 2) -> list[float]:
    """Each step's rows in `micro` micro-batches under `accelerator.accumulate` (DeepSpeed's
    gradient_accumulation_steps = micro): the step's loss is the mean over its micro-batches."""
    accelerator = accelerator_for(stage, accumulate=micro, **knobs)
    model = make_model()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    rank = dist.get_rank()
    losses = []
    for step in range(STEPS):
        x, y = batch(step, rank)
        total = 0.0
        for xs, ys in zip(x.chunk(micro), y.chunk(micro)):
            with accelerator.accumulate(model):
                loss = nn.functional.mse_loss(model(xs.to(accelerator.device)).float(), ys)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            total += loss.item() / micro
        losses.append(total)
    return losses


_REFS: list = []  # weak references to the running scenario's parameters and optimizer
_ACCELERATORS: list = []  # its Accelerator, freed as Accelerate tells users to between two trainings


def scenario(stage: int, knobs: dict) -> dict:
    """The scenario's record, with `outlived`: what of its model and optimizer was alive after the run, collected."""
    _REFS.clear()
    record = _scenario_on_its_backend(stage, knobs)
    while _ACCELERATORS:  # DeepSpeed's engine holds its model until destroyed: Accelerate's free_memory() does that
        _ACCELERATORS.pop().free_memory()
    gc.collect()
    record["outlived"] = sorted(type(r()).__name__ for r in _REFS if r() is not None)
    return record


def _scenario_on_its_backend(stage: int, knobs: dict) -> dict:
    if knobs.get("backend") == "te":
        with _fake_te_on_an_h100():
            import fake_te

            # the double keeps no FP8 state to checkpoint (its extra state needs one), so no round trip here
            record = _scenario(stage, knobs, checkpoint=False)
            calls = [c for c in fake_te.autocast_calls if c["enabled"]]
            record["te_autocast_forwards"] = len(calls)
            record["te_recipes"] = sorted({type(c["recipe"]).__name__ for c in calls})
            record["te_reduce_amax"] = sorted({c["recipe"].reduce_amax for c in calls})
            return record
    return _scenario(stage, knobs)


@contextlib.contextmanager
def _fake_te_on_an_h100():
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "backends"))
    import fake_te
    import pytest

    from lowprec.planning.hardware import DeviceInfo

    with pytest.MonkeyPatch.context() as monkeypatch, fake_te.installed(monkeypatch):
        h100 = DeviceInfo("cuda", "H100", (9, 0))
        monkeypatch.setattr("lowprec.runtime.run_context.device_info", lambda *_a, **_k: h100)
        yield


def single_process_losses(level: str | None) -> list[float]:
    """The global batch's loss (both ranks' rows) per step on one process: msamp at `level`, or FP32
    (None); AdamW and clipping as in the DeepSpeed runs."""
    from lowprec import FP8RecipeKwargs, RunContext, build_plan
    from lowprec.backends import create_backend
    from lowprec.planning.hardware import device_info

    model = make_model()
    backend = None
    if level is not None:
        recipe = FP8RecipeKwargs(backend="msamp", opt_level=level, skip_first_last=False, skip_slow_shapes=False)
        context = RunContext(device=device_info("cpu"), engine="single", world_size=1)
        backend = create_backend(recipe, context)
        model = backend.convert(model, build_plan(model, recipe, context=context, backend=backend))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if backend is not None:
        optimizer = backend.wrap_optimizer(optimizer, None)
    hook = backend.post_optimizer_step(model) if backend is not None else None
    losses = []
    for step in range(STEPS):
        xs, ys = zip(*(batch(step, rank) for rank in range(dist.get_world_size())))
        loss = nn.functional.mse_loss(model(torch.cat(xs)).float(), torch.cat(ys))
        loss.backward()
        if backend is not None:
            backend.clip_grad_norm_(list(model.parameters()), 1.0)
        else:
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        if hook is not None:
            hook()
        losses.append(loss.item())
    return losses


def o3_record(accelerator, inner) -> dict:
    """What O3 keeps where on this rank: FP8 weights, owned masters and their states (collective)."""
    backend = accelerator._lowprec[-1][1]
    zero = backend.zero
    layers = zero.layers
    masters = zero.full_masters()
    exported = backend.portable_state_dict(inner.state_dict())
    return {
        "weight_types": sorted({f"{type(m.weight).__name__} {m.weight._data.dtype}" for m in layers}),
        "grad_dtypes": sorted({str(m.fp8_grad_data.dtype) for m in layers}),
        "layers": len(layers), "owned": sorted(zero.masters), "owners": zero.owners,
        "master_dtypes": sorted({str(t.dtype) for t in zero.masters.values()}),
        "state_types": sorted({f"{k} {v.dtype}" for st in zero.optimizer.state.values() for k, v in st.items()
                               if k in ("exp_avg", "exp_avg_sq")}),
        # DeepSpeed's ZeRO optimizer holds every parameter but the converted weights
        "deepspeed_numel": sum(p.numel() for grp in accelerator._optimizers[0].optimizer.bit16_groups for p in grp),
        "model_numel": sum(p.numel() for p in inner.parameters()),
        "masters_digest": digest(*[masters[n].float() for n in zero.names]),
        # the exported weights are the FP16 masters, not the E4M3 weights the GEMMs read
        "export_minus_master": max((exported[f"{n}.weight"].float() - masters[n].float().cpu()).abs().max().item()
                                   for n in zero.names),
        "export_minus_fp8": max((exported[f"{n}.weight"].float() - m.weight.dequantize().float().cpu()).abs().max()
                                .item() for n, m in zip(zero.names, layers)),
        "bytes": zero.model_state_bytes(), "params": sum(m.weight.numel() for m in layers),
        "planned_bytes_per_param": accelerator.precision_plan.model_state_bytes_per_param,
        "plan_rows": {t.kind: t.dtype for t in accelerator.precision_plan.tensors},
        # the input and output-gradient delayed scales and the amax windows they come from (the step in
        # progress left out): all-reduced across ranks after every step (reduce_amax's default)
        "reduce_amax": backend.reduce_amax, "amax_reduction": backend.amax_reduction,
        "delayed_scales": [[float(s) for s in m.scales[:2]] for m in layers],
        "amax_windows": [m.amax_history[:, 1:].tolist() for m in layers],
    }


def make_optimizer(model: nn.Module, groups: str | bool) -> torch.optim.Optimizer:
    if not groups:
        return torch.optim.AdamW(model.parameters(), lr=1e-2)
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    if groups == "mixed":
        weights, biases = weights + biases[:1], biases[1:]
    return torch.optim.AdamW([{"params": weights, "weight_decay": 0.1}, {"params": biases, "weight_decay": 0.0}],
                             lr=1e-2)


def _scenario(stage: int, knobs: dict, checkpoint: bool = True) -> dict:
    knobs = dict(knobs)
    groups = knobs.pop("groups", False)
    accelerator = accelerator_for(stage, **knobs)
    model = make_model()
    optimizer = make_optimizer(model, groups)
    model, optimizer = accelerator.prepare(model, optimizer)
    _REFS.extend([weakref.ref(p) for p in model.parameters()] + [weakref.ref(optimizer)])
    _ACCELERATORS.append(accelerator)
    inner = accelerator.unwrap_model(model)
    storage = None
    if knobs.get("activation_dtype") == "fp8":
        from lowprec.runtime.activations import activation_storage

        storage = activation_storage(model)
        storage.min_elements = 0  # the toy model's activations are far below the default threshold
    fp8_calls = []
    for module in inner.modules():
        if type(module).__name__ in ("Float8Linear", "FP8Linear") or type(module).__module__.startswith(TE_MODULES):
            module.register_forward_hook(lambda *_: fp8_calls.append(1))
    plan = accelerator.precision_plan
    config = accelerator.state.deepspeed_plugin.deepspeed_config
    record = {
        "engine": plan.engine, "wrapped": type(model).__name__,
        "fp8_linears": sum(type(m).__name__ == "Float8Linear" or type(m).__module__ == "lowprec.backends.te.modules"
                           for m in inner.modules()),
        "optimizer": type(getattr(optimizer.optimizer, "optimizer", None)).__name__,
        "zero_optimizer": type(optimizer.optimizer).__name__,
        "grad_comm": plan.tensor("grad_comm").dtype,
        "communication_data_type": config.get("communication_data_type"),
        "engine_communication_data_type": str(model.communication_data_type),
        "zero_stage": model.zero_optimization_stage(),
    }
    record["losses"] = run_steps(accelerator, model, optimizer, range(STEPS))
    record["fp8_forward_calls"] = len(fp8_calls)
    record["packed_elements"] = storage.counts.packed_elements if storage is not None else 0
    if knobs.get("opt_level") == "O3":
        record["o3"] = o3_record(accelerator, inner)
        zero = accelerator._lowprec[-1][1].zero
        record["o3_group_weight_decay"] = [g["weight_decay"] for g in zero.optimizer.param_groups]
    record["compiled_layers"] = sum(getattr(m, "_compiled_call_impl", None) is not None for m in inner.modules())
    if knobs.get("opt_level") == "O3" and not groups and not knobs.get("compile_fp8_layers"):
        record["accumulated"] = accumulated_losses(stage, knobs)
        if dist.get_rank() == 0:
            record["o2_single"] = single_process_losses("O2")
            record["fp32_single"] = single_process_losses(None)
    if stage < 3:  # replicated weights: every rank must hold the same ones
        record["params"] = digest(*[p.detach().float() for p in inner.parameters()])
    if not checkpoint:
        return record
    # A checkpoint mid-run: resuming from it must give the same losses as going on.
    with tempfile.TemporaryDirectory() as shared:
        path = [shared]
        dist.broadcast_object_list(path, src=0)  # one folder for both ranks (the same host)
        checkpoint = os.path.join(path[0], "ckpt")
        accelerator.save_state(checkpoint)
        record["continued"] = run_steps(accelerator, model, optimizer, range(STEPS, STEPS + 3))
        state_dict = accelerator.get_state_dict(model)  # unwrap=True: what save_model writes
        if dist.get_rank() == 0:  # under DeepSpeed on CPU Accelerate calls every rank the main process
            plain = make_model()
            missing, unexpected = plain.load_state_dict({k: v.float() for k, v in state_dict.items()}, strict=True)
            x, _ = batch(999, 0)
            with torch.no_grad():
                reference = plain(x)
            record["state_dict_keys"] = sorted(state_dict)
            record["plain_output_norm"] = reference.norm().item()
        dist.barrier()

        accelerator2 = accelerator_for(stage, **knobs)
        model2 = make_model()
        optimizer2 = make_optimizer(model2, groups)
        model2, optimizer2 = accelerator2.prepare(model2, optimizer2)
        if storage is not None:
            from lowprec.runtime.activations import activation_storage

            activation_storage(model2).min_elements = 0
        accelerator2.load_state(checkpoint)
        record["resumed"] = run_steps(accelerator2, model2, optimizer2, range(STEPS, STEPS + 3))
        if knobs.get("opt_level") == "O3":
            # a scheduler after the resume sets the rate on the optimizer's groups, which load_state replaced:
            # O3's masters must step with it
            for group in optimizer2.optimizer.optimizer.param_groups:
                group["lr"] = 1.25e-3
            run_steps(accelerator2, model2, optimizer2, range(STEPS + 3, STEPS + 4))
            record["o3_lr_after_resume"] = [g["lr"] for g in accelerator2._lowprec[-1][1].zero.optimizer.param_groups]
        dist.barrier()
    return record


def main(argv: list[str]) -> None:
    stage, out_path = int(argv[1]), argv[2]
    names = argv[3].split(",") if len(argv) > 3 else list(SCENARIOS)
    torch.set_num_threads(1)
    results = {}
    for name in names:
        knobs = SCENARIOS[name]
        try:
            record = scenario(stage, knobs)
            ranks = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, record)
            results[name] = {"ranks": ranks}
        except Exception as exc:  # noqa: BLE001 - recorded for the pytest side
            results[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
            print(traceback.format_exc(), file=sys.stderr, flush=True)
        if dist.is_initialized():
            dist.barrier()
    if dist.get_rank() == 0:
        with open(out_path, "w") as fh:
            json.dump({"stage": stage, "world_size": dist.get_world_size(), "scenarios": results}, fh, indent=1)
    end_ranks()


if __name__ == "__main__":
    main(sys.argv)
