"""Count aten ops (and collectives) per phase of one training step, msamp O3 vs BF16 under FSDP2 on CPU.

torchrun --nproc_per_node 2 results/cpu/2026-11-27-o3-fsdp2-host/count_ops.py --backend msamp|bf16 [--compile-layers true|false] --out X.json
"""
import argparse, collections, json, os, sys, traceback, warnings, functools
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
import torch.utils._pytree as pytree

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))  # the repository
PLAIN = (torch.Tensor, torch.nn.Parameter)

STATE = {"phase": None}
COLL = []  # (phase, name, dtype, numel, where)


def where_lowprec(stack=None):
    stack = stack or traceback.extract_stack()
    for fr in reversed(stack):
        if "/lowprec/" in fr.filename and "/results/cpu/" not in fr.filename:
            return f"{fr.filename.split('/lowprec/')[-1]}:{fr.lineno} ({fr.name})"
    return None


def where_torch(stack):
    """innermost frame in torch/distributed (FSDP2), transformers or accelerate, for ops lowprec did not issue"""
    for fr in reversed(stack):
        f = fr.filename
        if "/_python_dispatch" in f or "/utils/_pytree" in f or "count_ops.py" in f:
            continue
        for key in ("torch/distributed/fsdp/", "torch/distributed/tensor/", "transformers/", "accelerate/",
                    "torch/optim/", "torch/nn/", "torch/autograd/", "torch/_tensor"):
            if key in f:
                return f"{key}{f.split(key)[-1]}:{fr.lineno} ({fr.name})"
    return "other"


def subphase(stack):
    names = {fr.name for fr in stack}
    if "after_step" in names:
        return "post_step_hook"
    return None


NOKERNEL = {"aten.detach.default", "aten.alias.default", "aten.empty.memory_format", "aten.empty_strided.default",
            "aten.empty_like.default", "aten.new_empty.default", "aten.new_empty_strided.default", "aten.lift_fresh.default",
            "profiler._record_function_enter_new.default", "profiler._record_function_exit._RecordFunction",
            "_c10d_functional._wrap_tensor_autograd.default", "_c10d_functional.wait_tensor.default",
            "aten._local_scalar_dense.default", "aten.set_.source_Storage", "aten.set_.source_Tensor", "aten.resize_.default",
            "aten.record_stream.default", "aten.is_same_size.default", "aten.sym_size.int", "aten.sym_numel.default",
            "aten.sym_stride.int", "aten.sym_storage_offset.default", "aten.is_pinned.default", "aten._has_compatible_shallow_copy_type.default"}
KEYS = ("torch/distributed/fsdp/", "torch/distributed/tensor/", "torch/distributed/", "transformers/", "accelerate/",
        "torch/optim/", "torch/nn/", "torch/autograd/", "torch/_tensor.py", "torch/_dynamo", "torch/_inductor", "torch/amp")


def innermost(stack):
    for fr in reversed(stack):
        f = fr.filename
        if ("/_python_dispatch" in f or "/utils/_pytree" in f or "count_ops.py" in f or "_dynamo/eval_frame" in f
                or "torch/_ops.py" in f or "torch/utils/_contextlib" in f or "torch/_compile.py" in f):
            continue
        if "/lowprec/" in f:
            return f"{f.split('/lowprec/')[-1]}:{fr.lineno} ({fr.name})"
        for key in KEYS:
            if key in f:
                return f"[torch] {key}{f.split(key)[-1]}:{fr.lineno} ({fr.name})"
    return "[torch] other"


