"""Run under `torchrun --nproc_per_node 2` (gloo, CPU) by tests/backends/test_msamp_o3.py.

MS-AMP O3 under FSDP2, driven as Accelerate's FSDP2 plugin would (its FSDP path needs GPUs):
1. the FP8 all-gather: the gathered weight is the E4M3 cast of the whole FP16 master with one
   power-of-two scale from the amax over both ranks, also for a weight FSDP2 shards unevenly; a
   non-finite master keeps the last scale;
2. training a small model (FP32 norm, O3 FP8Linears) against O2 on one process over the same global
   batches, and against the FP32 model: loss curves, the optimizer's sharded FP8+FP16 states, the
   FP8 reduce-scatter in use, and the model-state bytes per parameter each rank holds;
3. checkpoints: the full state dict loads strict into the plain model; the sharded model and
   optimizer state dicts resume with the same losses;
4. the steps of Accelerate's FSDP2 preparation around lowprec's hooks, on a small Llama;
5. gradient accumulation over two micro-batches against one batch of both;
6. the weight scales set after each step with one all-reduce, so that gathers need none;
7. the FP8 health report's weight rows on the gathered weight;
8. (in 2.) the input and output-gradient amaxes all-reduced across ranks after each step (reduce_amax).
"""

import copy
import sys

import torch
import torch.distributed as dist
from teardown import end_ranks, write_ranks  # beside this script: torchrun puts its folder on sys.path
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from lowprec import FP8RecipeKwargs, RunContext, build_plan
from lowprec.backends import create_backend
from lowprec.backends.msamp.fsdp import FP8GatheredWeight, FP8MasterWeight
from lowprec.backends.msamp.fsdp_groups import fully_shard_fp8_layers
from lowprec.backends.msamp.linear import FP8Linear
from lowprec.demo.memory import model_state_bytes
from lowprec.kernels.scaling import compute_scale, quantize
from lowprec.planning.hardware import device_info

E4M3 = torch.float8_e4m3fn
STEPS = 12


def gather_numerics(mesh) -> dict:
    out = {}
    for rows in (48, 33):  # 33 rows: FSDP2 gives rank 0 17 and rank 1 16 (padded)
        torch.manual_seed(1)
        layer = FP8Linear(32, rows, bias=False, emulate=True, sharded_master=True)
        with torch.no_grad():
            layer.weight._tensor.copy_(torch.randn(rows, 32) * torch.logspace(-2, 0, rows)[:, None])
        full = layer.weight._tensor.clone()
        fully_shard(layer, mesh=mesh, reshard_after_forward=False)
        local = layer.weight._local_tensor
        layer(torch.randn(4, 32))
        gathered = layer.weight
        scale = compute_scale(full.float().abs().amax(), E4M3)
        out[str(rows)] = {
            "local_type": type(local).__name__, "local_rows": local.shape[0], "local_dtype": str(local.dtype),
            "gathered_type": type(gathered).__name__, "gathered_dtype": str(gathered._data.dtype),
            "scale": float(gathered._scale), "expected_scale": float(scale),
            "bytes_equal": bool(torch.equal(gathered._data.view(torch.uint8),
                                            quantize(full, scale, E4M3).view(torch.uint8))),
            "dequantised_rel_err": float((gathered.dequantize().float() - full.float()).norm() / full.float().norm()),
        }
        if rows == 48:
            # A NaN in one rank's master shard: the scale stays the last finite one.
            layer.reshard()
            with torch.no_grad():
                if dist.get_rank() == 1:
                    layer.weight._local_tensor._tensor[0, 0] = float("nan")
            layer(torch.randn(4, 32))
            out["nan"] = {"scale": float(layer.weight._scale), "previous": float(scale)}
    return out


