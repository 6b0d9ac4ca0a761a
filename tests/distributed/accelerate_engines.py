"""Run under `torchrun --nproc_per_node 2` (gloo, CPU) by tests/test_accelerate_engines.py.

The whole `lowprec.Accelerator` under Accelerate's own preparation for DDP and for FSDP2
(`Accelerator._prepare_fsdp2`: the optimizer wrapped as `AcceleratedOptimizer`, whose device placement loads the
optimizer's state dict back, the data_ptr remap, `fsdp2_prepare_model`), with its `save_state` / `load_state`,
where the other CPU scripts call those steps one by one. Accelerate turns FSDP on only for GPU process groups, so
for FSDP2 this script tells it the gloo group is one (PartialState's `distributed_type`, before the Accelerator is
made); every tensor stays on the CPU. By hand, TE's `fp8_weights` went back into optimizer group dicts Accelerate
had replaced, and no TE Linear trained under FSDP2 until 2026-11-29; this is the run that sees such a thing on a
CPU.

    python -m torch.distributed.run --nproc_per_node 2 tests/distributed/accelerate_engines.py SCENARIOS OUT.json

With ACCELERATE_ENGINES_ON_GPU=1 (tests/gpu/test_te_gpu.py, a world of one) the same scenarios run on the GPU with
the real TransformerEngine and NCCL, as Accelerate sets them up there.
"""

import gc
import os
import sys
import tempfile
import traceback
import warnings
import weakref

import torch
import torch.distributed as dist
from gpu_engines import weight_sample  # beside this script: torchrun puts its folder on sys.path
from teardown import end_ranks, write_ranks

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "backends"))

