"""The headline comparison: lowprec's main configurations against BF16 on one GPU, in one process.

    python3 benchmarks/headline.py --out OUT.json [--widths d4096] [--configs ...] [--steps 16 --warmup 8]

What `scripts/gpu/verify.sh` runs after the GPU suite, so that every GPU-touching change ends with the
numbers the README and docs quote, measured on the tree it changes. Each configuration is compared with
BF16 of the same mode (eager with eager, compiled with compiled) measured in the same process:

- "bf16 eager" / "bf16 compiled": lowprec.Accelerator(mixed_precision="bf16"); compiled = Accelerate's
  dynamo plugin (inductor, regional: the identical blocks share one graph).
- "torchao": FP8RecipeKwargs(backend="torchao"), compiled (its fast mode).
- "msamp O2": FP8RecipeKwargs(backend="msamp", opt_level="O2"), compiled.
- "te": FP8RecipeKwargs(backend="te"), eager (TE's fast mode).
- "auto" / "auto compiled": FP8RecipeKwargs() (backend="auto"), eager / compiled: which backend it
  chose, and why each one before it was passed over, are recorded.
- "raw te": no lowprec: every Linear but the head swapped for te.Linear by hand (weights copied), the
  step under te.autocast(DelayedScaling(HYBRID)) inside plain accelerate.Accelerator(mixed_precision="bf16").
  lowprec's TE should match its speed and peak memory.
- "te no norms": "te" with the norms excluded (exclude=("*norm*",)): what TE's norms cost or save.
- "... whole": the model compiled as one graph (Accelerate's dynamo plugin without regional compilation), the
  head and the loss included, against "bf16 whole".

Model: a Llama-style decoder written here (no `transformers`): token embedding, per block RMSNorm, one
fused QKV Linear, causal SDPA (heads of 128), output Linear, RMSNorm, fused gate+up Linear, SiLU-gated
down Linear; final RMSNorm and an untied head over a 32000-token vocabulary; batch 4 x 2048 random ids,
cross-entropy on the next token. Optimizer torch AdamW(fused=True) handed to prepare().

Per run: median step after `--warmup` steps (the loss read each step synchronises; default 20: msamp's FP8 layers
scale with the step's own amaxes for their first `MSAMP_WINDOW` steps and with the delayed ones after, a compiled graph
of its own: the previous default, the last 8 of 16 steps, timed msamp's warm-up graph only), tokens/s, peak CUDA
memory from right after prepare(), and where in the step it came (`peak_by_phase_gib`: the highest peak of the
forwards, the backwards and the optimizer steps; `timed_peak_gib`: over the timed steps only, without the first
steps' compiles, msamp's second graph and inductor's autotuning; with `--rounds`, `rounds_peak_gib` has each round's
peak), CUDA memory held after prepare() and after the first optimizer
step (model state), CUDA memory the first forward leaves held for backward, FP8 Linears in the plan.
`--profile-dir DIR` adds, for `--profile-configs` (default: every one), `--profile-steps` extra steps under
torch.profiler after the timed ones: DIR/WIDTH_LABEL.prof.txt (top kernels by device time) and the JSON's
`profile` (kernel time per step by category, widths.py's `profile_steps`), and for one step more
DIR/WIDTH_LABEL.sites.txt: the operators that launched the kernels, by input shapes and by Python call site
(call_sites.py). `--peak-configs` traces one more step's allocations (`--peak-step N`: the run's step N instead, such
as msamp's switch to its delayed-scaling graph at step 16, the only step that can have reached msamp O2 act8's
pre-timing peak at 20e0603: step 0 holds no optimizer state, the warm-up graph's steps peaked lower at 2a04d10):
DIR/WIDTH_LABEL.peak.txt lists what is live at that step's peak by allocating line (peak_memory.py). `step_peaks_gib`
has each step's peak (the run's, then any profiled or traced one after them).
`--summarize OUT.json` prints the table again. "... act8" configurations add activation_dtype="fp8" (a compiled
model's graphs encode what they save inside them, the default); "... act8 hooks" ones encode through Python hooks
after each graph instead (LOWPREC_FP8_ACTIVATIONS_IN_GRAPH=0 while they run).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from unittest import mock

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 32000
# name -> (hidden, ffn, layers); heads of 128, batch 4 x 2048 tokens
WIDTHS = {"tiny": (64, 128, 2), "d2048": (2048, 7168, 4), "d4096": (4096, 14336, 4), "d8192": (8192, 28672, 2)}
BATCH, SEQ = 4, 2048


def dims(width: str) -> tuple[int, int, int]:
    """(hidden, ffn, layers) of a width name: one of WIDTHS, or "d4096x12" (d4096's shape, 12 blocks)."""
    if width in WIDTHS:
        return WIDTHS[width]
    name, sep, layers = width.partition("x")
    if name not in WIDTHS or not sep or not layers.isdigit() or int(layers) < 1:
        raise argparse.ArgumentTypeError(f"width {width!r} is not one of {', '.join(WIDTHS)}, or one of them with "
                                         "xN blocks (d4096x12)")
    hidden, ffn, _ = WIDTHS[name]
    return hidden, ffn, int(layers)



# label -> (mode, FP8RecipeKwargs fields | None for BF16 | "raw te")
CONFIGS: dict[str, tuple[str, dict | str | None]] = {
    "bf16 eager": ("eager", None),
    "te": ("eager", dict(backend="te")),
    "auto": ("eager", dict()),
    "raw te": ("eager", "raw te"),
    "te no norms": ("eager", dict(backend="te", exclude=("*norm*",))),
    "bf16 compiled": ("compiled", None),
    "torchao": ("compiled", dict(backend="torchao")),
    "msamp O2": ("compiled", dict(backend="msamp", opt_level="O2")),
    "auto compiled": ("compiled", dict()),
    # TE in a compiled model (a graph break around each TE module), with lowprec and by hand
    "te compiled": ("compiled", dict(backend="te")),
    "raw te compiled": ("compiled", "raw te"),
    # saved activations in FP8 (issue 32's memory targets: msamp O2 <= 0.45x BF16's peak at >= 1.25x, torchao
    # and te <= 0.75x at >= 1.2x)
    "te act8": ("eager", dict(backend="te", activation_dtype="fp8")),
    "torchao act8": ("compiled", dict(backend="torchao", activation_dtype="fp8")),
    "msamp O2 act8": ("compiled", dict(backend="msamp", opt_level="O2", activation_dtype="fp8")),
    # the same through Python hooks after each compiled graph (LOWPREC_FP8_ACTIVATIONS_IN_GRAPH=0, ENVIRONMENT)
    "torchao act8 hooks": ("compiled", dict(backend="torchao", activation_dtype="fp8")),
    "msamp O2 act8 hooks": ("compiled", dict(backend="msamp", opt_level="O2", activation_dtype="fp8")),
    # the loss's chunks as torch ops (LOWPREC_FUSED_CROSS_ENTROPY=0), not the default's one fused kernel each way
    "msamp O2 act8 torch loss": ("compiled", dict(backend="msamp", opt_level="O2", activation_dtype="fp8")),
    "torchao act8 torch loss": ("compiled", dict(backend="torchao", activation_dtype="fp8")),
    # torchao's peak is its FP32 model state at the end of the backward: MS-AMP's O2 storage on its layers too
    "torchao O2 act8": ("compiled", dict(backend="torchao", opt_level="O2", activation_dtype="fp8")),
    "te O2 act8": ("eager", dict(backend="te", opt_level="O2", activation_dtype="fp8")),
    # O1 (FP16 weights without a master copy, FP8 weight gradients, FP32 Adam states): 10 bytes a parameter before
    # the step where te's default keeps 12, with O2's FP8/FP16 states' extra kernels left out
    "te O1 act8": ("eager", dict(backend="te", opt_level="O1", activation_dtype="fp8")),
    # Adam's moments in BF16 (optimizer_states="bf16": 4 bytes a parameter less, every parameter): te's and torchao's
    # peaks with FP8 activations are their FP32 model state at the optimizer step (te act8: 13.9 GiB of 20.5 at
    # 05e9f2d, results/gpu/2026-11-28-h200-act8-peak-05e9f2d), which FP8 activations do not touch
    "te act8 bf16m": ("eager", dict(backend="te", activation_dtype="fp8", optimizer_states="bf16")),
    "torchao act8 bf16m": ("compiled", dict(backend="torchao", activation_dtype="fp8", optimizer_states="bf16")),
    # each parameter stepped in backward as its gradient is ready (FP8RecipeKwargs.optimizer_in_backward): the FP32
    # gradients, 4.6 GiB of torchao act8's 19.83 GiB backward peak at the end of the backward, never all at once;
    # FP32 moments kept, Adam's arithmetic unchanged
    "torchao act8 in backward": ("compiled", dict(backend="torchao", activation_dtype="fp8",
                                                  optimizer_in_backward=True)),
    "te act8 in backward": ("eager", dict(backend="te", activation_dtype="fp8", optimizer_in_backward=True)),
    # inductor keeping more of a pointwise chain unstored (INDUCTOR): a SiLU backward that reads both halves of the
    # FP8-stored gate/up output was stored as an FP32 block of the step's peak (results/gpu/2026-11-28-h200-act8-peak-
    # 05e9f2d; torch 2.11's realize_opcount_threshold is 30, at 40 and 64 torchao O2 act8 peaked 0.14 GiB lower).
    # Since 96eb278 the decode has no clamp for BF16, which kept it under 30 on CPU under the GPU's rules: against
    # these, whether anything else in the step still passes the limit. Since 84cfb3a a model with FP8 activations in
    # its graphs is compiled at 64 by lowprec itself (runtime/compile_options.py): for these the word changes nothing
    "msamp O2 act8 realize64": ("compiled", dict(backend="msamp", opt_level="O2", activation_dtype="fp8")),
    "torchao O2 act8 realize64": ("compiled", dict(backend="torchao", opt_level="O2", activation_dtype="fp8")),
    # msamp's amaxes in its compiled layers over each matrix's own rows (PATCHES: kernels.scaling.AMAX_OVER_OWN_ROWS),
    # which inductor may fuse with the kernel computing the gradient, whose BF16 copy it stored for the amax alone
    # (results/gpu/2026-11-28-h200-act8-steady-2a04d10); with the realize threshold at 64 too
    "msamp O2 act8 own rows": ("compiled", dict(backend="msamp", opt_level="O2", activation_dtype="fp8")),
    # and without FP8 activations: the default's configuration, before own rows may become the default
    "msamp O2 own rows": ("compiled", dict(backend="msamp", opt_level="O2")),
    "msamp O2 act8 own rows realize64": ("compiled", dict(backend="msamp", opt_level="O2", activation_dtype="fp8")),
    # the FP8 Linears' transposed inputs cast again in backward from what it keeps anyway, not kept from the forward
    # (ENVIRONMENT: LOWPREC_RECOMPUTE_FP8_COPIES=1; 0.81 GiB of msamp O2 act8's 10.77 GiB steady peak, results/gpu/
    # 2026-11-28-h200x2-realize-teloss-0e7acfb); with the own-row amaxes, which gave that peak. The default since
    # 511ecf5's measurement: "keep copies" (=0) is the configuration without it
    "msamp O2 act8 keep copies": ("compiled", dict(backend="msamp", opt_level="O2", activation_dtype="fp8")),
    "torchao act8 keep copies": ("compiled", dict(backend="torchao", activation_dtype="fp8")),
    "msamp O2 act8 recompute": ("compiled", dict(backend="msamp", opt_level="O2", activation_dtype="fp8")),
    "msamp O2 act8 own rows recompute": ("compiled", dict(backend="msamp", opt_level="O2", activation_dtype="fp8")),
    "torchao O2 act8 recompute": ("compiled", dict(backend="torchao", opt_level="O2", activation_dtype="fp8")),
    "torchao act8 recompute": ("compiled", dict(backend="torchao", activation_dtype="fp8")),
    # with the recompute SiLU's backward half came back as an FP32 block at the steady peak (0.44 GiB, its fused chain
    # past inductor's op-count rule again: results/gpu/2026-11-28-h200x2-recompute-aabeb3e): the three together
    "msamp O2 act8 own rows recompute realize64": ("compiled", dict(backend="msamp", opt_level="O2",
                                                                    activation_dtype="fp8")),
    "msamp O2 act8 recompute realize64": ("compiled", dict(backend="msamp", opt_level="O2", activation_dtype="fp8")),
    # the whole model as one graph (the head and the loss compiled too: inductor fuses the FP32 log-softmax that
    # regional compilation leaves to eager), against BF16 compiled the same way
    "bf16 whole": ("whole", None),
    "torchao whole": ("whole", dict(backend="torchao")),
    "torchao act8 whole": ("whole", dict(backend="torchao", activation_dtype="fp8")),
    "msamp O2 whole": ("whole", dict(backend="msamp", opt_level="O2")),
    "msamp O2 act8 whole": ("whole", dict(backend="msamp", opt_level="O2", activation_dtype="fp8")),
}
# a word of a label -> what it sets while that configuration runs: environment variables (ENVIRONMENT),
# torch._inductor.config settings, its forward and backward compiling in them (INDUCTOR), and lowprec module
# attributes, "module:attribute": value (PATCHES); a label with several such words sets each one's
LABEL_WORDS: dict[str, tuple[str, dict[str, object]]] = {
    "hooks": ("environment", {"LOWPREC_FP8_ACTIVATIONS_IN_GRAPH": "0"}),
    "torch loss": ("environment", {"LOWPREC_FUSED_CROSS_ENTROPY": "0"}),
    "recompute": ("environment", {"LOWPREC_RECOMPUTE_FP8_COPIES": "1"}),
    "keep copies": ("environment", {"LOWPREC_RECOMPUTE_FP8_COPIES": "0"}),
    "realize64": ("inductor", {"realize_opcount_threshold": 64}),
    "own rows": ("patches", {"lowprec.kernels.scaling:AMAX_OVER_OWN_ROWS": True}),
}


def _settings(kind: str) -> dict[str, dict]:
    """label -> the `kind` settings its words set (LABEL_WORDS), for every configuration with any."""
    out: dict[str, dict] = {}
    for label in CONFIGS:
        for word, (of_kind, values) in LABEL_WORDS.items():
            if of_kind == kind and f" {word} " in f" {label} ":
                out.setdefault(label, {}).update(values)
    return out


ENVIRONMENT: dict[str, dict[str, str]] = _settings("environment")
INDUCTOR: dict[str, dict] = _settings("inductor")
PATCHES: dict[str, dict[str, object]] = _settings("patches")
# FP8Linear's amax_history_len (MS-AMP's 16): msamp's steps before it take current scales, another compiled graph
MSAMP_WINDOW = 16
# more left allocated than this after a configuration's run is reported (its JSON's left_allocated_gib, a warning):
# workspaces kept for the process (cuBLAS's, TE's) are below it (3ee32b5: torchao act8 left 62 MiB, the steps in
# backward's leak 13.87 GiB)
LEFT_ALLOCATED_LIMIT_GIB = 0.25
DEFAULT_CONFIGS = ["bf16 eager", "te", "auto", "raw te", "bf16 compiled", "torchao", "msamp O2", "auto compiled"]


class Block(nn.Module):
    def __init__(self, d: int, ff: int):
        super().__init__()
        self.heads = d // 128 if d >= 128 else 1
        self.attn_norm = nn.RMSNorm(d, eps=1e-5)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.mlp_norm = nn.RMSNorm(d, eps=1e-5)
        self.gate_up = nn.Linear(d, 2 * ff, bias=False)
        self.down = nn.Linear(ff, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


def uses_msamp(config: str) -> bool:
    """Whether `config` runs msamp's FP8 layers (whose first MSAMP_WINDOW steps are a warm-up)."""
    kwargs = CONFIGS[config][1]
    return isinstance(kwargs, dict) and kwargs.get("backend") == "msamp"


def params(width: str) -> int:
    """Parameters of the proxy at `width`, counted on a copy built on the meta device (no memory)."""
    with torch.device("meta"):
        return sum(p.numel() for p in Proxy(*dims(width)).parameters())


class Proxy(nn.Module):
    def __init__(self, d: int, ff: int, layers: int, vocab: int = VOCAB):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, ff) for _ in range(layers))
        self.norm = nn.RMSNorm(d, eps=1e-5)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return self.loss_function(logits, ids, self.head.out_features)

    # The loss as a Hugging Face causal LM computes it (FP32 logits), through the attributes those models have for
    # it: what activation_dtype='fp8' replaces with a loss that keeps no FP32 copy of the logits (runtime/loss.py).
    loss_type = "ForCausalLM"

    @property
    def loss_function(self):
        from transformers.loss.loss_utils import ForCausalLMLoss

        return vars(self).get("_loss_function") or ForCausalLMLoss

    @loss_function.setter
    def loss_function(self, fn):
        self._loss_function = fn


