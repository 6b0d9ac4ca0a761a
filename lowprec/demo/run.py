"""One demo training run (BF16 or FP8) through `lowprec.Accelerator`; writes its metrics as JSON.

    python -m lowprec.demo.run --variant fp8 --backend torchao --json fp8.json
    accelerate launch --multi_gpu --num_processes 2 -m lowprec.demo.run --variant fp8 ...

The comparison (`lowprec demo`) runs this once per variant in a fresh process, so each run's peak
memory and compile caches are its own.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
import warnings

import torch
from torch.utils.data import DataLoader

from ..backends.te.first_scales import ENV as FIRST_SCALES_ENV
from ..frontend.parsing import AMAX_COMPUTE_ALGOS
from ..frontend.recipe import FP8RecipeKwargs
from ..optim.levels import STATE_PRESETS
from ..runtime.accelerator import Accelerator
from ..runtime.activations import activation_storage
from ..runtime.activations_fp32 import ENV as FP32_ENV
from ..runtime.activations_fp32 import POLICIES as FP32_POLICIES
from ..runtime.activations_in_graph import ENV as IN_GRAPH_ENV
from .data import TOKENIZATIONS, Windows, stdlib_corpus, tokenize
from .memory import model_state_bytes
from .model import ARCHS, PRESETS, build_model
from .schedule import ADAMW_SETTINGS, lr_schedule

OPTIMIZER_STATES = tuple(STATE_PRESETS)  # FP8RecipeKwargs.optimizer_states' named presets ("fp32", "bf16", ...)


def activation_counts(storage, forwards: int) -> dict | None:
    """What the FP8 activation storage did per forward. Its Python hooks count each tensor they pack and its
    bytes; compiled graphs that encode inside themselves decide what to pack once, while compiling, and their
    bytes are not counted (on CUDA `peak_split.held_by_forward_bytes` measures them): those report the tensors
    each graph packs and keeps, and no bytes."""
    if storage is None:
        return None
    counts = storage.counts
    # how FP32 saved tensors were stored (LOWPREC_FP8_ACTIVATIONS_FP32), and how many the Python hooks kept as FP32
    # and as a compiled graph's logits, and an eager model's constants (rotary tables) kept
    fp32 = {"fp32_saved_as": storage.fp32_policy,
            "untracked_fp32_kept_per_forward": counts.untracked_fp32_kept / forwards,
            "logits_kept_per_forward": counts.logits_kept / forwards,
            "constants_kept_per_forward": counts.constants_kept / forwards}
    if storage.in_graph and counts.traced_packed:
        return {**fp32, "inside_compiled_graphs": True, "packed_tensors_per_graph": counts.traced_packed,
                "kept_tensors_per_graph": counts.traced_kept,
                "packed_tensors_per_forward_outside_graphs": counts.packed / forwards,
                "packed_tensors_per_forward": None, "bytes_before_per_forward": None,
                "bytes_after_per_forward": None}
    return {**fp32, "inside_compiled_graphs": False, "packed_tensors_per_forward": counts.packed / forwards,
            "bytes_before_per_forward": counts.bytes_before / forwards,
            "bytes_after_per_forward": counts.bytes_after / forwards}


def positive_int(text: str) -> int:
    """argparse type of a count that must be 1 or more (a batch of 0 once ran the preset's batch, unsaid)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number (1 or more)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", choices=["bf16", "fp8"], required=True)
    p.add_argument("--backend", default="auto", help="FP8 backend: auto, torchao, te, msamp")
    p.add_argument("--recipe", default=None, help="the backend's scaling recipe (default: the backend's)")
    p.add_argument("--opt-level", default=None, help="MS-AMP memory level O1/O2/O3")
    p.add_argument("--size", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--arch", choices=sorted(ARCHS), default="llama", help="transformers model family")
    p.add_argument("--steps", type=positive_int, default=60)
    p.add_argument("--batch", type=positive_int, default=None, help="per-process batch (default: the preset's)")
    p.add_argument("--seq-len", type=positive_int, default=None, help="tokens per sample (default: the preset's)")
    p.add_argument("--grad-accum", type=positive_int, default=1)
    p.add_argument("--warmup", type=int, default=None,
                   help="steps left out of the timing (default 3, 8 compiled; with msamp its amax window's steps + 2)")
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the model (default: on for CUDA, off for CPU)")
    p.add_argument("--skip-slow-shapes", action=argparse.BooleanOptionalAction, default=None,
                   help="keep Linear layers FP8 would slow down in BF16 (default: the library's, on; it skips "
                        "nothing on devices without measured thresholds, such as the CPU)")
    p.add_argument("--corpus-mb", type=float, default=None)
    p.add_argument("--tokens", choices=sorted(TOKENIZATIONS), default="bytes",
                   help="bytes (vocabulary 256) or byte pairs (65536: an output head the size of a real LLM's)")
    p.add_argument("--skip-first-last", action=argparse.BooleanOptionalAction, default=None,
                   help="keep the first Linear and the output head in BF16 (default: the library's, off)")
    p.add_argument("--activation-dtype", choices=["fp8"], default=None,
                   help="FP8 runs: store the tensors autograd saves in FP8 (FP8RecipeKwargs.activation_dtype)")
    p.add_argument("--activations-fp32", choices=FP32_POLICIES, default=None,
                   help="with --activation-dtype fp8: how the FP32 tensors it would encode are stored (sets "
                        "LOWPREC_FP8_ACTIVATIONS_FP32 for this run; default: the variable's, fp8 when unset)")
    p.add_argument("--activations-in-graph", action=argparse.BooleanOptionalAction, default=None,
                   help="with --activation-dtype fp8 and a compiled model: store its graphs' saved tensors in FP8 "
                        "inside the graphs, or (--no-...) through the Python hooks after each graph (sets "
                        "LOWPREC_FP8_ACTIVATIONS_IN_GRAPH for this run; default: the variable's, else the library's)")
    p.add_argument("--optimizer-states", choices=OPTIMIZER_STATES, default=None,
                   help="FP8 runs: Adam's moments in this dtype (FP8RecipeKwargs.optimizer_states; fp8: E4M3 exp_avg, "
                        "FP16 exp_avg_sq; default: the level's, else the optimizer's own)")
    p.add_argument("--amax-compute-algo", choices=AMAX_COMPUTE_ALGOS, default=None,
                   help="FP8 runs with a delayed recipe: the scale from the max of the amax history or its most recent "
                        "entry (FP8RecipeKwargs.amax_compute_algo; default: the backend's)")
    p.add_argument("--te-first-scales", action=argparse.BooleanOptionalAction, default=None,
                   help="te's delayed recipe: cast the first step with scales from its own tensors, or (--no-...) "
                        "with TE's initial 1 (sets LOWPREC_TE_FIRST_SCALES for this run; default: the variable's, "
                        "else on)")
    p.add_argument("--fp8-weights", action=argparse.BooleanOptionalAction, default=None,
                   help="te only: Linear weights in FP8 only, FP32 masters in TE's FusedAdam (FP8RecipeKwargs."
                        "fp8_weights; default: the library's, off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--raw", action="store_true",
                   help="torchao only: also train the same model converted by torchao directly (no lowprec) in "
                        "this process, and report lowprec's overhead against it")
    p.add_argument("--json", default=None, help="write metrics here")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.activations_fp32 is not None and args.activation_dtype != "fp8":
        p.error(f"--activations-fp32 {args.activations_fp32} says how FP8 activations store FP32 tensors: it needs "
                "--activation-dtype fp8")
    if args.activations_in_graph is not None and args.activation_dtype != "fp8":
        p.error("--activations-in-graph says where FP8 activations are stored: it needs --activation-dtype fp8")
    if args.te_first_scales is not None and (args.variant, args.backend, args.recipe) != ("fp8", "te", "delayed"):
        p.error("--te-first-scales says how te's DelayedScaling casts its first step: it needs --variant fp8 "
                "--backend te --recipe delayed")
    if args.fp8_weights is not None and (args.variant, args.backend) != ("fp8", "te"):
        p.error("--fp8-weights keeps TransformerEngine's weights in FP8 only: it needs --variant fp8 --backend te")
    if args.warmup is not None and args.warmup < 0:
        p.error(f"--warmup must be 0 or more (steps left out of the timing), got {args.warmup}")
    return args


def worker_args(size: str, steps: int, batch: int | None, seq_len: int | None, compile: bool | None,
                tokens: str = "bytes") -> list[str]:
    """The options every run of a comparison shares, as this module's command line."""
    args = ["--size", size, "--steps", str(steps), "--tokens", tokens]
    for flag, value in (("--batch", batch), ("--seq-len", seq_len)):
        if value is not None:
            args += [flag, str(value)]
    if compile is not None:
        args.append("--compile" if compile else "--no-compile")
    return args


def run(args: argparse.Namespace) -> dict:
    cuda = torch.cuda.is_available()
    preset = PRESETS[args.size]
    batch = args.batch or preset.batch
    seq_len = args.seq_len or preset.seq_len
    compile_model = cuda if args.compile is None else args.compile
    warmup = args.warmup if args.warmup is not None else (8 if compile_model else 3)

    kwargs = {}
    if compile_model:
        from accelerate.utils import TorchDynamoPlugin

        kwargs["dynamo_plugin"] = TorchDynamoPlugin(backend="inductor")
    if args.activations_fp32 is not None:
        os.environ[FP32_ENV] = args.activations_fp32  # read when prepare() installs the storage
    if args.activations_in_graph is not None:
        os.environ[IN_GRAPH_ENV] = "1" if args.activations_in_graph else "0"
    if args.te_first_scales is not None:
        os.environ[FIRST_SCALES_ENV] = "1" if args.te_first_scales else "0"
    if args.variant == "fp8":
        recipe = FP8RecipeKwargs(
            # None unless given: the demo shows what the library's defaults convert, not a tuned subset.
            backend=args.backend, recipe=args.recipe, opt_level=args.opt_level, skip_slow_shapes=args.skip_slow_shapes,
            skip_first_last=args.skip_first_last, activation_dtype=args.activation_dtype,
            optimizer_states=args.optimizer_states, amax_compute_algo=args.amax_compute_algo,
            fp8_weights=args.fp8_weights,
        )
        accelerator = Accelerator(
            mixed_precision="fp8", kwargs_handlers=[recipe], gradient_accumulation_steps=args.grad_accum, **kwargs
        )
    else:
        accelerator = Accelerator(mixed_precision="bf16", gradient_accumulation_steps=args.grad_accum, **kwargs)

    torch.manual_seed(args.seed)
    corpus = stdlib_corpus(max_bytes=int((args.corpus_mb or (64 if cuda else 8)) * 2**20))
    micro_steps = args.steps * args.grad_accum
    processes = accelerator.num_processes
    train = Windows(tokenize(corpus.train, args.tokens), seq_len, micro_steps * batch * processes, seed=args.seed)
    heldout = Windows(tokenize(corpus.heldout, args.tokens), seq_len, args.eval_batches * batch * processes, seed=1234)
    model = build_model(preset, args.arch, TOKENIZATIONS[args.tokens])
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=preset.lr, **ADAMW_SETTINGS, fused=cuda or None)
    model, optimizer, train_loader, heldout_loader = accelerator.prepare(
        model, optimizer, DataLoader(train, batch_size=batch), DataLoader(heldout, batch_size=batch)
    )
    # Stepped here once an optimizer step, not prepared: Accelerate steps a prepared scheduler once per process each
    # step (on two ranks a schedule of --steps steps ended halfway and its cosine climbed back) and under DeepSpeed
    # hands it to the engine; this way every process count and engine follows the same rates
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(args.steps))
    if cuda:
        torch.cuda.reset_peak_memory_stats()

    from tqdm.auto import tqdm

    plan = accelerator.precision_plan
    label = "BF16 autocast" if args.variant == "bf16" else f"FP8 {plan.backend}:{plan.recipe}"
    bar = tqdm(total=args.steps, desc=f"{label:<24}", disable=args.no_progress or not accelerator.is_main_process,
               file=sys.stderr, dynamic_ncols=True)
    losses, step_times, rates = [], [], []
    model.train()
    step = 0
    t_step = time.perf_counter()
    for input_ids in train_loader:
        with accelerator.accumulate(model):
            loss = model(input_ids=input_ids, labels=input_ids).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            if accelerator.sync_gradients:  # the optimizer stepped (the last micro-step of an accumulation)
                rates.append(optimizer.param_groups[0]["lr"])
                scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        if not accelerator.sync_gradients:
            continue
        value = accelerator.reduce(loss.detach().float(), reduction="mean").item()  # syncs the device
        now = time.perf_counter()
        step_times.append(now - t_step)
        t_step = now
        losses.append(value)
        step += 1
        bar.set_postfix(loss=f"{value:.3f}")
        bar.update(1)
    bar.close()

    # Model state as it stands during training: one more backward leaves gradients where they live. Its
    # forward measures what a micro-batch holds for backward (saved activations, the loss and its logits).
    ids = next(iter(heldout_loader))
    held_before = torch.cuda.memory_allocated() if cuda else None
    extra_loss = model(input_ids=ids, labels=ids).loss
    held_by_forward = torch.cuda.memory_allocated() - held_before if cuda else None
    accelerator.backward(extra_loss)
    del extra_loss
    backend = accelerator._lowprec[-1][1] if accelerator._lowprec else None
    state = model_state_bytes(accelerator.unwrap_model(model, keep_torch_compile=False), optimizer, backend)
    optimizer.zero_grad(set_to_none=True)

    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for input_ids in heldout_loader:
            out = model(input_ids=input_ids, labels=input_ids).loss.float()
            total += accelerator.reduce(out, reduction="mean").item()
            count += 1
    heldout_loss = total / max(count, 1)

    if args.warmup is None and backend is not None and backend.warm_up_steps():
        # msamp's layers scale from each tensor for their first steps (a graph of their own when compiled), and the
        # step at the window's end compiles the delayed form: time the steps after it, as benchmarks/headline.py
        warmup = max(warmup, backend.warm_up_steps() + 2)
    if len(step_times) <= warmup:
        warnings.warn(f"lowprec bench: {len(step_times)} steps leave none past the {warmup} warm-up steps to time; "
                      "all are timed (raise --steps or lower --warmup)", stacklevel=1)
    timed = step_times[warmup:] or step_times
    median_s = statistics.median(timed)
    tokens_per_step = batch * seq_len * args.grad_accum * accelerator.num_processes
    if cuda:
        peak, peak_kind = torch.cuda.max_memory_allocated(), "cuda max_memory_allocated"
    else:
        peak, peak_kind = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process peak RSS"
    tail = max(1, len(losses) // 10)
    plan = accelerator.precision_plan
    state_bytes = state["all_params"]["total"] * n_params  # this process's bytes (per parameter of the whole)
    storage = activation_storage(model)
    forwards = max(1, step * args.grad_accum + 1)  # with gradients: the training steps' and the one above
    result = {
        "variant": args.variant,
        "label": label,
        "size": args.size,
        "params": n_params,
        "device": torch.cuda.get_device_name() if cuda else "CPU",
        "world_size": accelerator.num_processes,
        "compiled": compile_model,
        "steps": step,
        "batch": batch,
        "seq_len": seq_len,
        "grad_accum": args.grad_accum,
        "tokens_per_step": tokens_per_step,
        "losses": losses,
        "learning_rates": rates,  # each optimizer step's (lowprec/demo/schedule.py)
        "first_loss": losses[0],
        "final_loss": sum(losses[-tail:]) / tail,
        "heldout_loss": heldout_loss,
        "step_ms_median": 1000 * median_s,
        "timed_steps": len(timed),
        "tokens_per_s": tokens_per_step / median_s,
        "peak_memory_bytes": peak,
        "peak_memory_kind": peak_kind,
        # the peak split: model state (weights, gradients, optimizer states, as measured above) and the rest
        # (saved activations, temporaries, the allocator's slack); the rest is meaningless against a process's RSS
        "peak_split": {"model_state_bytes": state_bytes,
                       "rest_bytes": peak - state_bytes if cuda else None,
                       "held_by_forward_bytes": held_by_forward},
        "activation_dtype": args.activation_dtype,
        "optimizer_states": args.optimizer_states,
        "amax_compute_algo": args.amax_compute_algo,
        "fp8_activations": activation_counts(storage, forwards),
        "corpus_files": corpus.files,
        "tokens": args.tokens,
        "vocab_size": TOKENIZATIONS[args.tokens],
        "arch": args.arch,
        "model_state_bytes_per_param": state,
        "plan": plan.to_dict() if plan else None,
        "plan_text": str(plan) if plan else None,
        "emulated": bool(plan and plan.emulated),
        "pid": os.getpid(),
    }
    accelerator.end_training()
    if args.raw:
        result["raw"] = _raw_torchao(args, plan, train, batch, compile_model, warmup)
        result["overhead_vs_raw"] = result["step_ms_median"] / result["raw"]["step_ms_median"] - 1
    if args.json and accelerator.is_main_process:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return result


def _raw_torchao(args, plan, train, batch: int, compile_model: bool, warmup: int) -> dict:
    """The same model, data and steps with torchao's own `convert_to_float8_training` (the layers lowprec
    converted, the recipe it used) under plain `accelerate.Accelerator(mixed_precision="bf16")`: the
    peer lowprec drives, timed in this process so the overhead is not process-to-process noise."""
    if plan is None or plan.backend != "torchao":
        raise SystemExit("--raw compares with torchao driven directly: it needs an FP8 run with backend torchao")
    from accelerate import Accelerator as PlainAccelerator
    from accelerate.state import AcceleratorState, GradientState
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    kwargs = {}
    if compile_model:
        from accelerate.utils import TorchDynamoPlugin

        kwargs["dynamo_plugin"] = TorchDynamoPlugin(backend="inductor")
    accelerator = PlainAccelerator(mixed_precision="bf16", **kwargs)
    torch.manual_seed(args.seed)
    preset = PRESETS[args.size]
    model = build_model(preset, args.arch, TOKENIZATIONS[args.tokens])
    fp8 = {d.fqn for d in plan.converted}
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(plan.recipe),
                               module_filter_fn=lambda module, fqn: fqn in fp8)
    cuda = torch.cuda.is_available()
    optimizer = torch.optim.AdamW(model.parameters(), lr=preset.lr, **ADAMW_SETTINGS, fused=cuda or None)
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(train, batch_size=batch))
    times = []
    t_step = time.perf_counter()
    for input_ids in loader:
        loss = model(input_ids=input_ids, labels=input_ids).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()  # syncs the device, as the lowprec run's loss reduction does
        now = time.perf_counter()
        times.append(now - t_step)
        t_step = now
    accelerator.end_training()
    median = statistics.median(times[warmup:] or times)
    return {"step_ms_median": 1000 * median, "fp8_layers": len(fp8)}


def main(argv: list[str] | None = None) -> int:
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