STEPS = 4
ON_GPU = os.environ.get("ACCELERATE_ENGINES_ON_GPU") == "1"
SCENARIOS = {
    # refuse_into: the checkpoint loaded under another configuration must be refused before anything loads
    "msamp_O3": dict(backend="msamp", opt_level="O3",
                     run=dict(refuse_into=dict(backend="torchao", recipe="tensorwise"))),
    "torchao": dict(backend="torchao", recipe="tensorwise",
                    run=dict(refuse_into=dict(backend="msamp", opt_level="O3"))),
    "te_fp8_weights": dict(backend="te", recipe="current", fp8_weights=True),
    "msamp_O3_act8": dict(backend="msamp", opt_level="O3", activation_dtype="fp8"),
    "msamp_O3_fp8_comm": dict(backend="msamp", opt_level="O3", grad_comm_dtype="fp8"),
    "torchao_bf16_states": dict(backend="torchao", recipe="tensorwise", optimizer_states="bf16", run=dict(
        refuse_into=dict(backend="torchao", recipe="tensorwise", optimizer_states="fp8"))),
    "te": dict(backend="te", recipe="current"),
    "te_delayed": dict(backend="te", recipe="delayed"),
    # the loop's other parts: micro-batches under accelerator.accumulate, clipping, an LR scheduler; the plugin's
    # activation checkpointing and full state dicts
    "msamp_O3_accumulate": dict(backend="msamp", opt_level="O3", run=dict(accumulate=2, clip=1.0, scheduler=True)),
    "msamp_O3_ac": dict(backend="msamp", opt_level="O3", run=dict(plugin=dict(activation_checkpointing=True))),
    # msamp O3 with full state dicts on the GPU only (tests/gpu/test_te_gpu.py): gathering its E4M3 moment shards
    # needs an FP8 all-gather, which gloo has not ("Invalid scalar type"), NCCL has (as bytes)
    "msamp_O3_full_state": dict(backend="msamp", opt_level="O3", run=dict(plugin=dict(
        state_dict_type="FULL_STATE_DICT"))),
    "torchao_accumulate": dict(backend="torchao", recipe="tensorwise", run=dict(accumulate=2, clip=1.0,
                                                                                 scheduler=True)),
    "te_full_state": dict(backend="te", recipe="current", run=dict(plugin=dict(state_dict_type="FULL_STATE_DICT"))),
    "te_fp8_weights_full_state": dict(backend="te", recipe="current", fp8_weights=True, run=dict(plugin=dict(
        state_dict_type="FULL_STATE_DICT"))),
    # a run saved without fp8_weights resumed with it (Adam's checkpoint into TE's FusedAdam: fused_adam_form)
    "te_full_state_into_fp8_weights": dict(backend="te", recipe="current", run=dict(
        plugin=dict(state_dict_type="FULL_STATE_DICT"), convert_into=dict(
            backend="te", recipe="current", fp8_weights=True,
            run=dict(plugin=dict(state_dict_type="FULL_STATE_DICT"))))),
    # and the other way: TE's FusedAdam checkpoint (a step per group, FP32 masters) into torch's AdamW
    "te_fp8_weights_full_state_out": dict(backend="te", recipe="current", fp8_weights=True, run=dict(
        plugin=dict(state_dict_type="FULL_STATE_DICT"), convert_into=dict(
            backend="te", recipe="current", run=dict(plugin=dict(state_dict_type="FULL_STATE_DICT"))))),
    "te_fp8_weights_full_state_out_bf16_states": dict(backend="te", recipe="current", fp8_weights=True, run=dict(
        plugin=dict(state_dict_type="FULL_STATE_DICT"), convert_into=dict(
            backend="te", recipe="current", optimizer_states="bf16",
            run=dict(plugin=dict(state_dict_type="FULL_STATE_DICT"))))),
    "torchao_full_state_bf16_states": dict(
        backend="torchao", recipe="tensorwise", optimizer_states="bf16", run=dict(
            plugin=dict(state_dict_type="FULL_STATE_DICT"), convert_into=dict(
                backend="torchao", recipe="tensorwise", run=dict(plugin=dict(state_dict_type="FULL_STATE_DICT"))))),
    "msamp_O3_act8_ac": dict(backend="msamp", opt_level="O3", activation_dtype="fp8",
                             run=dict(plugin=dict(activation_checkpointing=True))),
    "torchao_act8_ac": dict(backend="torchao", recipe="tensorwise", activation_dtype="fp8",
                            run=dict(plugin=dict(activation_checkpointing=True))),
    # FP8 activations with the model compiled block by block under FSDP2: through the Python hooks (an engine's
    # default) and encoded inside the compiled graphs (LOWPREC_FP8_ACTIVATIONS_IN_GRAPH=1, multi.sh's 'ingraph')
    "torchao_act8_compiled": dict(backend="torchao", recipe="tensorwise", activation_dtype="fp8",
                                  run=dict(compile=True)),
    "torchao_act8_compiled_in_graph": dict(backend="torchao", recipe="tensorwise", activation_dtype="fp8",
                                           run=dict(compile=True, environ={"LOWPREC_FP8_ACTIVATIONS_IN_GRAPH": "1"})),
    # DDP (the gloo group as it is)
    "ddp_msamp_O1": dict(backend="msamp", opt_level="O1", run=dict(engine="ddp")),
    "ddp_msamp_O2": dict(backend="msamp", opt_level="O2", run=dict(engine="ddp", accumulate=2, clip=1.0,
                                                                     scheduler=True)),
    "ddp_msamp_O2_fp8_comm": dict(backend="msamp", opt_level="O2", grad_comm_dtype="fp8", run=dict(engine="ddp")),
    "ddp_torchao": dict(backend="torchao", recipe="tensorwise", run=dict(engine="ddp")),
    "ddp_torchao_O2": dict(backend="torchao", recipe="tensorwise", opt_level="O2", run=dict(engine="ddp")),
    "ddp_te": dict(backend="te", recipe="current", run=dict(engine="ddp", accumulate=2, clip=1.0, scheduler=True)),
    "ddp_te_fp8_weights": dict(backend="te", recipe="current", fp8_weights=True, run=dict(engine="ddp")),
    "ddp_te_into_fp8_weights": dict(backend="te", recipe="current", run=dict(engine="ddp", convert_into=dict(
        backend="te", recipe="current", fp8_weights=True, run=dict(engine="ddp")))),
    "ddp_te_fp8_weights_out": dict(backend="te", recipe="current", fp8_weights=True, run=dict(
        engine="ddp", convert_into=dict(backend="te", recipe="current", run=dict(engine="ddp")))),
    "ddp_torchao_act8": dict(backend="torchao", recipe="tensorwise", activation_dtype="fp8", run=dict(engine="ddp")),
    "ddp_msamp_O2_act8": dict(backend="msamp", opt_level="O2", activation_dtype="fp8", run=dict(engine="ddp")),
}