def build(level: str, engine: str, mesh=None, compiled: bool = False, grad_comm: str | None = "fp8"):
    """(model, optimizer, post-step hook, backend): O3 sharded as Accelerate's plugin would, or O2 / FP32
    on one process; `compiled`: the FP8 layers compiled one by one (inductor) after sharding, as
    `prepare()` does on FP8 GPUs; `grad_comm`: the recipe's grad_comm_dtype (FP8: MS-AMP's reduce-scatter, what
    O3 does across hosts; None: O3's default on one host, the FSDP policy's reduce dtype)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 16))
    if level == "fp32":
        return model, torch.optim.AdamW(model.parameters(), lr=3e-3), (lambda: None), None
    recipe = FP8RecipeKwargs(backend="msamp", opt_level=level, skip_slow_shapes=False, skip_first_last=False,
                             compile_fp8_layers=compiled or None, grad_comm_dtype=grad_comm if mesh else None)
    context = RunContext(device=device_info("cpu"), engine=engine, world_size=dist.get_world_size() if mesh else 1)
    backend = create_backend(recipe, context)
    plan = build_plan(model, recipe, context=context, backend=backend)
    model = backend.convert(model, plan)
    optimizer = backend.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=3e-3), plan)
    if mesh is not None:
        policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)  # what Accelerate's plugin carries
        before = {id(p): (m, n) for m in model.modules() for n, p in m.named_parameters(recurse=False)}
        fully_shard_fp8_layers(model, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        for group in optimizer.param_groups:
            group["params"] = [getattr(*before[id(p)]) for p in group["params"]]
        backend.setup_grad_comm(model)
    backend.compile_layers(model)
    return model, optimizer, backend.post_optimizer_step(model), backend


def batch(step: int, rank: int | None):
    """Rank `rank`'s half of step `step`'s global batch, or the whole batch (rank None)."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(32, 32, generator=g)
    y = torch.tanh(x[:, :16] * 2)
    return (x, y) if rank is None else (x[16 * rank:16 * (rank + 1)], y[16 * rank:16 * (rank + 1)])


def steps(model, optimizer, hook, span, rank) -> list[float]:
    losses = []
    for step in span:
        x, y = batch(step, rank)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        hook()
        total = loss.detach().clone()
        if rank is not None:  # the global batch's loss: the mean of the ranks' halves
            dist.all_reduce(total)
            total /= dist.get_world_size()
        losses.append(float(total))
    return losses


def train(mesh) -> dict:
    rank = dist.get_rank()
    model, optimizer, hook, backend = build("O3", "fsdp2", mesh)
    o3 = steps(model, optimizer, hook, range(STEPS), rank)
    x, y = batch(STEPS, rank)
    nn.functional.mse_loss(model(x), y).backward()  # the bytes held between backward and step: gradients too
    state = model_state_bytes(model, optimizer, backend)
    grad_types = sorted({f"{type(p.grad).__name__} {p.grad.dtype}" for p in model.parameters()})
    optimizer.zero_grad()
    types = sorted({f"{type(v).__name__} {v.dtype}" for s in optimizer.state.values() for k, v in s.items()
                    if k in ("exp_avg", "exp_avg_sq")})
    locals_ = sorted({type(getattr(p, "_local_tensor", p)).__name__ for p in model.parameters()})
    record = {"o3": o3, "state_bytes": state, "grad_types": grad_types, "state_types": types, "param_locals": locals_,
              "comm": type(backend.comm_state).__name__, "comm_calls": backend.comm_state.calls,
              "optimizer": type(optimizer).__name__,
              "param_sums": [float(p.full_tensor().float().sum()) for p in model.parameters()],
              # the input and output-gradient delayed scales and the amax windows (the step in progress
              # left out) they come from: all-reduced across ranks after every step (reduce_amax's default)
              "delayed_scales": [[float(s) for s in layer.scales[:2]] for layer in backend.layers],
              "amax_windows": [layer.amax_history[:, 1:].tolist() for layer in backend.layers],
              "reduce_amax": backend.reduce_amax, "amax_reduction": backend.amax_reduction}
    # activation_dtype='fp8' (issue 32) on the O3 model under FSDP2: norm and GELU inputs packed, the
    # all-gathered weights (FP8 subclasses) and the FP32 norm's unsharded weight left alone
    from lowprec.runtime.activations import install_activation_storage

    fp8_act, a_opt, a_hook, _ = build("O3", "fsdp2", mesh)
    storage = install_activation_storage(fp8_act, fp8_act)
    storage.min_elements = 0  # the toy model's activations are below the default threshold
    record["fp8_activations"] = {"losses": steps(fp8_act, a_opt, a_hook, range(STEPS), rank),
                                 "packed": storage.counts.packed,
                                 "kept": storage.counts.parameters_kept + storage.counts.others_kept}
    torch._dynamo.reset()
    compiled, c_opt, c_hook, c_backend = build("O3", "fsdp2", mesh, compiled=True)
    record["compiled"] = {"losses": steps(compiled, c_opt, c_hook, range(STEPS), rank),
                          "layers": sum(getattr(m, "_compiled_call_impl", None) is not None for m in c_backend.layers),
                          "gathered": type(c_backend.layers[0].weight).__name__}
    # O3's default on one host: the gradients reduce-scattered by FSDP2 itself, in the policy's reduce dtype
    default, d_opt, d_hook, d_backend = build("O3", "fsdp2", mesh, grad_comm=None)
    record["default_comm"] = {"losses": steps(default, d_opt, d_hook, range(STEPS), rank),
                              "comm": type(d_backend.comm_state).__name__}
    reference, ref_opt, ref_hook, _ = build("O2", "single")
    record["o2_single"] = steps(reference, ref_opt, ref_hook, range(STEPS), None)
    fp32, fp32_opt, fp32_hook, _ = build("fp32", "single")
    record["fp32_single"] = steps(fp32, fp32_opt, fp32_hook, range(STEPS), None)
    return record