class Counter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()  # (phase, op, where) -> n
        self.subclass_calls = collections.Counter()

    @classmethod
    def ignore_compile_internals(cls):
        return True  # compiled regions run compiled (and hide their ops) instead of falling back to eager

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(t not in PLAIN for t in types):
            # let the subclass (DTensor, FP8MasterWeight, FP8GatheredWeight) unwrap: its inner ops come back here
            self.subclass_calls[(STATE["phase"], str(func), ",".join(sorted(t.__name__ for t in types)))] += 1
            return NotImplemented
        if STATE["phase"] is not None:
            stack = traceback.extract_stack()
            phase = subphase(stack) or STATE["phase"]
            w = innermost(stack)
            site = next((f"{fr.filename.split('/lowprec/')[-1]}:{fr.lineno} ({fr.name})" for fr in reversed(stack)
                         if "/lowprec/" in fr.filename and "/lowprec/kernels/" not in fr.filename), None)
            if site and site.split(" ")[0] != w.split(" ")[0]:
                w = f"{w} <- {site}"
            kind = "nokernel" if (func.is_view or str(func) in NOKERNEL) else "k"
            self.ops[(phase, str(func), w, kind)] += 1
        return func(*args, **kwargs)


def patch_collectives():
    names = ["all_reduce", "all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor", "all_to_all_single",
             "all_gather", "broadcast", "reduce_scatter", "all_gather_object", "_reduce_scatter_base",
             "_all_gather_base"]
    for n in names:
        f = getattr(dist, n, None)
        if f is None:
            continue

        def make(f, n):
            @functools.wraps(f)
            def wrapper(*args, **kwargs):
                if STATE["phase"] is not None:
                    tensors = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
                    t = tensors[-1] if n.startswith(("all_gather", "_all_gather")) else (tensors[0] if tensors else None)
                    if n in ("reduce_scatter_tensor", "_reduce_scatter_base", "all_to_all_single"):
                        t = tensors[1] if len(tensors) > 1 else tensors[0]  # the input
                    stack = traceback.extract_stack()
                    COLL.append({"phase": subphase(stack) or STATE["phase"], "op": n,
                                 "dtype": str(t.dtype) if t is not None else None,
                                 "numel": t.numel() if t is not None else None,
                                 "op_kw": str(kwargs.get("op", args[1] if n == "all_reduce" and len(args) > 1 else "")),
                                 "where": innermost(stack)})
                return f(*args, **kwargs)
            return wrapper
        setattr(dist, n, make(f, n))


COMPILED = collections.Counter()
FUSED_ADAM = []