ENGINE_SWITCHES = ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_MEGATRON_LM")
_LAUNCHED_AS: dict = {}  # PartialState's distributed_type as the launcher made it, before any Accelerator


def prepared(knobs: dict):
    """A fresh Accelerator (FSDP2 through Accelerate's plugin, or DDP where the scenario's `run` says), the tiny
    Llama and AdamW (and an LR scheduler where `run` asks) prepared by it."""
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    from lowprec import Accelerator, FP8RecipeKwargs
    from lowprec.demo.model import PRESETS, build_model

    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    launched = PartialState(cpu=not ON_GPU)
    _LAUNCHED_AS.setdefault("distributed_type", launched.distributed_type)
    # Accelerate writes the engine it chose (FSDP) back into PartialState's shared state, and an AcceleratorState
    # made over that skips the branch that keeps its fsdp_plugin (is_fsdp2 then raises AttributeError): each
    # Accelerator here starts from what the launcher made, as a process's first one does
    PartialState._shared_state["distributed_type"] = _LAUNCHED_AS["distributed_type"]
    # and an Accelerator given an engine's plugin sets ACCELERATE_USE_<ENGINE>=true for the process, from which a
    # later one without a plugin makes a default one (on the GPU a DDP scenario after FSDP2 ones ran FSDP1: one H200,
    # 18a4450); the CPU keeps MULTI_CPU, which no plugin changes
    launched_env = _LAUNCHED_AS.setdefault("environ", {k: os.environ.get(k) for k in ENGINE_SWITCHES})
    for key, value in launched_env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    knobs = dict(knobs)
    run = knobs.pop("run", {})
    engine = {}
    if run.get("engine", "fsdp2") == "fsdp2":
        if not ON_GPU:  # Accelerate makes FSDP a GPU engine: the gloo group is named a GPU one, on the CPU
            PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU
        engine["fsdp_plugin"] = FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["LlamaDecoderLayer"], **run.get("plugin", {}))
    elif not ON_GPU:
        PartialState._shared_state["distributed_type"] = DistributedType.MULTI_CPU
    if run.get("compile"):  # the model compiled block by block through Accelerate, as torchtitan runs FP8 under FSDP2
        from accelerate.utils import TorchDynamoPlugin

        engine["dynamo_plugin"] = TorchDynamoPlugin(backend="inductor", use_regional_compilation=True)
    accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[FP8RecipeKwargs(
        skip_slow_shapes=False, skip_first_last=False, **knobs)], gradient_accumulation_steps=run.get("accumulate", 1),
        **engine)
    torch.manual_seed(0)
    model = build_model(PRESETS["tiny"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    objects = [model, optimizer]
    if run.get("scheduler"):
        objects.append(torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step)))
    prepared_objects = accelerator.prepare(*objects)
    if knobs.get("activation_dtype") == "fp8":
        from lowprec.runtime.activations import activation_storage

        activation_storage(prepared_objects[0]).min_elements = 0  # the tiny model's tensors are below the default
    accelerator.loop = dict(run, scheduler=prepared_objects[2] if run.get("scheduler") else None)
    return accelerator, prepared_objects[0], prepared_objects[1]