def precomputed_scales(mesh) -> dict:
    """After a step the post-step hook sets every weight's gather scale with one all-reduce: the next
    gathers make none of their own, and use the scale a gather would have computed."""
    from lowprec.backends.msamp.fsdp import precompute_weight_scales

    rank = dist.get_rank()
    model, optimizer, hook, backend = build("O3", "fsdp2", mesh)
    steps(model, optimizer, hook, range(2), rank)
    masters = [layer.weight._local_tensor for layer in backend.layers]
    flags_after_step = [m._precomputed for m in masters]
    scales = [float(m._scale) for m in masters]
    expected = [float(compute_scale(layer.weight.full_tensor().float().abs().amax(), E4M3)) for layer in backend.layers]
    calls = []
    original = dist.all_reduce

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    dist.all_reduce = counting
    try:
        x, y = batch(99, rank)
        with torch.no_grad():
            model(x)  # gathers every layer
        gathers_with_precomputed = len(calls)
        with torch.no_grad():
            backend.layers[0].weight.mul_(1.0)  # any change to a master drops its precomputed scale
        dropped = not backend.layers[0].weight._local_tensor._precomputed
        calls.clear()
        with torch.no_grad():
            model(x)
        gathers_after_change = len(calls)
        calls.clear()
        precompute_weight_scales([layer.weight for layer in backend.layers])
        precompute_calls = len(calls)
    finally:
        dist.all_reduce = original
    return {"flags_after_step": flags_after_step, "scales": scales, "expected": expected,
            "gather_all_reduces": gathers_with_precomputed, "dropped_on_change": dropped,
            "gather_all_reduces_after_change": gathers_after_change, "precompute_all_reduces": precompute_calls}


def health(mesh) -> dict:
    """The FP8 health report on an O3 model: the weight rows are of the gathered FP8 weight, the same on
    every rank, with the amax of the whole weight."""
    from lowprec.runtime.health import FP8HealthMonitor

    rank = dist.get_rank()
    model, optimizer, hook, backend = build("O3", "fsdp2", mesh)
    monitor = FP8HealthMonitor(model, backend, every=1)
    x, y = batch(0, rank)
    nn.functional.mse_loss(model(x), y).backward()
    monitor.after_backward(True)
    rows = {(r.layer, r.tensor): r for r in monitor.latest}
    weights = {str(i): float(model[i].weight.full_tensor().float().abs().amax()) for i in (0, 2, 4)}
    return {"tensors": sorted({t for _, t in rows}), "layers": sorted({name for name, _ in rows}),
            "weight_amax": {name: rows[name, "weight"].amax for name, _ in rows},
            "master_amax": weights}