def patch_compiled():
    try:
        from torch._inductor.output_code import CompiledFxGraph
    except Exception:
        return
    orig = CompiledFxGraph.__call__

    def call(self, *a, **k):
        if STATE["phase"] is not None:
            stack = traceback.extract_stack()
            COMPILED[(subphase(stack) or STATE["phase"], innermost(stack))] += 1
        return orig(self, *a, **k)
    CompiledFxGraph.__call__ = call


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="msamp")
    p.add_argument("--compile-layers", default=None, choices=[None, "true", "false"])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--fused-cpu", action="store_true", help="add 'cpu' to FUSED_DEVICE_TYPES (cuda_fused compiles on CPU, as on GPU)")
    p.add_argument("--gpu-adam", action="store_true", help="LowBitAdamW takes its fused (GPU) path; the Triton "
                   "launches are stubbed and counted (3 kernels + 3 H2D table copies per bucket), no update")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.fused_cpu:
        import lowprec.kernels.fused as fused
        fused.FUSED_DEVICE_TYPES = ("cuda", "cpu")
    from accelerate.utils import FullyShardedDataParallelPlugin, DistributedType
    from accelerate.state import AcceleratorState, PartialState
    from lowprec import Accelerator, FP8RecipeKwargs
    from lowprec.demo.model import ModelPreset, build_model

    # the same structure as the d4096 proxy (4 layers, ffn 3.5x, MHA), narrow
    h = args.hidden
    preset = ModelPreset(h, 4, 4, h * 7 // 2 // 16 * 16, 64, 2, 1e-3, "narrow proxy")
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
                                            reshard_after_forward=True)
    # Accelerate builds FSDP only for GPU distributed types: make its CPU state an FSDP one (as on GPUs)
    import accelerate.state as st
    os.environ["ACCELERATE_USE_FSDP"] = "true"
    orig_init = st.AcceleratorState.__init__

    def init(self, *a, fsdp_plugin=None, **k):
        orig_init(self, *a, fsdp_plugin=fsdp_plugin, **k)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            if self._mixed_precision != "no":
                fsdp_plugin.set_mixed_precision(self._mixed_precision)
            self.fsdp_plugin = fsdp_plugin
    st.AcceleratorState.__init__ = init
    if args.backend == "bf16":
        accelerator = Accelerator(mixed_precision="bf16", fsdp_plugin=plugin, cpu=True)
    else:
        recipe = FP8RecipeKwargs(backend="msamp", opt_level="O3",
                                 compile_fp8_layers=None if args.compile_layers is None else args.compile_layers == "true")
        accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[recipe], fsdp_plugin=plugin, cpu=True)
    rank = accelerator.process_index
    torch.manual_seed(0)
    model = build_model(preset)
    optimizer = torch.optim.AdamW(model.parameters(), lr=preset.lr)
    model, optimizer = accelerator.prepare(model, optimizer)
    info = {"distributed_type": str(accelerator.distributed_type), "world": accelerator.num_processes,
            "model": type(model).__name__, "optimizer": type(getattr(optimizer, "optimizer", optimizer)).__name__,
            "mp_policy": str(plugin.mixed_precision_policy)}
    if accelerator._lowprec:
        be = accelerator._lowprec[-1][1]
        info["layer_compile"] = be.layer_compile()
        info["fp8_layers"] = len(be.layers)
        info["emulated"] = be.emulated
    if args.gpu_adam:
        import lowprec.optim.low_bit_adam as lba
        lba.LowBitAdamW._use_fused = lambda self, p, g, group: True
        def stub(items, group, *, decoupled):
            if STATE["phase"] is not None:
                scaled = items[0].state["exp_avg"].dtype in lba.SCALED or items[0].state["exp_avg_sq"].dtype in lba.SCALED
                FUSED_ADAM.append({"phase": STATE["phase"], "items": len(items), "param_dtype": str(items[0].param.dtype),
                                   "grad_dtype": str(items[0].grad.dtype), "triton_kernels": 3 if scaled else 1,
                                   "h2d_tables": 3})
        lba.fused_low_bit_adam_step = stub
    patch_collectives()
    patch_compiled()
    counter = Counter()
    g = torch.Generator().manual_seed(rank)
    total = args.steps + 1
    for step in range(total):
        ids = torch.randint(0, 256, (preset.batch, preset.seq_len), generator=g)
        measure = step == total - 1
        ctx = counter if measure else None
        if ctx: ctx.__enter__()
        try:
            STATE["phase"] = "forward" if measure else None
            loss = model(input_ids=ids, labels=ids).loss
            STATE["phase"] = "backward" if measure else None
            accelerator.backward(loss)
            STATE["phase"] = "clip" if measure else None
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            STATE["phase"] = "optimizer_step" if measure else None
            optimizer.step()
            STATE["phase"] = "zero_grad" if measure else None
            optimizer.zero_grad()
            STATE["phase"] = None
        finally:
            if ctx: ctx.__exit__(None, None, None)
        if rank == 0:
            print("step", step, float(loss), flush=True)
    if rank == 0:
        out = {"info": info,
               "ops": [[ph, op, w, k, n] for (ph, op, w, k), n in counter.ops.most_common()],
               "subclass_calls": [[ph, op, t, n] for (ph, op, t), n in counter.subclass_calls.most_common()],
               "collectives": COLL,
               "compiled_calls": [[ph, w, n] for (ph, w), n in COMPILED.most_common()], "fused_adam": FUSED_ADAM}
        with open(args.out, "w") as fh:
            json.dump(out, fh, indent=0)
    accelerator.wait_for_everyone()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