def train(accelerator, model, optimizer, steps: int) -> list[float]:
    loop = accelerator.loop
    micro = loop.get("accumulate", 1)
    ids = torch.randint(0, 256, (2 * micro, 64), generator=torch.Generator().manual_seed(dist.get_rank()))
    ids = ids.to(accelerator.device)
    losses = []
    for _ in range(steps):
        for chunk in ids.chunk(micro):
            with accelerator.accumulate(model):
                loss = model(input_ids=chunk, labels=chunk).loss
                accelerator.backward(loss)
                if loop.get("clip") and accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), loop["clip"])
                optimizer.step()
                if loop["scheduler"] is not None:
                    loop["scheduler"].step()
                optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def scenario(knobs: dict) -> dict:
    """The scenario's record, with `outlived`: what of its model and optimizer was still alive once the run was
    over and collected (parameter hooks in autograd's C++ nodes that held them kept whole models allocated)."""
    refs: list[weakref.ref] = []
    record = _scenario(knobs, refs)
    gc.collect()
    record["outlived"] = sorted(type(r()).__name__ for r in refs if r() is not None)
    return record


def _scenario(knobs: dict, refs: list) -> dict:
    import pytest

    from lowprec.runtime.export import BACKEND_ATTR

    patch = pytest.MonkeyPatch()
    for key, value in knobs.get("run", {}).get("environ", {}).items():
        patch.setenv(key, value)
    fake = knobs["backend"] == "te" and not ON_GPU
    if fake:
        import fake_te

        from lowprec.backends.te import TEBackend
        from lowprec.planning.hardware import DeviceInfo

        fake_te.install(patch)
        patch.setattr(TEBackend, "fp8_weight_device", staticmethod(lambda: torch.device("cpu")))
        patch.setattr("lowprec.runtime.run_context.device_info", lambda *_a, **_k: DeviceInfo("cuda", "H100", (9, 0)))
    try:
        accelerator, model, optimizer = prepared(knobs)
        refs += [weakref.ref(p) for p in model.parameters()] + [weakref.ref(optimizer.optimizer)]
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
        if knobs.get("fp8_weights"):
            record["optimizer_is_te"] = type(optimizer.optimizer).__name__ == "FusedAdam" and (
                not fake or isinstance(optimizer.optimizer, fake_te.FusedAdam))
        if knobs.get("fp8_weights") and fake:  # the stand-in's FusedAdam has no step (TE's is a CUDA kernel)
            record.update(checkpoint_before_a_step(knobs, accelerator, model, optimizer))
            return record
        before = [weight_sample(m.weight) for m in fp8]
        record["losses"] = train(accelerator, model, optimizer, STEPS)
        if knobs.get("activation_dtype") == "fp8":
            from lowprec.runtime.activations import activation_storage

            counts = activation_storage(model).counts
            record.update(packed_elements=counts.packed_elements, traced_packed=counts.traced_packed)
        record.update(
            fp8_weights_moved=sum(not torch.equal(a, weight_sample(m.weight)) for a, m in zip(before, fp8)),
            grads_after_zero_grad=sum(p.grad is not None for p in model.parameters()),
        )
        record.update(checkpoint_round(knobs, accelerator, model, optimizer))
        return record
    finally:
        patch.undo()


