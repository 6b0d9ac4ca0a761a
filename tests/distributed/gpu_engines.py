"""Train a small Llama on 2 GPUs through lowprec.Accelerator and record whether FP8 was really active.

    accelerate launch --multi_gpu --num_processes 2 tests/distributed/gpu_engines.py \
        --backend te --recipe current --engine fsdp2 --out result.json

Engines: ddp (Accelerate's MULTI_GPU), fsdp2 (FullyShardedDataParallelPlugin(fsdp_version=2), one
shard unit per decoder layer) or zero1/zero2/zero3 (DeepSpeedPlugin, BF16, gradient clipping in
DeepSpeed's config). `--backend bf16` is the baseline: the same run without FP8. A combination that
`prepare()` refuses is recorded with its message (exit 0). Every run records speed (median step,
tokens/s), the peak GPU memory of each rank and the losses. Evidence written by rank 0:
- te: every TE Linear reported `fp8 == True` in its forward hook during training steps;
- torchao: every Float8Linear ran, and under FSDP2 its weight is torchao's FP8 all-gather subclass
  with a precomputed scale (the post-step hook ran);
- msamp O3 (FSDP2): the converted weights are FP16 master shards all-gathered as FP8, the optimizer
  keeps sharded FP8+FP16 states, and the model-state bytes per parameter each rank holds;
- msamp: the delayed scales and amax windows identical across ranks (reduce_amax), every engine;
- parameters identical across ranks after training (DDP) / loss falling on both ranks.

    torchrun --nproc_per_node 1 tests/distributed/gpu_engines.py --backend msamp --opt-level O3 --engine fsdp2 ...
runs the FSDP2 cases on one GPU. `--compile-model` compiles the model block by block through Accelerate (the FP8
Linears' evidence hooks then watch the first two steps only: dynamo traces them).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
import warnings

import torch
from gpu_profile import STEADY_FROM, device_kernels, kernel_summary, step_medians, write_profile

from lowprec import Accelerator, FP8RecipeKwargs
from lowprec.backends.base import BackendUnavailableError
from lowprec.runtime.export import BACKEND_ATTR


@contextlib.contextmanager
def sync_watch(counts: dict[str, int]):
    """Count the host syncs CUDA's debug mode reports inside the block, by file:line of the Python caller."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        if "synchroniz" in str(w.message):
            where = f"{os.path.relpath(w.filename)}:{w.lineno}"
            counts[where] = counts.get(where, 0) + 1


class PhaseMarks:
    """Where a step's time goes: host time between marks and, on a GPU, the device time between CUDA events
    recorded at the same marks (read after the step, once the loss's .item() has synced)."""

    def __init__(self):
        REDUCTIONS.clear()
        self.names, self.host = ["start"], [time.perf_counter()]
        self.events = [self._event()] if torch.cuda.is_available() else None

    @staticmethod
    def _event():
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def mark(self, name: str) -> None:
        self.names.append(name)
        self.host.append(time.perf_counter())
        if self.events is not None:
            self.events.append(self._event())

    def total_s(self) -> float:
        return self.host[-1] - self.host[0]

    def phases_ms(self) -> dict[str, dict[str, float]]:
        out = {"host": {n: (b - a) * 1e3 for n, a, b in zip(self.names[1:], self.host, self.host[1:])}}
        if self.events is not None:
            out["device"] = {n: a.elapsed_time(b) for n, a, b in zip(self.names[1:], self.events, self.events[1:])}
        # the FP8 gradient reduction inside those phases (DDP: in backward, after_backward; ZeRO: in DeepSpeed's
        # step), summed over its calls this step: host time, and device time on a GPU
        calls, REDUCTIONS[:] = list(REDUCTIONS), []
        out["host"]["fp8_reduce_within"] = sum(host for host, _, _ in calls) * 1e3
        if self.events is not None:
            out["device"]["fp8_reduce_within"] = sum(a.elapsed_time(b) for _, a, b in calls if a is not None)
        return out


REDUCTIONS: list[tuple] = []  # (host seconds, start event, end event) of each FP8GradReducer.reduce of a step