def _raw_te(model: Proxy) -> Proxy:
    """Every Linear but the head swapped for te.Linear by hand, weights copied: what a TE user writes."""
    import transformer_engine.pytorch as te

    for block in model.blocks:
        for name in ("qkv", "o", "gate_up", "down"):
            old = getattr(block, name)
            new = te.Linear(old.in_features, old.out_features, bias=False, params_dtype=old.weight.dtype,
                            device=old.weight.device)
            with torch.no_grad():
                new.weight.copy_(old.weight)
            setattr(block, name, new)
    return model


def _auto_reasons(recipe, context) -> list[str]:
    """Why `backend='auto'` passed over each backend it tried before the one it chose, then the chosen one."""
    from lowprec.backends import auto_choice

    chosen, passed_over = auto_choice(recipe, context)
    return passed_over + ([f"{chosen.name}: chosen"] if chosen is not None else [])


def run_one(label: str, width: str, data: list[torch.Tensor], warmup: int, profile_path: str | None = None,
            profile_n: int = 2, peak_path: str | None = None, peak_step: int | None = None) -> dict:
    import torch._inductor.config as inductor_config

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.dict(os.environ, ENVIRONMENT.get(label, {})))
        stack.enter_context(inductor_config.patch(INDUCTOR.get(label, {})))
        for target, value in PATCHES.get(label, {}).items():
            module, attribute = target.split(":")
            stack.enter_context(mock.patch.object(importlib.import_module(module), attribute, value))
        return _run_one(label, width, data, warmup, profile_path, profile_n, peak_path, peak_step)