def accumulation(mesh) -> dict:
    """Two micro-batches per step (FSDP2 holds the first's gradients unreduced, as Accelerate's
    accumulate() makes it) against one batch of both: the same steps up to rounding."""
    rank = dist.get_rank()
    out = {}
    for micro in (1, 2):
        model, optimizer, hook, _ = build("O3", "fsdp2", mesh)
        losses = []
        for step in range(6):
            x, y = batch(step, rank)
            total = 0.0
            for i, (xs, ys) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
                model.set_requires_gradient_sync(i == micro - 1)
                loss = nn.functional.mse_loss(model(xs), ys) / micro
                loss.backward()
                total += float(loss)
            optimizer.step()
            optimizer.zero_grad()
            hook()
            losses.append(total)
        out[str(micro)] = losses
    return out


def checkpoint(mesh) -> dict:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    rank = dist.get_rank()
    model, optimizer, hook, backend = build("O3", "fsdp2", mesh)
    steps(model, optimizer, hook, range(5), rank)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    sharded = StateDictOptions()
    model_state = copy.deepcopy(get_model_state_dict(model, options=sharded))
    optim_state = copy.deepcopy(get_optimizer_state_dict(model, optimizer, options=sharded))
    record = {"continued": steps(model, optimizer, hook, range(5, 8), rank)}
    if rank == 0:
        portable = backend.portable_state_dict(full)
        plain, _, _, _ = build("fp32", "single")
        plain.load_state_dict(portable, strict=True)
        record["full_types"] = sorted({f"{type(v).__name__} {v.dtype}" for v in full.values()})
        record["portable_types"] = sorted({f"{type(v).__name__} {v.dtype}" for v in portable.values()})
        record["plain_matches"] = all(torch.equal(plain.state_dict()[k], v.float()) for k, v in portable.items())
    model2, optimizer2, hook2, _ = build("O3", "fsdp2", mesh)
    set_model_state_dict(model2, model_state, options=sharded)
    set_optimizer_state_dict(model2, optimizer2, optim_state, options=sharded)
    record["resumed"] = steps(model2, optimizer2, hook2, range(5, 8), rank)
    record["master_type_after_load"] = type(model2[0].weight._local_tensor).__name__
    return record