def checkpoint_round(knobs: dict, accelerator, model, optimizer) -> dict:
    """save_state mid-run, two more steps; a new Accelerator's load_state, the same two steps: their losses and
    weights; and `get_state_dict` (what save_model writes) loaded into the plain model with strict=True."""
    from lowprec.demo.model import PRESETS, build_model

    record = {}
    with tempfile.TemporaryDirectory() as shared:
        path = [shared]
        dist.broadcast_object_list(path, src=0)  # one folder for both ranks (the same host)
        checkpoint = os.path.join(path[0], "ckpt")
        accelerator.save_state(checkpoint)
        saved_weights = [weight_sample(p).sum().item() for p in model.parameters()]
        record["continued"] = train(accelerator, model, optimizer, 1)
        after_one = [weight_sample(p).sum().item() for p in model.parameters()]
        record["continued"] += train(accelerator, model, optimizer, 1)
        record["continued_weights"] = [weight_sample(p).sum().item() for p in model.parameters()]
        state_dict = accelerator.get_state_dict(model)  # a collective under FSDP2: every rank calls it
        if dist.get_rank() == 0:
            plain = build_model(PRESETS["tiny"])
            plain.load_state_dict({k: v.float() for k, v in state_dict.items()}, strict=True)
            record["plain_loads"] = True
        dist.barrier()
        accelerator2, model2, optimizer2 = prepared(knobs)
        accelerator2.load_state(checkpoint)
        record["resumed"] = train(accelerator2, model2, optimizer2, 2)
        record["resumed_weights"] = [weight_sample(p).sum().item() for p in model2.parameters()]
        other = knobs.get("run", {}).get("refuse_into")
        if other is not None:
            accelerator3, model3, _ = prepared(other)
            before = [weight_sample(p).sum().item() for p in model3.parameters()]
            try:
                accelerator3.load_state(checkpoint)
                record["refused"] = None
            except ValueError as exc:
                record["refused"] = str(exc)
            record["untouched_by_the_refusal"] = before == [weight_sample(p).sum().item() for p in model3.parameters()]
        other = knobs.get("run", {}).get("convert_into")
        if other is not None:  # a full state dict loads through load_state_dict, where lowprec converts
            accelerator4, model4, optimizer4 = prepared(other)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                accelerator4.load_state(checkpoint)
            record["converted_warnings"] = [str(w.message) for w in caught if "lowprec" in str(w.message)]
            if other.get("fp8_weights") and not ON_GPU:  # TE's stand-in: no FusedAdam step, what the load made
                inner = optimizer4.optimizer
                record["converted_state_keys"] = sorted({k for state in inner.state.values() for k in state})
                record["converted_params_without_state"] = sum(not inner.state.get(p) for g in inner.param_groups
                                                               for p in g["params"] if p.requires_grad)
                record["converted_group_steps"] = [g.get("step") for g in inner.param_groups]
                # each master the loaded weight, not the fresh model's (what the load kept where it had no entry)
                record["converted_masters_off_weights"] = sum(
                    not torch.equal(getattr(m, "_local_tensor", m), getattr(p, "_local_tensor", p).detach().float())
                    for g in inner.param_groups for p in g["params"]
                    if (m := inner.state.get(p, {}).get("master_param")) is not None)
                record["converted_weights_as_saved"] = [weight_sample(p).sum().item()
                                                        for p in model4.parameters()] == saved_weights
                dist.barrier()
                return record
            train(accelerator4, model4, optimizer4, 1)
            # BF16 moments into FP32 ones exactly: the first step after the load is the continued run's but for the
            # two optimizers' own FP32 rounding
            converted = [weight_sample(p).sum().item() for p in model4.parameters()]
            record["converted_step_vs_continued"] = max(abs(a - b) / max(abs(a), 1e-6)
                                                        for a, b in zip(after_one, converted))
        dist.barrier()
    return record


