"""Run under `torchrun --nproc_per_node 2` (gloo, CPU) by tests/test_accelerate_fsdp2.py.

The whole `lowprec.Accelerator` under Accelerate's own FSDP2 preparation (`Accelerator._prepare_fsdp2`: the
optimizer wrapped as `AcceleratedOptimizer`, whose device placement loads the optimizer's state dict back, the
data_ptr remap, `fsdp2_prepare_model`), where the other CPU scripts call those steps one by one. Accelerate
turns FSDP on only for GPU process groups, so this script tells it the gloo group is one (PartialState's
`distributed_type`, before the Accelerator is made); every tensor stays on the CPU. By hand, TE's
`fp8_weights` went back into optimizer group dicts Accelerate had replaced, and no TE Linear trained under
FSDP2 until 2026-11-29; this is the run that sees such a thing on a CPU.

    python -m torch.distributed.run --nproc_per_node 2 tests/distributed/accelerate_fsdp2.py SCENARIOS OUT.json
"""

import os
import sys
import traceback

import torch
import torch.distributed as dist
from gpu_engines import weight_sample  # beside this script: torchrun puts its folder on sys.path
from teardown import end_ranks, write_ranks

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "backends"))

STEPS = 4
SCENARIOS = {
    "msamp_O3": dict(backend="msamp", opt_level="O3"),
    "torchao": dict(backend="torchao", recipe="tensorwise"),
    "te_fp8_weights": dict(backend="te", recipe="current", fp8_weights=True),
    "msamp_O3_act8": dict(backend="msamp", opt_level="O3", activation_dtype="fp8"),
    "msamp_O3_fp8_comm": dict(backend="msamp", opt_level="O3", grad_comm_dtype="fp8"),
    "torchao_bf16_states": dict(backend="torchao", recipe="tensorwise", optimizer_states="bf16"),
    "te": dict(backend="te", recipe="current"),
}


def scenario(knobs: dict) -> dict:
    import pytest
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    from lowprec import Accelerator, FP8RecipeKwargs
    from lowprec.demo.model import PRESETS, build_model
    from lowprec.runtime.export import BACKEND_ATTR

    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    patch = pytest.MonkeyPatch()
    if knobs["backend"] == "te":
        import fake_te
        from fake_te import FusedAdam

        from lowprec.backends.te import TEBackend
        from lowprec.planning.hardware import DeviceInfo

        fake_te.install(patch)
        patch.setattr(TEBackend, "fp8_weight_device", staticmethod(lambda: torch.device("cpu")))
        patch.setattr("lowprec.runtime.run_context.device_info", lambda *_a, **_k: DeviceInfo("cuda", "H100", (9, 0)))
    PartialState(cpu=True)
    # Accelerate makes FSDP a GPU engine: the gloo group is named a GPU one, the device stays the CPU
    PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU
    try:
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                                transformer_cls_names_to_wrap=["LlamaDecoderLayer"])
        accelerator = Accelerator(mixed_precision="fp8", fsdp_plugin=plugin, kwargs_handlers=[FP8RecipeKwargs(
            skip_slow_shapes=False, skip_first_last=False, **knobs)])
        torch.manual_seed(0)
        model = build_model(PRESETS["tiny"])
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, optimizer = accelerator.prepare(model, optimizer)
        inner = accelerator.unwrap_model(model)
        converted_by = getattr(inner, BACKEND_ATTR)
        fp8 = [m for m in inner.modules() if converted_by.converted_kind(m) == "linear"]
        stepped = {id(p) for g in optimizer.param_groups for p in g["params"]}
        record = {
            "engine": accelerator.precision_plan.engine, "model": type(model).__name__,
            "optimizer": type(optimizer.optimizer).__name__, "fp8_linears": len(fp8),
            # every FP8 weight in a group the optimizer steps and zeroes (the te bug: none of them)
            "fp8_weights_in_optimizer": sum(id(m.weight) in stepped for m in fp8),
            "params_in_optimizer": sum(id(p) in stepped for p in model.parameters()),
            "params": sum(1 for _ in model.parameters()),
        }
        if knobs.get("fp8_weights"):  # the stand-in's FusedAdam has no step (TE's is a CUDA kernel)
            record["optimizer_is_te"] = isinstance(optimizer.optimizer, FusedAdam)
            return record
        before = [weight_sample(m.weight) for m in fp8]
        ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(dist.get_rank()))
        losses = []
        for _ in range(STEPS):
            loss = model(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        record.update(
            losses=losses,
            fp8_weights_moved=sum(not torch.equal(a, weight_sample(m.weight)) for a, m in zip(before, fp8)),
            grads_after_zero_grad=sum(p.grad is not None for p in model.parameters()),
        )
        return record
    finally:
        patch.undo()


def main(argv: list[str]) -> None:
    names, out_path = argv[1].split(","), argv[2]
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    results = {}
    for name in names:
        try:
            results[name] = scenario(SCENARIOS[name])
        except Exception as exc:  # noqa: BLE001 - recorded for the pytest side
            results[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
        dist.barrier()
    write_ranks(results, out_path)
    end_ranks()


if __name__ == "__main__":
    main(sys.argv)