def through_accelerate_fsdp2(compiled: bool = False) -> dict:
    """The steps Accelerate's FSDP2 path takes, around lowprec's hooks: `before_engine_prepare` shards the
    O3 layers with the plugin's settings and freezes them, Accelerate's own `fsdp2_prepare_model` (its
    mixed-precision upcast included) shards the decoder layers and the root, `setup_grad_comm`
    thaws the layers, and training runs. (Accelerate itself builds FSDP only on GPUs.) `compiled`: the model
    compiled block by block in between, as Accelerate's `_prepare_fsdp2` does under a regional dynamo plugin
    (`compile_regions_fsdp2`), with a dynamo backend that records each graph it is given and runs it as traced."""
    from types import SimpleNamespace

    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import (
        fsdp2_canonicalize_names,
        fsdp2_prepare_model,
        fsdp2_switch_optimizer_parameters,
    )
    from torch.distributed.tensor import DTensor
    from transformers import LlamaConfig, LlamaForCausalLM

    rank = dist.get_rank()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    model = LlamaForCausalLM(config)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=["LlamaDecoderLayer"])
    accelerator = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin), mixed_precision="bf16",
                                  is_main_process=rank == 0, torch_device_mesh=None, parallelism_config=None)
    recipe = FP8RecipeKwargs(backend="msamp", opt_level="O3", skip_first_last=False)
    context = RunContext(device=device_info("cpu"), engine="fsdp2", world_size=dist.get_world_size(),
                         compiled=compiled)
    backend = create_backend(recipe, context)
    plan = build_plan(model, recipe, context=context, backend=backend)
    model = backend.convert(model, plan)
    optimizer = backend.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=3e-3), plan)
    backend.before_engine_prepare([model, optimizer], accelerator)
    graphs = []
    if compiled:
        from accelerate.utils.other import compile_regions_fsdp2

        def recording(gm, example_inputs):  # the graphs dynamo hands a backend; run as traced
            graphs.append(str(gm.graph))
            return gm.forward

        torch._dynamo.reset()
        compile_regions_fsdp2(model, backend=recording)
    frozen = sum(not p.requires_grad for p in model.parameters())
    # Accelerate's _prepare_fsdp2 around fsdp2_prepare_model: the optimizer's parameters are keyed by
    # data_ptr() (of a DTensor's local tensor) before wrapping and swapped for the wrapped ones by name.
    def pointer(p):
        return p._local_tensor.data_ptr() if isinstance(p, DTensor) else p.data_ptr()

    old = fsdp2_canonicalize_names({n: pointer(p) for n, p in model.named_parameters()})
    for group in optimizer.param_groups:
        for i, p in enumerate(group["params"]):
            group["params"][i] = torch.empty(1)
            group["params"][i].data_ptr = pointer(p)
    model = fsdp2_prepare_model(accelerator, model)
    backend.after_engine_prepare()  # as lowprec's Accelerator.prepare does once Accelerate's returns
    new = fsdp2_canonicalize_names(dict(model.named_parameters()))
    fsdp2_switch_optimizer_parameters(optimizer, {old[n]: new[n] for n in old})
    backend.setup_communication(model, plan)
    backend.setup_grad_comm(model)
    hook = backend.post_optimizer_step(model)
    losses = []
    for step in range(8):
        g = torch.Generator().manual_seed(step * 10 + rank)
        ids = torch.randint(0, 64, (4, 32), generator=g)  # a small vocabulary: learnable in 8 steps
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        hook()
        losses.append(float(loss))
    layers = backend.layers
    in_optimizer = [id(p) for group in optimizer.param_groups for p in group["params"]]
    # the FSDP2 group each converted layer is in (one per decoder layer, the lm_head alone)
    groups = {}
    for m in layers:
        groups.setdefault(id(m._get_fsdp_state()._fsdp_param_group), []).append(m)
    from torch.distributed.fsdp import FSDPModule

    return {
        "blocks_sharded": [isinstance(block, FSDPModule) for block in model.model.layers],
        "norms_sharded": all(isinstance(p, DTensor) for n, p in model.named_parameters() if "norm" in n),
        "wrap_after": plugin.transformer_cls_names_to_wrap,
        "fp8_groups": sorted(len(g) for g in groups.values()),
        "frozen_while_preparing": frozen, "fp8_layers": len(layers),
        "trainable_after": all(p.requires_grad for p in model.parameters()),
        "master_locals": sorted({f"{type(m.weight._local_tensor).__name__} {m.weight.dtype}" for m in layers}),
        "other_dtypes": sorted({str(p.dtype) for n, p in model.named_parameters() if "norm" in n}),
        "optimizer_holds_the_sharded_params": sorted(in_optimizer) == sorted(id(p) for p in model.parameters()),
        "losses": losses,
        "layer_class": sorted({cls.__name__ for m in layers for cls in type(m).__mro__ if "FP8Linear" in cls.__name__}),
        "plan_notes": plan.notes,
        "graphs": len(graphs),
        "graphs_with_fp8_function": sum("autograd_function_apply" in g or "_FP8LinearFunction" in g for g in graphs),
        "graphs_with_norm": sum("rsqrt" in g for g in graphs),
    }


def main(out_path: str) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    result = {"gather": gather_numerics(mesh), "train": train(mesh), "checkpoint": checkpoint(mesh),
              "accelerate": through_accelerate_fsdp2(),
              "accelerate_compiled": through_accelerate_fsdp2(compiled=True), "accumulation": accumulation(mesh),
              "precomputed": precomputed_scales(mesh), "health": health(mesh),
              "master_class": FP8MasterWeight.__name__, "gathered_class": FP8GatheredWeight.__name__}
    write_ranks(result, out_path)
    end_ranks()


if __name__ == "__main__":
    main(sys.argv[1])