def _run_one(label: str, width: str, data: list[torch.Tensor], warmup: int, profile_path: str | None,
             profile_n: int, peak_path: str | None, peak_step: int | None = None) -> dict:
    from accelerate import Accelerator as PlainAccelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import TorchDynamoPlugin

    from lowprec import Accelerator, FP8RecipeKwargs
    from lowprec.runtime.activations import activation_storage
    from lowprec.runtime.wrapping import models_of

    mode, spec = CONFIGS[label]
    cuda = torch.cuda.is_available()
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    dynamo = (TorchDynamoPlugin(backend="inductor", use_regional_compilation=mode == "compiled")
              if mode in ("compiled", "whole") else None)
    extra = {"dynamo_plugin": dynamo} if dynamo is not None else {}
    recipe = None
    if spec is None:
        accelerator = Accelerator(mixed_precision="bf16", **extra)
    elif spec == "raw te":
        accelerator = PlainAccelerator(mixed_precision="bf16", **extra)
    else:
        recipe = FP8RecipeKwargs(**spec)
        accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[recipe], **extra)
    hidden, ffn, layers = dims(width)
    torch.manual_seed(0)
    with torch.device(accelerator.device):
        model = Proxy(hidden, ffn, layers)
    step_context = None
    if spec == "raw te":
        import transformer_engine.pytorch as te
        from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling, Format

        model = _raw_te(model)
        # DelayedScaling does not compile; compiled, TE's user writes current scaling (as lowprec's default there)
        te_recipe = (DelayedScaling(fp8_format=Format.HYBRID) if mode == "eager"
                     else Float8CurrentScaling(fp8_format=Format.HYBRID))

        def step_context():
            return te.autocast(enabled=True, recipe=te_recipe)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=cuda)
    model, optimizer = accelerator.prepare(model, optimizer)
    memory = {}
    if cuda:
        torch.cuda.synchronize()
        memory["after_prepare_gib"] = torch.cuda.memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()

    phase_peaks = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
    timed_peak = [0.0]  # over the timed steps only: the first steps' compiles (msamp's second graph at the end of its
    # warm-up, with inductor's autotuning) are in `phase_peaks` but not here

    step_peaks: list[float] = []  # each step's: which step reached the run's peak (msamp's second graph's, at 2a04d10)

    def phase_end(phase: str) -> float:
        # the peak since the last phase ended (reading it does not synchronise: the allocator's own count)
        if not cuda:
            return 0.0
        peak = torch.cuda.max_memory_allocated() / 2**30
        phase_peaks[phase] = max(phase_peaks[phase], peak)
        if len(times) >= warmup:
            timed_peak[0] = max(timed_peak[0], peak)
        torch.cuda.reset_peak_memory_stats()
        return peak

    def step(ids: torch.Tensor, first: bool = False) -> float:
        ids = ids.to(accelerator.device, non_blocking=True)
        held = torch.cuda.memory_allocated() if first and cuda else None
        if step_context is not None:
            with step_context():
                loss = model(ids)
        else:
            loss = model(ids)
        if held is not None:  # what the forward keeps for backward (saved activations, logits, loss)
            memory["held_by_forward_gib"] = (torch.cuda.memory_allocated() - held) / 2**30
        peak = phase_end("forward")
        accelerator.backward(loss)
        peak = max(peak, phase_end("backward"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_peaks.append(round(max(peak, phase_end("optimizer")), 3))
        return loss.item()  # synchronises

    times, losses = [], []
    report = None
    for i, ids in enumerate(data):
        t0 = time.perf_counter()
        if peak_path is not None and i == peak_step:  # this step of the run traced (its time with the tracer's cost)
            from peak_memory import record_step

            report = record_step(lambda ids=ids, i=i: losses.append(step(ids, first=i == 0)), peak_path)
        else:
            losses.append(step(ids, first=i == 0))
        times.append(time.perf_counter() - t0)
        if i == 0 and cuda:
            memory["after_first_step_gib"] = torch.cuda.memory_allocated() / 2**30
    median = statistics.median(times[warmup:])
    result = {
        "mode": mode,
        "step_ms_median": 1000 * median,
        "step_ms": [round(1000 * t, 3) for t in times],
        "tokens_per_s": data[0].numel() / median,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "peak_gib": max(phase_peaks.values()) if cuda else None,
        "peak_by_phase_gib": dict(phase_peaks) if cuda else None,
        "timed_peak_gib": timed_peak[0] if cuda else None,
        "step_peaks_gib": step_peaks if cuda else None,
        **memory,
    }
    if profile_path is not None:  # after the timed steps and the peaks: neither includes the profiler's cost
        from widths import profile_steps

        result["profile"] = profile_steps(step, data[:profile_n], cuda, profile_path)
        from call_sites import record_call_sites  # and one step more: whose operators, with which inputs

        sites_path = profile_path.removesuffix(".prof.txt") + ".sites.txt"
        result["call_sites"] = record_call_sites(step, data[0], cuda, sites_path, top=15)["by_site"]
    if peak_path is not None and peak_step is None:  # one more step traced: what is live at its peak, and from where
        from peak_memory import record_step

        report = record_step(lambda: step(data[0]), peak_path)
    if peak_path is not None:
        result["peak_report"] = report
    inner = accelerator.unwrap_model(model, keep_torch_compile=False)
    storage = activation_storage(inner)
    if storage is not None:  # FP8 activations: through Python hooks or inside the compiled graphs
        result["activations_in_graph"] = storage.in_graph
    # of the model that runs (regional compilation runs a copy of `inner`)
    runs = next(m for m in models_of(model) if hasattr(type(m), "loss_function"))
    result["loss_function"] = f"{runs.loss_function.__module__}.{runs.loss_function.__qualname__}"
    linears = [m for m in inner.modules() if isinstance(m, nn.Linear) or type(m).__name__ == "Linear"]
    result["linears"] = len(linears)
    plan = getattr(accelerator, "precision_plan", None)
    if plan is not None:
        result["backend"] = plan.backend
        result["recipe"] = plan.recipe
        result["linears"] = sum(m.kind == "linear" for m in plan.modules)  # msamp's FP8 layers are no nn.Linear
        result["fp8_linears"] = sum(m.convert for m in plan.modules if m.kind == "linear")
        result["converted_norms"] = sum(m.convert for m in plan.modules if m.kind != "linear")
        result["kept"] = sorted({f"{m.shape}: {m.reason}" for m in plan.modules if not m.convert})
        result["notes"] = list(plan.notes)
        result["model_mode"], result["choice"] = plan.model_mode, plan.choice
        if recipe is not None and recipe.backend == "auto":
            result["auto"] = _auto_reasons(recipe, accelerator.run_context())
    elif spec == "raw te":
        result["backend"], result["recipe"] = "raw te", "delayed"
        result["fp8_linears"] = sum(type(m).__module__.startswith("transformer_engine") for m in linears)
    else:
        result["fp8_linears"] = 0
    return result


def _cleanup() -> None:
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _left_allocated_gib(before: int) -> float:
    """CUDA memory a finished configuration left allocated beyond what was there before it (0 on CPU): the next
    configurations' peaks would include it (steps in backward once kept 13.9 GiB of its model alive, and every
    configuration after it in the same call looked that much worse)."""
    return max(torch.cuda.memory_allocated() - before, 0) / 2**30 if torch.cuda.is_available() else 0.0


def _ratios(runs: dict) -> None:
    """Each configuration's speed and peak memory against BF16 of its mode (eager or compiled), where measured."""
    for label, r in runs.items():
        base = runs.get(f"bf16 {r.get('mode')}")
        if label.startswith("bf16") or not base or "step_ms_median" not in base or "step_ms_median" not in r:
            continue
        r["speedup_vs_bf16"] = base["step_ms_median"] / r["step_ms_median"]
        if base.get("peak_gib") and r.get("peak_gib"):
            r["peak_vs_bf16"] = r["peak_gib"] / base["peak_gib"]
        if base.get("timed_peak_gib") and r.get("timed_peak_gib"):
            r["timed_peak_vs_bf16"] = r["timed_peak_gib"] / base["timed_peak_gib"]


def markdown(results: dict) -> str:
    rows = ["| width | configuration | backend (recipe) | step ms | vs BF16 (same mode) | peak GiB | vs BF16 peak | "
            "FP8 Linears |", "|---|---|---|---|---|---|---|---|"]
    for width, runs in results["widths"].items():
        for label, r in runs.items():
            if "step_ms_median" not in r:
                rows.append(f"| {width} | {label} | error: {r.get('error', '')[:120]} | | | | | |")
                continue
            backend = f"{r.get('backend', 'bf16')}" + (f" ({r['recipe']})" if r.get("recipe") else "")
            speed = f"{r['speedup_vs_bf16']:.3f}" if "speedup_vs_bf16" in r else "-"
            peak = f"{r['peak_gib']:.2f}" if r.get("peak_gib") is not None else "-"
            mem = f"{r['peak_vs_bf16']:.3f}" if "peak_vs_bf16" in r else "-"
            rows.append(f"| {width} | {label} | {backend} | {r['step_ms_median']:.2f} | {speed} | {peak} | {mem} | "
                        f"{r['fp8_linears']}/{r['linears']} |")
    return "\n".join(rows)


def _width(text: str) -> str:
    dims(text)
    return text


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--summarize"]:
        for path in argv[1:]:
            with open(path) as fh:
                print(markdown(json.load(fh)))
        return {}
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--widths", nargs="+", default=["d4096"], type=_width,
                   help=f"{', '.join(WIDTHS)}, or one of them with xN blocks (d4096x12)")
    p.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, choices=list(CONFIGS),
                   help="BF16 of a mode must come before the configurations compared with it")
    p.add_argument("--steps", type=int, default=MSAMP_WINDOW + 12)
    p.add_argument("--warmup", type=int, default=MSAMP_WINDOW + 4,
                   help=f"steps left out of the timing; below {MSAMP_WINDOW} an msamp configuration's timed steps "
                        "include its warm-up (current scales), and its steps' peaks may all be the warm-up's")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the configurations this many times, in ABBA order (as given, reversed, ...); step times "
                        "and ratios from the median over rounds (a first run in the process can pay one-off costs)")
    p.add_argument("--out", required=True)
    p.add_argument("--profile-dir", help="write a torch.profiler kernel table per profiled configuration here")
    p.add_argument("--profile-configs", nargs="*", choices=list(CONFIGS),
                   help="the configurations to profile (default: every one run; none given: none, for "
                        "--peak-configs alone)")
    p.add_argument("--profile-steps", type=int, default=2, help="profiled steps after the timed ones")
    p.add_argument("--peak-configs", nargs="+", choices=list(CONFIGS),
                   help="trace one more step's allocations of these configurations: what is live at the step's peak, "
                        "by allocating line (peak_memory.py), in --profile-dir as WIDTH_LABEL.peak.txt")
    p.add_argument("--peak-step", type=int,
                   help="with --peak-configs: trace this step of the run (0 = the first) instead of one more after it, "
                        f"e.g. msamp's switch to its delayed-scaling graph at step {MSAMP_WINDOW}, where its highest "
                        "peak came")
    p.add_argument("--memory-gib", type=float,
                   help="cap this process's CUDA allocator at this many GiB (torch.cuda."
                        "set_per_process_memory_fraction): a smaller GPU's memory on a larger one, for largest_model")
    args = p.parse_args(argv)
    if args.steps <= args.warmup:
        p.error("--steps must exceed --warmup")
    if args.peak_step is not None and not (args.peak_configs and 0 <= args.peak_step < args.steps):
        p.error(f"--peak-step {args.peak_step}: give it with --peak-configs, a step from 0 to --steps - 1 "
                f"({args.steps - 1})")
    if args.warmup < MSAMP_WINDOW and any(uses_msamp(c) for c in args.configs):
        print(f"headline: warning: --warmup {args.warmup} < {MSAMP_WINDOW}: msamp's timed steps include its warm-up "
              "(current scales, a compiled graph of their own)", file=sys.stderr)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.profile_steps < 1:
        p.error("--profile-steps must be at least 1")
    if (args.profile_configs is not None or args.peak_configs) and not args.profile_dir:
        p.error("--profile-configs and --peak-configs need --profile-dir")
    if args.profile_dir:
        os.makedirs(args.profile_dir, exist_ok=True)
    cuda = torch.cuda.is_available()
    if args.memory_gib is not None:
        if not cuda:
            p.error("--memory-gib caps a CUDA device's memory: no CUDA device here")
        total = torch.cuda.get_device_properties(0).total_memory / 2**30
        if not 0 < args.memory_gib <= total:
            p.error(f"--memory-gib must be in (0, {total:.2f}] (this device's memory in GiB), got {args.memory_gib}")
        torch.cuda.set_per_process_memory_fraction(args.memory_gib / total)
    # LOWPREC_COMMIT first (verify.sh and memory.sh set it): the device's copy of the tree may carry a stale .git,
    # whose HEAD was an older commit's (results/gpu/2026-11-27-h200-memory-62ecff5)
    commit = os.environ.get("LOWPREC_COMMIT", "")
    try:
        commit = commit or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        pass
    results: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
                     "commit": commit, "argv": argv, "steps": args.steps, "warmup": args.warmup,
                     "memory_gib": args.memory_gib, "widths": {}}
    for name in ("accelerate", "torchao", "transformer_engine"):
        try:
            results[name] = __import__(name).__version__
        except Exception as exc:  # noqa: BLE001 - recorded; the configurations that need it fail alone
            results[name] = f"unavailable: {type(exc).__name__}"
    for width in args.widths:
        runs = results["widths"][width] = {}
        g = torch.Generator().manual_seed(0)
        data = [torch.randint(0, VOCAB, (BATCH, SEQ) if not width.startswith("tiny") else (2, 64), generator=g)
                for _ in range(args.steps)]
        for round_ in range(args.rounds):
            order = args.configs if round_ % 2 == 0 else args.configs[::-1]
            for label in order:
                if round_ and "step_ms_median" not in runs[label]:
                    continue  # failed once: more rounds would not change that
                profile_path = peak_path = None
                stem = os.path.join(args.profile_dir or "", f"{width}_{label.replace(' ', '_')}")
                if args.profile_dir and round_ == 0 and label in (args.configs if args.profile_configs is None
                                                                         else args.profile_configs):
                    profile_path = stem + ".prof.txt"
                if round_ == 0 and label in (args.peak_configs or ()):
                    peak_path = stem + ".peak.txt"
                before = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
                try:
                    r = run_one(label, width, data, args.warmup, profile_path, args.profile_steps, peak_path,
                                args.peak_step)
                except Exception as exc:  # noqa: BLE001 - one configuration failing must not lose the others
                    r = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
                _cleanup()
                left = _left_allocated_gib(before)
                if left > LEFT_ALLOCATED_LIMIT_GIB:
                    r["left_allocated_gib"] = left
                    print(f"warning: {label} left {left:.2f} GiB allocated after its run: the peaks of the "
                          "configurations after it in this call include it", file=sys.stderr, flush=True)
                if round_:
                    first = runs[label]
                    if "left_allocated_gib" in r:
                        first["left_allocated_gib"] = max(first.get("left_allocated_gib", 0), r["left_allocated_gib"])
                    first["rounds_ms"].append(r["step_ms_median"])
                    first["step_ms_median"] = statistics.median(first["rounds_ms"])
                    first["rounds_peak_gib"].append(r.get("peak_gib"))  # each round's: a round's rise shows
                    first["peak_gib"] = max(first["peak_gib"] or 0, r.get("peak_gib") or 0) or None
                    timed = max(first.get("timed_peak_gib") or 0, r.get("timed_peak_gib") or 0)
                    first["timed_peak_gib"] = timed or None
                else:
                    if "step_ms_median" in r:
                        r["rounds_ms"], r["rounds_peak_gib"] = [r["step_ms_median"]], [r.get("peak_gib")]
                    runs[label] = r
                _ratios(runs)
                with open(args.out, "w") as fh:  # after every run: a time limit keeps what finished
                    json.dump(results, fh, indent=1)
                print(f"{width} {label} (round {round_}): " + (f"{r['step_ms_median']:.2f} ms, peak {r.get('peak_gib')}"
                                                               f", timed steps' peak {r.get('timed_peak_gib')}"
                                                               if "step_ms_median" in r else r["error"][:300]),
                      flush=True)
    print(markdown(results))
    return results


if __name__ == "__main__":
    main()