def checkpoint_before_a_step(knobs: dict, accelerator, model, optimizer) -> dict:
    """save_state before any step and a new Accelerator's load_state of it (te fp8_weights on TE's stand-in, whose
    FusedAdam has no step): which parameters' optimizer state was saved, and whether the load restored it. FusedAdam
    holds its FP8 weights' seeded masters from prepare() on, and DCP's optimizer state dict made no state for the
    others: under FSDP2 the load failed ("Missing optimizer state for parameter 'model.embed_tokens.weight'", on the
    GPU after steps), until Backend.complete_optimizer_state."""
    import tempfile

    def masters(opt) -> list[float]:
        inner = opt.optimizer
        return [inner.state[p]["master_param"].sum().item() if inner.state.get(p) else None
                for g in inner.param_groups for p in g["params"]]

    record = {}
    with tempfile.TemporaryDirectory() as shared:
        path = [shared]
        dist.broadcast_object_list(path, src=0)
        checkpoint = os.path.join(path[0], "ckpt")
        for g, group in enumerate(optimizer.optimizer.param_groups):
            group["step"] = 3 + g  # FusedAdam's step count lives in its groups, as after three steps
        if knobs.get("run", {}).get("convert_into") is not None:
            accelerator._complete_optimizer_states()  # every parameter's master, then each set off its weight
            with torch.no_grad():
                for state in optimizer.optimizer.state.values():
                    if "master_param" in state:
                        state["master_param"].add_(0.25)
        accelerator.save_state(checkpoint)
        record["params_with_state"] = sum(bool(optimizer.optimizer.state.get(p))
                                          for g in optimizer.optimizer.param_groups for p in g["params"])
        record["saved_masters"] = masters(optimizer)
        record["saved_steps"] = [g["step"] for g in optimizer.optimizer.param_groups]
        accelerator2, model2, optimizer2 = prepared(knobs)
        accelerator2.load_state(checkpoint)
        record["loaded_masters"] = masters(optimizer2)
        record["loaded_steps"] = [g.get("step") for g in optimizer2.optimizer.param_groups]
        other = knobs.get("run", {}).get("convert_into")
        if other is not None:
            record.update(checkpoint_out_of_fused_adam(other, checkpoint, accelerator, optimizer))
        dist.barrier()
    return record


def checkpoint_out_of_fused_adam(other: dict, checkpoint: str, accelerator, optimizer) -> dict:
    """FusedAdam's checkpoint (`checkpoint`, saved by `optimizer` with steps 3, 4, ... in its groups) loaded into
    another configuration's torch AdamW: what each parameter's state, its step and its weight are after it, on this
    rank, against the saved masters (each set off its weight before the save, so that a weight from the model file
    differs from one written from its master)."""
    accelerator3, model3, optimizer3 = prepared(other)
    # a weight's saved master, by the parameter's name: this rank's shard of it, compared with the loaded weight's
    names = {id(p): n for n, p in accelerator.unwrap_model(accelerator._models[0]).named_parameters()}
    saved = {names[id(p)]: getattr(m, "_local_tensor", m).detach().clone()
             for g in optimizer.optimizer.param_groups for p in g["params"]
             if (m := optimizer.optimizer.state.get(p, {}).get("master_param")) is not None}
    steps = {names[id(p)]: g["step"] for g in optimizer.optimizer.param_groups for p in g["params"]}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accelerator3.load_state(checkpoint)
    inner = optimizer3.optimizer
    loaded = dict(accelerator3.unwrap_model(model3).named_parameters())
    states = {n: inner.state.get(p, {}) for n, p in loaded.items()}
    return {
        "out_masters": len(saved),
        "out_state_keys": sorted({k for state in states.values() for k in state}),
        "out_group_keys_with_step": sum("step" in g for g in inner.param_groups),
        "out_steps_as_saved": sum(float(states[n].get("step", -1)) == float(steps[n]) for n in steps),
        "out_params": len(steps),
        "out_weights_from_masters": sum(torch.equal(getattr(loaded[n], "_local_tensor", loaded[n]).detach().float(),
                                                    m.float()) for n, m in saved.items()),
        "out_warnings": [str(w.message) for w in caught if "lowprec" in str(w.message)],
    }


def main(argv: list[str]) -> None:
    names, out_path = argv[1].split(","), argv[2]
    if ON_GPU:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if ON_GPU else "gloo")
    torch.set_num_threads(1)
    results = {}
    for name in names:
        try:
            results[name] = scenario(SCENARIOS[name])
        except Exception as exc:  # noqa: BLE001 - recorded for the pytest side
            results[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
            print(traceback.format_exc(), file=sys.stderr, flush=True)
        dist.barrier()
    write_ranks(results, out_path)
    end_ranks()


if __name__ == "__main__":
    main(sys.argv)