def process_age_s() -> float | None:
    """Seconds since this process started (Linux's /proc): the launch and the imports before main()."""
    try:
        with open("/proc/self/stat") as fh:
            start_ticks = int(fh.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/uptime") as fh:
            return round(float(fh.read().split()[0]) - start_ticks / os.sysconf("SC_CLK_TCK"), 2)
    except (OSError, ValueError, IndexError):
        return None


def time_fp8_reductions() -> None:
    """Record every `FP8GradReducer.reduce` call (`PhaseMarks.phases_ms` reports their sum)."""
    from lowprec.optim.grad_reduce import FP8GradReducer

    reduce = FP8GradReducer.reduce

    def timed(self):
        events = None
        if torch.cuda.is_available():
            events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            events[0].record()
        t0 = time.perf_counter()
        reduce(self)
        if events is not None:
            events[1].record()
        REDUCTIONS.append((time.perf_counter() - t0, *(events or (None, None))))

    FP8GradReducer.reduce = timed


def median_phases(steps: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """The median over steps of each phase's host and device milliseconds."""
    if not steps:
        return {}
    return {side: {name: round(statistics.median(s[side][name] for s in steps), 3) for name in steps[0][side]}
            for side in steps[0]}


@contextlib.contextmanager
def profiled(path: str, record: dict):
    """torch.profiler over the block. Every rank writes its CUDA kernels by self time and its Chrome trace beside
    `path` (gpu_profile.write_profile); `record` gets each rank's kernel summary (count, kernel, NCCL, busy and
    span ms: gpu_profile.kernel_summary), gathered, rank 0's first."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        yield
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    summary = kernel_summary(device_kernels(prof))
    rank = int(os.environ.get("RANK", "0"))
    key = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    write_profile(prof, path, rank, summary, key)
    ranks = [summary]
    if torch.distributed.is_initialized():
        ranks = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(ranks, summary)
    record["profiled_step"] = ranks


def peak_recorded(path: str):
    """The block under benchmarks/peak_memory.py's recorder: each rank writes what is live at the block's peak, by
    allocating line, to `path` (rank 0) or NAME.rankR.txt."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
    from peak_memory import recorded

    rank = int(os.environ.get("RANK", "0"))
    stem, ext = os.path.splitext(path)
    return recorded(path if rank == 0 else f"{stem}.rank{rank}{ext or '.txt'}")


def weight_sample(weight: torch.Tensor, n: int = 4096) -> torch.Tensor:
    """The first `n` values of this rank's part of `weight` in FP32 (a quantised weight dequantised first)."""
    local = getattr(weight, "_local_tensor", weight).detach()
    if getattr(type(local), "dequantize", None) not in (None, torch.Tensor.dequantize):  # TE's Float8Tensor
        local = local.dequantize()
    return local.reshape(-1)[:n].float().clone()


EVIDENCE_STEPS = 2  # a compiled model's forwards the evidence hooks watch (every forward in an eager one)


def heldout(accelerator, model, corpus, preset, batches: int) -> float:
    """The mean loss over `batches` batches a rank of the corpus's held-out split, as `lowprec bench` measures it
    (model.eval(), no gradient, each batch's loss averaged over the ranks), with the same windows in every cell."""
    from lowprec.demo.data import Windows

    windows = Windows(corpus.heldout, preset.seq_len, batches * preset.batch * accelerator.num_processes, seed=1234)
    loader = accelerator.prepare_data_loader(torch.utils.data.DataLoader(windows, batch_size=preset.batch))
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for ids in loader:
            total += accelerator.reduce(model(input_ids=ids, labels=ids).loss.float(), reduction="mean").item()
            count += 1
    model.train()
    return total / max(count, 1)


def main() -> None:
    # where a cell's wall time goes besides its steps (74-98 s for 31-43 s of steps at 300 steps, 2026-11-29)
    timeline, started = {"before_main": process_age_s()}, time.perf_counter()
    # main()'s start on the wall clock: with multi.sh's launch_started_s / launch_ended_s, matrix_table.py splits the
    # time outside main() into the launcher's before the ranks start and the exit after end_training
    main_started = time.time()

    def mark(name: str) -> None:
        timeline[name] = round(time.perf_counter() - started, 2)

    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="te")
    p.add_argument("--recipe", default=None)
    p.add_argument("--opt-level", default=None)
    p.add_argument("--engine", choices=["ddp", "fsdp2", "zero1", "zero2", "zero3"], default="ddp")
    p.add_argument("--grad-comm-dtype", choices=["fp32", "bf16", "fp8"], default=None)
    p.add_argument("--compile-fp8-layers", choices=["true", "false"], default=None)
    p.add_argument("--fp8-weights", action="store_true", help="FP8RecipeKwargs(fp8_weights=True) (te)")
    p.add_argument("--activation-dtype", choices=["fp8"], default=None,
                   help="FP8RecipeKwargs(activation_dtype=...): the tensors autograd saves stored in FP8 (issue 32)")
    p.add_argument("--optimizer-states", default=None,
                   help="FP8RecipeKwargs(optimizer_states=...): 'bf16', 'fp8', ... (with --fp8-weights: TE FusedAdam's "
                        "moments)")
    p.add_argument("--compile-model", action="store_true",
                   help="compile the model block by block through Accelerate (TorchDynamoPlugin(backend='inductor', "
                        "use_regional_compilation=True)), as torchtitan runs FP8 under FSDP2; BF16 with it is the "
                        "compiled baseline")
    p.add_argument("--no-fp8-all-gather", action="store_true",
                   help="FP8RecipeKwargs(enable_fsdp_float8_all_gather=False) (torchao under FSDP2): weights "
                        "all-gathered in the FSDP policy's dtype and cast inside the layer, not cast before the gather")
    p.add_argument("--torchao-gather-cast", action="store_true",
                   help="torchao's own cast of each shard before the FP8 all-gather (three eager kernels), not "
                        "lowprec's one-kernel cast (torchao under FSDP2): the A/B of torchao_gather.py")
    p.add_argument("--fused-adamw", action="store_true",
                   help="torch.optim.AdamW(fused=True), as the one-process headline and torchtitan step (default: "
                        "torch's choice, foreach); an optimizer lowprec replaces (msamp's levels, optimizer_states) "
                        "steps its own way either way")
    p.add_argument("--forward-prefetch", type=int, default=0,
                   help="under FSDP2, chain each group to the next N for forward prefetch "
                        "(lowprec.runtime.fsdp_prefetch.ForwardPrefetch: the next all-gather issued from the CPU "
                        "before a group's compute; 0: FSDP2's implicit overlap)")
    p.add_argument("--eval-batches", type=int, default=0,
                   help="after training, the mean loss over this many batches a rank of the corpus's held-out split "
                        "(the same windows for every cell: `heldout_loss`, to set beside BF16's of the same engine)")
    p.add_argument("--seed", type=int, default=0,
                   help="the model's initial weights and which training windows it sees (the held-out windows stay the "
                        "same): one cell per seed against BF16 of the same seed, multi.sh's SEEDS")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--size", default="small")
    p.add_argument("--out", required=True)
    p.add_argument("--profile", default=None,
                   help="write one step's CUDA kernels (torch.profiler, by self time) to this file (rank 0; "
                        "NAME.rankR.txt for the others) and each rank's Chrome trace beside it")
    p.add_argument("--peak", default=None,
                   help="write what is live at one steady step's peak, by allocating line (benchmarks/peak_memory.py), "
                        "to this file (rank 0; NAME.rankR.txt for the others), and what the step leaves allocated")
    p.add_argument("--peak-step", type=int, default=None,
                   help="the step --peak records (default: the fourth from the end, a steady one; 0 or 1: what the "
                        "first steps leave allocated for the rest of the training)")
    args = p.parse_args()
    if args.seed < 0:
        p.error(f"--seed takes a whole number >= 0, got {args.seed}")
    if args.forward_prefetch < 0 or (args.forward_prefetch and args.engine != "fsdp2"):
        p.error(f"--forward-prefetch takes a whole number >= 0 and chains FSDP2's groups: it needs --engine fsdp2 "
                f"(got {args.forward_prefetch} with --engine {args.engine})")
    if args.eval_batches < 0:
        p.error(f"--eval-batches takes a whole number >= 0 (0: no evaluation), got {args.eval_batches}")
    if args.peak_step is not None and (args.peak is None or not 0 <= args.peak_step < args.steps):
        p.error(f"--peak-step {args.peak_step} needs --peak and a step of the run "
                f"(0 to --steps - 1 = {args.steps - 1})")
    if args.backend == "bf16" and (args.activation_dtype or args.fp8_weights or args.optimizer_states
                                   or args.no_fp8_all_gather or args.torchao_gather_cast):
        p.error("--activation-dtype, --fp8-weights, --optimizer-states, --no-fp8-all-gather and "
                "--torchao-gather-cast are FP8 settings: backend 'bf16' has none")
    if (args.no_fp8_all_gather or args.torchao_gather_cast) and (args.backend, args.engine) != ("torchao", "fsdp2"):
        p.error("--no-fp8-all-gather and --torchao-gather-cast set torchao's FP8 all-gather under FSDP2: they need "
                f"--backend torchao --engine fsdp2 (got --backend {args.backend} --engine {args.engine})")
    if args.no_fp8_all_gather and args.torchao_gather_cast:
        p.error("--torchao-gather-cast sets the cast before torchao's FP8 all-gather, which --no-fp8-all-gather "
                "turns off: name one of them")
    time_fp8_reductions()

    from lowprec.demo.data import Windows, stdlib_corpus
    from lowprec.demo.model import PRESETS, build_model
    from lowprec.demo.schedule import ADAMW_SETTINGS, DESCRIPTION, lr_schedule

    preset = PRESETS[args.size]
    kwargs = {}
    if args.engine == "fsdp2":
        from accelerate.utils import FullyShardedDataParallelPlugin

        kwargs["fsdp_plugin"] = FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["LlamaDecoderLayer"], reshard_after_forward=True,
        )
    elif args.engine.startswith("zero"):
        from accelerate.utils import DeepSpeedPlugin

        world = int(os.environ.get("WORLD_SIZE", "1"))
        kwargs["deepspeed_plugin"] = DeepSpeedPlugin(hf_ds_config={
            "train_micro_batch_size_per_gpu": preset.batch, "gradient_accumulation_steps": 1,
            "train_batch_size": preset.batch * world, "gradient_clipping": 1.0, "bf16": {"enabled": True},
            "zero_optimization": {"stage": int(args.engine[-1]), "stage3_gather_16bit_weights_on_model_save": True},
        })
    if args.compile_model:
        from accelerate.utils import TorchDynamoPlugin

        kwargs["dynamo_plugin"] = TorchDynamoPlugin(backend="inductor", use_regional_compilation=True)
    refusals = (ValueError, NotImplementedError, BackendUnavailableError)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and args.engine == "fsdp2" and not torch.cuda.is_available():
        # before the Accelerator: msamp O3 on two CPU ranks was refused as under DDP, the engine Accelerate runs
        # there, and the refusal written as the FSDP2 cell's result
        raise SystemExit(f"gpu_engines.py: --engine {args.engine} but Accelerate runs DistributedType.MULTI_CPU on "
                         "CPU ranks: the cell would carry the wrong engine's label (Accelerate runs FSDP on GPU "
                         "process groups only)")
    try:
        if args.backend == "bf16":
            accelerator = Accelerator(mixed_precision="bf16", **kwargs)
        else:
            recipe = FP8RecipeKwargs(backend=args.backend, recipe=args.recipe or None, opt_level=args.opt_level,
                                     grad_comm_dtype=args.grad_comm_dtype, fp8_weights=args.fp8_weights or None,
                                     activation_dtype=args.activation_dtype, optimizer_states=args.optimizer_states,
                                     enable_fsdp_float8_all_gather=False if args.no_fp8_all_gather else None,
                                     compile_fp8_layers=None if args.compile_fp8_layers is None
                                     else args.compile_fp8_layers == "true")
            accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[recipe], **kwargs)

        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if accelerator.num_processes != launched:
            # each rank a training of its own, all writing one JSON (two CPU ranks under torchrun without
            # ACCELERATE_USE_CPU wrote one file over the other, labelled DDP): no cell at all instead
            raise SystemExit(f"gpu_engines.py: launched as {launched} processes but Accelerate runs "
                             f"{accelerator.num_processes} ({accelerator.distributed_type}); on CPUs set "
                             "ACCELERATE_USE_CPU=true")
        engine_in_force = {"fsdp2": "FSDP", "zero1": "DEEPSPEED", "zero2": "DEEPSPEED", "zero3": "DEEPSPEED"}
        wanted = engine_in_force.get(args.engine)
        if launched > 1 and wanted and accelerator.distributed_type.name != wanted:
            # Accelerate makes FSDP a GPU engine: on CPU ranks --engine fsdp2 trained under DDP, labelled FSDP2
            raise SystemExit(f"gpu_engines.py: --engine {args.engine} but Accelerate runs "
                             f"{accelerator.distributed_type}: the cell would carry the wrong engine's label "
                             "(Accelerate runs FSDP on GPU process groups only)")
        mark("accelerator")
        torch.manual_seed(args.seed)
        # Initialised on the GPU: `built` took 16.2-18.0 s of each cell's 74-98 s at 1f25b82, the CPU's
        # initialisation of the proxy's 0.98B weights most of it (every cell of a seed gets the same weights either
        # way). Then handed to prepare() on the CPU, as before: where each engine places and shards the model, and
        # what it keeps of the full weights (after_prepare_gib), stay as they were measured
        with torch.device(accelerator.device):
            model = build_model(preset)
        model = model.cpu()
        mark("built")
        corpus = stdlib_corpus(max_bytes=8 * 2**20)
        data = Windows(corpus.train, preset.seq_len, args.steps * preset.batch * accelerator.num_processes,
                       seed=args.seed)
        loader = torch.utils.data.DataLoader(data, batch_size=preset.batch)
        # `lowprec bench`'s protocol (lowprec/demo/schedule.py), so that a cell's held-out loss reads as bench's:
        # without the warm-up Adam's first step spiked the loss to 19 and one seed's held-out losses after 300 steps
        # spread -2.6% to +2.0% around BF16's (results/gpu/2026-11-29-h200x2-matrix-9c30527)
        optimizer = torch.optim.AdamW(model.parameters(), lr=preset.lr, **ADAMW_SETTINGS,
                                      **({"fused": True} if args.fused_adamw else {}))
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        mark("prepared")
        # stepped here once a step on every rank, not through Accelerate's scheduler, which steps once per process
        # (a schedule of STEPS steps would end halfway on two ranks)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(args.steps))
    except refusals as exc:  # a refused combination: its message is the result
        if os.environ.get("RANK", "0") == "0":
            with open(args.out, "w") as fh:
                json.dump({"backend": args.backend, "opt_level": args.opt_level, "engine": args.engine,
                           "refused": f"{type(exc).__name__}: {exc}"}, fh, indent=1)
        return
    plan = accelerator.precision_plan
    inner = accelerator.unwrap_model(model, keep_torch_compile=False)
    if args.torchao_gather_cast:  # lowprec's mark taken off: torchao's own cast of every shard
        from lowprec.backends.torchao_gather import _MARK

        for q in inner.parameters():
            vars(getattr(q, "_local_tensor", q)).pop(_MARK, None)
    prefetch = None
    if args.forward_prefetch:
        from lowprec.runtime.fsdp_prefetch import ForwardPrefetch

        prefetch = ForwardPrefetch(model, depth=args.forward_prefetch)
    compiled = plan is not None and accelerator._lowprec[-1][1].layer_compile()[0]
    # what prepare() leaves allocated: model state before any step (a converted weight kept alive beside its
    # FSDP2 shard once showed here as 4 bytes per element on every rank)
    after_prepare = torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0

    evidence_hooks: list = []
    if plan is None:
        fp8_modules = []
    elif plan.backend == "te":
        import transformer_engine.pytorch as te

        fp8_modules = [m for m in inner.modules() if isinstance(m, te.Linear)]
    else:
        # by the backend, not the class name: fully_shard swaps a module's class for FSDP<name>
        converted_by = getattr(inner, BACKEND_ATTR)
        fp8_modules = [m for m in inner.modules() if converted_by.converted_kind(m) == "linear"]
    # each FP8 Linear's forwards, and those of them in FP8 (TE's `fp8` flag; every one for the other backends), in a
    # counter on the module: a compiled model's graphs trace the hooks, and a hook appending to a Python list changed
    # a guard (the list's length) in every block's every forward, until at 0a837bc the blocks of
    # torchao:tensorwise:fsdp2:::model hit dynamo's recompile limit and ran eager (no kernel of inductor's in their
    # profile, 0.53x compiled BF16 FSDP2). The counter is the module's own (not a closure's index: dynamo guards on
    # that, one graph for each block), so the guards stay as they are.
    # In an eager model the counters are Python ints: a tensor's add would be two more kernel launches a Linear, which
    # the BF16 cells (no hooks) do not pay.
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    for m in fp8_modules:  # [forwards, of them in FP8]
        m._evidence_forwards = torch.zeros(2, dtype=torch.int64, device=device) if args.compile_model else [0, 0]

    def count_forward(mod, inputs, output):
        mod._evidence_forwards[0] += 1
        mod._evidence_forwards[1] += int(bool(getattr(mod, "fp8", True)))

    evidence_hooks = [m.register_forward_hook(count_forward) for m in fp8_modules]

    def counts() -> torch.Tensor:
        return torch.tensor([[int(n) for n in m._evidence_forwards] for m in fp8_modules],
                            dtype=torch.int64).reshape(-1, 2)

    gathered_types: set[str] = set()
    if plan is not None and plan.opt_level == "O3":
        for m in fp8_modules:
            # a pre-hook: FSDP2's own post-forward hook reshards before a forward hook would look
            evidence_hooks.append(
                m.register_forward_pre_hook(lambda mod, i: gathered_types.add(type(mod.weight).__name__)))

    from lowprec.demo.memory import model_state_bytes

    # a few values of each FP8 Linear's weight (its shard): the end of the run says whether the optimizer moved it
    # (te's FP8-only weights under FSDP2 trained their Linears, or not, with the loss going down either way)
    start_samples = [weight_sample(m.weight) for m in fp8_modules]
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    losses, times, rates, state_bytes = [], [], [], None
    instrumented: set[int] = set()  # steps a measurement ran in: left out of the medians
    model.train()
    syncs: dict[str, int] = {}
    kernels: dict[str, int] = {}
    phases: list[tuple[int, dict[str, dict[str, float]]]] = []  # (step, its phases)
    warm_peak = None  # the peak up to the steady state (the warm-up's graphs, the recompile at its end)
    for step, ids in enumerate(loader):
        if step == EVIDENCE_STEPS and args.compile_model:
            # two steps' forwards are the evidence in a compiled model, whose later steps are timed without the hooks'
            # adds in its graphs; removing them recompiles once, inside the warm-up
            for handle in evidence_hooks:
                handle.remove()
        if step == STEADY_FROM and torch.cuda.is_available():
            warm_peak = torch.cuda.max_memory_allocated() / 2**30
            torch.cuda.reset_peak_memory_stats()
        # one step past warm-up (and past the delayed scales' window) with CUDA's sync debug mode on: every
        # host sync in forward, backward, clipping and the optimizer step, by the Python line that made it
        watch = torch.cuda.is_available() and step == max(args.steps - 2, 0)
        profiling = args.profile is not None and step == max(args.steps - 3, 0)
        counting = step == args.steps - 1 and not args.engine.startswith("zero")
        peaking = args.peak is not None and step == (max(args.steps - 4, 0) if args.peak_step is None
                                                     else args.peak_step)
        if watch or profiling or counting or peaking:
            instrumented.add(step)
        with (sync_watch(syncs) if watch else profiled(args.profile, kernels) if profiling
              else peak_recorded(args.peak) if peaking else contextlib.nullcontext()):
            marks = PhaseMarks()
            loss = model(input_ids=ids, labels=ids).loss
            marks.mark("forward")
            accelerator.backward(loss)
            marks.mark("backward")
            if counting:
                # weights, gradients and states all held: the peak model state (DeepSpeed keeps its own
                # flat copies, which this does not see: its runs report peak memory only)
                state_bytes = model_state_bytes(inner, optimizer, getattr(inner, BACKEND_ATTR, None))
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            marks.mark("clip")
            optimizer.step()
            rates.append(optimizer.param_groups[0]["lr"])  # the rate this step used, as the engine's optimizer reads it
            scheduler.step()
            marks.mark("optimizer")
            optimizer.zero_grad()
            marks.mark("zero_grad")
        losses.append(accelerator.reduce(loss.detach(), reduction="mean").item())
        marks.mark("sync")  # the host waits here for the step's GPU work: the step time ends after it
        times.append(marks.total_s())
        if step not in instrumented:
            phases.append((step, marks.phases_ms()))

    # the training's peak, read before the checks below allocate (gathering every parameter in FP32 from each rank
    # took 12 GiB on the d4096 proxy and set the reported peak of DDP and ZeRO runs until 2026-11-27)
    steady_peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
    peak = max(steady_peak, warm_peak or 0.0)
    mark("trained")
    trained_counts = counts()  # the training's forwards: the evaluation's (TE's run in high precision) not among them
    evidence = {
        "fp8_weights_moved": sum(not torch.equal(a, weight_sample(m.weight))
                                 for a, m in zip(start_samples, fp8_modules)),
        # after the last step's zero_grad: a gradient still held is memory the next step's peak carries
        "grads_after_zero_grad": sum(q.grad is not None for q in model.parameters()),
    }
    backend = plan.backend if plan is not None else "bf16"
    if backend == "torchao" and args.engine == "fsdp2":
        weights = [m.weight for m in fp8_modules]
        local = [getattr(w, "_local_tensor", w) for w in weights]
        evidence["fp8_all_gather_weights"] = sum(type(t).__name__ == "WeightWithDynamicFloat8CastTensor" for t in local)
        evidence["precomputed_scales"] = sum(getattr(t, "_precomputed_scale", None) is not None for t in local)
        from lowprec.backends.torchao_gather import fused_gather_casts

        evidence["fused_gather_casts"] = fused_gather_casts(inner)
    if args.engine in ("ddp", "zero1", "zero2") and accelerator.num_processes > 1:  # replicated weights
        flat = torch.cat([q.detach().float().flatten() for q in inner.parameters()])
        gathered = accelerator.gather(flat.unsqueeze(0))
        evidence["max_param_diff_across_ranks"] = (gathered[0] - gathered[1]).abs().max().item()
    if backend == "msamp" and accelerator.num_processes > 1:
        # reduce_amax (on by default): the input and output-gradient delayed scales and the amax windows they
        # come from (the step in progress left out) all-reduced over NCCL, the same on every rank
        delayed = torch.cat([torch.cat([m.scales[:2].float(), m.amax_history[:, 1:].flatten().float()])
                             for m in fp8_modules])
        gathered = accelerator.gather(delayed.unsqueeze(0))
        evidence["delayed_scaling_differs_across_ranks"] = int((gathered[0] != gathered[1]).sum().item())
    if plan is not None and plan.opt_level == "O3":
        opt = getattr(optimizer, "optimizer", optimizer)
        zero = getattr(accelerator._lowprec[-1][1], "zero", None)
        if zero is not None:  # under DeepSpeed: the masters and states sit beside DeepSpeed's optimizer
            opt = zero.optimizer
            evidence["o3_zero"] = {"owners": zero.owners, "owned_here": sorted(zero.masters),
                                   "bytes_rank0": zero.model_state_bytes(),
                                   "params": sum(m.weight.numel() for m in fp8_modules)}
        evidence["o3"] = {
            "master_locals": sorted({type(getattr(m.weight, "_local_tensor", m.weight)).__name__ for m in fp8_modules}),
            "gathered_in_forward": sorted(gathered_types),
            "optimizer": type(opt).__name__,
            "state_types": sorted({f"{type(v).__name__} {v.dtype}" for s in opt.state.values() for k, v in s.items()
                                   if k in ("exp_avg", "exp_avg_sq")}),
        }
    elif backend == "msamp":
        # The last step's FP8 weight gradients, as reduced in FP8: identical bytes and scales on every rank.
        grads = torch.cat([torch.cat([m.fp8_grad_data.view(torch.uint8).flatten().float(), m.fp8_grad_scale.view(1)])
                           for m in fp8_modules])
        gathered = accelerator.gather(grads.unsqueeze(0))
        if accelerator.num_processes > 1:
            evidence["fp8_grad_bytes_differ_across_ranks"] = int((gathered[0] != gathered[1]).sum().item())
        evidence["fp8_weight_dtype"] = str(fp8_modules[0].weight.dtype)
        evidence["optimizer"] = type(getattr(optimizer, "optimizer", optimizer)).__name__
        evidence["opt_level"] = plan.opt_level
        evidence["ddp_ignores_fp8_weights"] = len(getattr(inner, "_ddp_params_and_buffers_to_ignore", []))
    # after the evidence above: evaluation forwards on each rank's own batches would move msamp's amax windows apart
    heldout_loss = heldout(accelerator, model, corpus, preset, args.eval_batches) if args.eval_batches > 0 else None
    mark("evaluated")
    per_step, steady = step_medians(times, instrumented)
    peaks = accelerator.gather(torch.tensor([peak], device=accelerator.device))
    steady_peaks = accelerator.gather(torch.tensor([steady_peak if warm_peak is not None else -1.0],
                                                   device=accelerator.device))
    if accelerator.is_main_process:
        tokens = preset.batch * preset.seq_len * accelerator.num_processes
        inner_optimizer = getattr(optimizer, "optimizer", optimizer)
        result = {
            "backend": backend, "recipe": plan.recipe if plan else None,
            "opt_level": plan.opt_level if plan else None, "engine": args.engine, "size": args.size,
            "world_size": accelerator.num_processes, "distributed_type": str(accelerator.distributed_type),
            "model_type": type(model).__name__,
            "wrapped_optimizer": type(getattr(optimizer, "optimizer", optimizer)).__name__,
            # DeepSpeed's ZeRO optimizer is no torch Optimizer and has no defaults (zero cells wrote empty JSON)
            "optimizer_fused": bool(getattr(inner_optimizer, "defaults", {}).get("fused")),
            "options": {k: str(v) for k, v in (plan.options if plan else {}).items()},
            "fp8_modules": len(fp8_modules),
            "planned_fp8_linears": sum(d.kind == "linear" for d in plan.converted) if plan else 0,
            "fp8_forward_calls": int(trained_counts[:, 0].sum()),
            # every FP8 Linear ran, and each of its forwards in FP8
            "all_forwards_in_fp8": bool(len(fp8_modules)) and bool((trained_counts[:, 0] > 0).all())
            and bool((trained_counts[:, 1] == trained_counts[:, 0]).all()),
            "heldout_loss": heldout_loss, "eval_batches": args.eval_batches, "seed": args.seed,
            "training": DESCRIPTION,
            "first_loss": losses[0], "last_loss": sum(losses[-5:]) / 5, "median_step_s": per_step,
            "tokens_per_s": tokens / per_step if per_step else None,
            # the steps after msamp's warm-up and the recompile at its end (gpu_profile.STEADY_FROM); None in a
            # run too short to have 5 of them: use STEPS >= 26
            "steady_median_step_s": steady, "steady_from_step": STEADY_FROM,
            "instrumented_steps": sorted(instrumented),
            "peak_memory_gib_per_rank": peaks.tolist(),
            # from step STEADY_FROM on: without a compile's own allocations at the warm-up's end (None if the run
            # is shorter)
            "steady_peak_memory_gib_per_rank": steady_peaks.tolist() if warm_peak is not None else None,
            "after_prepare_gib_rank0": after_prepare,
            "model_state_bytes_per_param": state_bytes,
            "planned_bytes_per_param": plan.model_state_bytes_per_param if plan else None,
            "losses": losses, "learning_rates": rates,
            "step_times_s": times,
            # seconds: before_main from the process's start, the rest from main()'s (accelerator, built, prepared,
            # trained, evaluated): with step_times_s, where a cell's wall time goes
            "timeline_s": timeline, "phase_ms": median_phases([p for i, p in phases if i >= 5]),
            "steady_phase_ms": median_phases([p for i, p in phases if i >= STEADY_FROM]),
            "grad_comm": plan.tensor("grad_comm").dtype if plan else None,
            "grad_comm_how": plan.tensor("grad_comm").scaling if plan else None,
            "notes": plan.notes if plan else [], "compiled_fp8_layers": compiled,
            "compiled_model": args.compile_model, "fp8_weights": args.fp8_weights,
            # the FSDP2 groups chained for forward prefetch, in the first forward's order (None: not asked)
            "forward_prefetch": {"depth": prefetch.depth, "order": prefetch.order} if prefetch else None,
            "weight_row": plan.tensor("weight").dtype if plan else None,
            "activation_dtype": args.activation_dtype,
            "optimizer_states_row": plan.tensor("optimizer_states").dtype if plan else None,
            "saved_activations": plan.activations.lines() if plan and plan.activations else None,
            "host_syncs_in_a_step": syncs, **kernels, **evidence,
        }
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    mark("ended")
    if accelerator.is_main_process:  # again, with the timeline's end (result holds it): the process group is gone
        result["main_started_s"] = round(main_started, 2)
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
    if os.environ.get("LOWPREC_HARNESS_FAST_EXIT") == "1":
        # Everything is written and the process group destroyed: skip the interpreter's teardown (CUDA, NCCL and
        # inductor's worker pool), which on the GPU hosts took much of the 14-24 s a cell spent outside main()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
