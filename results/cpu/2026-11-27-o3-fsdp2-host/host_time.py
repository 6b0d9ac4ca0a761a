"""Host time per phase of one training step, msamp O3 vs BF16 under FSDP2, on 2 CPU ranks (gloo).

Derived from count_ops.py beside it (same Accelerate patch and narrow proxy).
torchrun --nproc_per_node 2 results/cpu/2026-11-27-o3-fsdp2-host/host_time.py --backend msamp|bf16 [--compile-layers true|false] --out X
--modules adds each module's inclusive host time in the forward (`module_incl_ms`, its FSDP2 hooks included, per
step) and calls (`module_calls`): forward hooks on every module, which add their own cost.
"""
import argparse, cProfile, json, os, statistics, sys, time
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))  # the repository


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="msamp")
    p.add_argument("--compile-layers", default=None, choices=[None, "true", "false"])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--adam", default="gpu-stub", choices=["gpu-stub", "cpu-ref"],
                   help="gpu-stub: LowBitAdamW takes its fused (GPU) path, all its Python runs, only the 3 Triton "
                        "launches per bucket are no-ops (no update); cpu-ref: the per-parameter reference path")
    p.add_argument("--out", required=True)
    p.add_argument("--modules", action="store_true", help="time each module's forward (hooks on every module)")
    args = p.parse_args()
    torch.set_num_threads(1)
    from accelerate.utils import FullyShardedDataParallelPlugin, DistributedType
    from lowprec import Accelerator, FP8RecipeKwargs
    from lowprec.demo.model import ModelPreset, build_model

    h = args.hidden
    preset = ModelPreset(h, 4, 4, h * 7 // 2 // 16 * 16, 64, 2, 1e-3, "narrow proxy")
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
                                            reshard_after_forward=True)
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
    # as lowprec/demo/run.py on GPU: fused AdamW (BF16); msamp replaces it with LowBitAdamW
    optimizer = torch.optim.AdamW(model.parameters(), lr=preset.lr, weight_decay=0.1, betas=(0.9, 0.95),
                                  fused=True if args.backend == "bf16" else None)
    model, optimizer = accelerator.prepare(model, optimizer)
    inner = getattr(optimizer, "optimizer", optimizer)
    info = {"backend": args.backend, "optimizer": type(inner).__name__, "adam": args.adam, "hidden": h,
            "n_params": len([q for g in inner.param_groups for q in g["params"]])}
    if accelerator._lowprec:
        be = accelerator._lowprec[-1][1]
        info["layer_compile"] = be.layer_compile()
        info["fp8_layers"] = len(be.layers)
    if args.adam == "gpu-stub" and type(inner).__name__.startswith("LowBitAdam"):
        import lowprec.optim.low_bit_adam as lba
        import lowprec.kernels.adam as ka
        lba.LowBitAdamW._use_fused = lambda self, p, g, group: True

        class _NoLaunch:
            def __getitem__(self, grid):
                return lambda *a, **k: None
        ka._get_kernels = lambda: (_NoLaunch(),) * 4

    # time the post-step hook inside optimizer.step
    hook_t = []
    if accelerator._lowprec:
        hooks = list(inner._optimizer_step_post_hooks.items())
        for key, fn in hooks:
            def timed(*a, _fn=fn, **k):
                t = time.perf_counter(); r = _fn(*a, **k); hook_t.append(time.perf_counter() - t); return r
            inner._optimizer_step_post_hooks[key] = timed

    import collections
    incl = collections.defaultdict(float)
    ncall = collections.Counter()
    state = {"on": False}

    def pre(m, *a, **k):
        m._t0 = time.perf_counter()

    def post(m, *a, **k):
        if state["on"]:
            incl[m._lp_name] += time.perf_counter() - m._t0
            ncall[m._lp_name] += 1

    for nm, mod in model.named_modules() if args.modules else ():
        mod._lp_name = type(mod).__name__ + ":" + ".".join(p for p in nm.split(".") if not p.isdigit() or p == "1")
        mod.register_forward_pre_hook(pre, prepend=True)
        mod.register_forward_hook(post, always_call=True)
    g = torch.Generator().manual_seed(rank)
    phases = ["forward", "backward", "clip", "optimizer_step", "zero_grad"]
    times = {k: [] for k in phases + ["post_step_hook", "total"]}
    cpu = {k: [] for k in phases + ["total"]}
    prof = (cProfile.Profile(time.thread_time) if os.environ.get("PROF_CPU") else cProfile.Profile()) if rank == 0 else None
    total = args.warmup + args.steps + args.profile_steps
    for step in range(total):
        ids = torch.randint(0, 256, (preset.batch, preset.seq_len), generator=g)
        profiling = step >= args.warmup + args.steps
        measure = args.warmup <= step < args.warmup + args.steps
        dist.barrier()
        hook_t.clear()
        if profiling and prof:
            prof.enable()
        t = [time.perf_counter()]; c = [time.thread_time()]
        state["on"] = measure
        loss = model(input_ids=ids, labels=ids).loss
        state["on"] = False
        t.append(time.perf_counter()); c.append(time.thread_time())
        accelerator.backward(loss)
        t.append(time.perf_counter()); c.append(time.thread_time())
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        t.append(time.perf_counter()); c.append(time.thread_time())
        optimizer.step()
        t.append(time.perf_counter()); c.append(time.thread_time())
        optimizer.zero_grad(set_to_none=True)
        t.append(time.perf_counter()); c.append(time.thread_time())
        if profiling and prof:
            prof.disable()
        if measure:
            for i, k in enumerate(phases):
                times[k].append(t[i + 1] - t[i]); cpu[k].append(c[i + 1] - c[i])
            cpu["total"].append(c[-1] - c[0])
            times["post_step_hook"].append(sum(hook_t))
            times["total"].append(t[-1] - t[0])
        if rank == 0 and (step % 5 == 0 or step == total - 1):
            print("step", step, float(loss), f"{(t[-1]-t[0])*1e3:.1f} ms", flush=True)
    if rank == 0:
        med = {k: statistics.median(v) * 1e3 for k, v in times.items() if v}
        if args.modules:
            info["module_incl_ms"] = {k: round(v * 1e3 / args.steps, 3) for k, v in incl.items()}
            info["module_calls"] = {k: v // args.steps for k, v in ncall.items()}
        info["median_ms"] = med
        info["median_thread_cpu_ms"] = {k: statistics.median(v) * 1e3 for k, v in cpu.items() if v}
        info["all_ms"] = {k: [round(x * 1e3, 2) for x in v] for k, v in times.items()}
        print(json.dumps(info, indent=1))
        with open(args.out + ".json", "w") as fh:
            json.dump(info, fh, indent=1)
        prof.dump_stats(args.out + ".prof")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
