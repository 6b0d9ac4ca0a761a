"""`PrecisionPlan`: a recipe applied to a model, as one row of the precision table.

The plan is data: `lowprec.runtime.planner.build_plan` asks a backend adapter to fill it in. This module
imports no adapter, so the adapters can use its types.
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from .activations import SavedActivations
from .engines import fsdp_shards
from .selection import BLOCK_RULES, ModuleDecision, block_reason_key, blocks_label, number_runs

log = logging.getLogger(__name__)

# The columns of the comparison table (DESIGN.md), in order.
TENSOR_KINDS: OrderedDict[str, str] = OrderedDict(
    [
        ("gemm", "GEMM"),
        ("grad_comm", "comm (grads)"),
        ("weight", "weight"),
        ("master_weight", "master weight"),
        ("weight_grad", "weight grad"),
        ("optimizer_states", "optimizer states"),
    ]
)


# Below half of the Linear parameters in FP8, most GEMM work (2 FLOPs per Linear parameter and
# token) stays in high precision: even FP8 GEMMs twice as fast as BF16 would make the step at most
# 1.33x faster, so the run is mostly a BF16 run paying FP8's casts, which nobody asks for on purpose.
LOW_FP8_SHARE = 0.5


class PlanMismatchError(RuntimeError):
    """The model that was built does not match its plan (a module silently not converted, or the reverse)."""


@dataclass(frozen=True)
class TensorPrecision:
    """How one tensor kind is stored or computed. `dtype` is short: 'FP8 E4M3', 'FP32', 'N/A'."""

    kind: str
    dtype: str
    scaling: str = ""


def short_dtype(dtype: torch.dtype) -> str:
    return {
        torch.float32: "FP32",
        torch.float16: "FP16",
        torch.bfloat16: "BF16",
        torch.float64: "FP64",
        torch.float8_e4m3fn: "FP8 E4M3",
        torch.float8_e5m2: "FP8 E5M2",
    }.get(dtype, str(dtype).replace("torch.", ""))


@dataclass
class PrecisionPlan:
    """Recipe + model -> per-module decisions, per-tensor precision, model-state bytes per parameter.

    `print(plan)` shows it as the comparison table; `plan.to_dict()` is JSON-ready.
    """

    backend: str
    backend_display: str
    recipe: str
    fp8_format: str
    opt_level: str | None
    emulated: bool
    execution: str
    device: str
    engine: str
    world_size: int
    tensors: list[TensorPrecision]
    modules: list[ModuleDecision]
    param_dtype: str
    bytes_per_param: dict[str, float]
    total_params: int = 0
    options: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # How the model runs ("eager", or compiled and from where) and how the backend was chosen (by name, or
    # what backend='auto' chose and passed over): speed rules and auto's order depend on both.
    model_mode: str = ""
    choice: str = ""
    # What the forward keeps for backward (the Linear inputs estimated per token): planning/activations.py
    activations: SavedActivations | None = None

    # ---- queries ----------------------------------------------------------------------------
    @property
    def converted(self) -> list[ModuleDecision]:
        return [m for m in self.modules if m.convert]

    @property
    def skipped(self) -> list[ModuleDecision]:
        return [m for m in self.modules if not m.convert]

    @property
    def fp8_linear_param_fraction(self) -> float:
        linears = [m for m in self.modules if m.kind == "linear"]
        total = sum(m.params for m in linears)
        return sum(m.params for m in linears if m.convert) / total if total else 0.0

    @property
    def fp8_param_share(self) -> float:
        """Share of all model parameters that are weights of converted (FP8) Linear layers."""
        # weights only: a converted layer's bias keeps its dtype and gradient
        converted = sum(m.shape[0] * m.shape[1] if len(m.shape) == 2 else m.params
                        for m in self.modules if m.kind == "linear" and m.convert)
        return converted / self.total_params if self.total_params else 0.0

    def shortfall(self) -> list[str]:
        """Why few or no Linear layers run in FP8: a headline, then one line per rule that kept layers
        out (with counts and the option that would convert them). Empty when at least
        `LOW_FP8_SHARE` of the Linear parameters are in FP8, or the model has no Linear layer."""
        linears = [m for m in self.modules if m.kind == "linear"]
        if not linears or self.fp8_linear_param_fraction >= LOW_FP8_SHARE:
            return []
        converted = sum(m.convert for m in linears)
        if not converted:
            head = (f"no Linear layer (of {len(linears)}) runs in FP8 on {self.device}: "
                    "every GEMM stays in high precision")
        else:
            head = (f"only {converted} of {len(linears)} Linear layers run in FP8 on {self.device} "
                    f"({100 * self.fp8_linear_param_fraction:.1f}% of Linear parameters, under "
                    f"{100 * LOW_FP8_SHARE:.0f}%): most GEMMs stay in high precision, so FP8 gains little")
        # Grouped by what would convert them, so each line is one change to make (exclude: per pattern).
        groups: OrderedDict[tuple[str, str], list[ModuleDecision]] = OrderedDict()
        for m in linears:
            if not m.convert:
                groups.setdefault((m.rule or m.reason, m.option), []).append(m)
        lines = [head + ". Kept in high precision:"]
        for (rule, option), kept in groups.items():
            reasons = list(dict.fromkeys(m.reason for m in kept))
            if rule == "skip_first_last" and len(reasons) > 1:
                label = "first and last Linear layers (skip_first_last=True)"
            elif rule in BLOCK_RULES and (blocks := blocks_label(reasons)) is not None:
                label = blocks
            else:
                label = reasons[0]
                if len(reasons) > 1:  # say how many layers the first reason covers, not only how many reasons
                    first = sum(m.reason == reasons[0] for m in kept)
                    others = len(reasons) - 1
                    label += (f" ({first} of them; the other {len(kept) - first} for {others} more reason"
                              f"{'s' if others > 1 else ''} like it)")
            count = f"{len(kept)} Linear layer{'s' if len(kept) > 1 else ''}"
            lines.append(f"  - {count}: {label}" + (f" -> {option}" if option else ""))
        return lines

    @property
    def model_state_bytes_per_param(self) -> float:
        return sum(self.bytes_per_param.values())

    @property
    def baseline_bytes_per_param(self) -> float:
        """Model-state bytes per parameter of the table's "BF16 AMP (baseline)" row: weight, gradient and two
        Adam moments in the model's own dtype (16 for an FP32 model, 8 for a BF16 one), per rank under FSDP, which
        shards them all."""
        whole = {"FP32": 16, "BF16": 8, "FP16": 8}.get(self.param_dtype, 16)
        return whole / self.world_size if fsdp_shards(self.engine, self.world_size) else whole

    def tensor(self, kind: str) -> TensorPrecision:
        return next(t for t in self.tensors if t.kind == kind)

    def verify(self, model: nn.Module, is_converted) -> None:
        """Check the built model against the plan; raise `PlanMismatchError` listing every difference."""
        modules = dict(model.named_modules())
        wrong = []
        for decision in self.modules:
            module = modules.get("" if decision.fqn == "<root>" else decision.fqn)
            if module is None:
                wrong.append(f"{decision.fqn}: planned but not found in the model")
            elif is_converted(module) != decision.convert:
                state = "FP8" if is_converted(module) else "high precision"
                planned = "FP8" if decision.convert else "high precision"
                wrong.append(f"{decision.fqn}: planned {planned}, built {state}")
        if wrong:
            raise PlanMismatchError("the converted model does not match its precision plan:\n  " + "\n  ".join(wrong))

    def verify_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Check the optimizer built in prepare() stores its states as the plan says."""
        from ..optim import LowBitAdamW
        from ..optim.levels import built_states

        base = getattr(optimizer, "optimizer", optimizer)
        built = built_states(base, self.param_dtype)
        planned = self.tensor("optimizer_states").dtype
        if isinstance(base, LowBitAdamW) and self.options.get("optimizer_states") is None:
            # The user passed a LowBitAdamW of their own and asked for no state precision: the plan
            # shows their choice rather than refusing it.
            self._show_user_states(base, built)
            return
        if built != planned:
            raise PlanMismatchError(
                f"the optimizer does not match its precision plan: optimizer states planned {planned}, built {built} "
                f"({type(base).__name__})"
            )

    def _show_user_states(self, optimizer, built: str) -> None:
        from ..optim.levels import state_bytes

        self.tensors = [t if t.kind != "optimizer_states" else
                        TensorPrecision("optimizer_states", built, "the LowBitAdamW passed to prepare()")
                        for t in self.tensors]
        group = optimizer.param_groups[0]
        self.bytes_per_param["optimizer_states"] = float(state_bytes((group["exp_avg_dtype"],
                                                                      group["exp_avg_sq_dtype"])))

    # ---- rendering --------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["model_state_bytes_per_param"] = self.model_state_bytes_per_param
        out["fp8_linear_param_fraction"] = self.fp8_linear_param_fraction
        out["shortfall"] = self.shortfall()
        return out

    def table(self) -> str:
        """The comparison-table rows: a BF16 AMP baseline and this plan."""
        header = ["level", *TENSOR_KINDS.values(), "bytes/param"]
        base_bytes = self.baseline_bytes_per_param
        baseline = ["BF16 AMP (baseline)", "BF16", self.param_dtype, self.param_dtype, "N/A", self.param_dtype,
                    f"{self.param_dtype}+{self.param_dtype}", f"{base_bytes:g}"]
        level = f"{self.backend}:{self.recipe}" + (f" {self.opt_level}" if self.opt_level else "")
        row = [f"this plan ({level})", *(self.tensor(k).dtype for k in TENSOR_KINDS),
               f"{self.model_state_bytes_per_param:.3g}"]
        widths = [max(len(r[i]) for r in (header, baseline, row)) for i in range(len(header))]

        def fmt(cells):
            return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

        return "\n".join([fmt(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", fmt(baseline), fmt(row)])

    def summary(self, model: str = "", full: str = "print(accelerator.precision_plan)") -> str:
        """Four lines: what runs in FP8, where, how much, and `full`, where the whole table is.

        `prepare()` prints this once per model; `str(plan)` is the full table. `model` names the model
        (its class), `full` how to see the table from where the summary is read."""
        linears = [m for m in self.modules if m.kind == "linear"]
        norms = [m for m in self.modules if m.kind != "linear"]
        run = "one process" if self.engine == "single" and self.world_size == 1 else f"{self.engine} x{self.world_size}"
        how = "emulated (FP8 numerics, high-precision matmuls, no speed-up)" if self.emulated else "hardware FP8"
        layers = (f"{sum(m.convert for m in linears)} of {len(linears)} Linear layers in FP8 "
                  f"({100 * self.fp8_linear_param_fraction:.1f}% of Linear parameters)")
        if norms:
            layers += f", {sum(m.convert for m in norms)} of {len(norms)} norm layers replaced"
        rank = " per rank" if fsdp_shards(self.engine, self.world_size) else ""
        memory = (f"model state {self.model_state_bytes_per_param:.3g} bytes/param{rank} "
                  f"(BF16 AMP baseline {self.baseline_bytes_per_param:g})")
        return "\n".join([
            f"lowprec precision plan{f' for {model}' if model else ''}: backend {self.backend} "
            f"({self.backend_display}), recipe {self.recipe!r}, format {self.fp8_format}"
            + (f", memory level {self.opt_level}" if self.opt_level else ""),
            f"  where:  {run} on {self.device}, {how}",
            f"  layers: {layers}; {memory}",
            f"  {full} for the full table",
        ])

    def __str__(self) -> str:
        lines = [
            f"lowprec precision plan: backend {self.backend} ({self.backend_display}), recipe {self.recipe!r}, "
            f"format {self.fp8_format}" + (f", memory level {self.opt_level}" if self.opt_level else ""),
            f"  where:     {self.engine} x{self.world_size} on {self.device}",
            *([f"  model:     {self.model_mode}"] if self.model_mode else []),
            *([f"  backend:   {self.choice}"] if self.choice else []),
            f"  execution: {self.execution}",
            "",
            self.table(),
            "",
            "scaling:",
        ]
        lines += [f"  {TENSOR_KINDS[t.kind]:<17} {t.scaling}" for t in self.tensors if t.scaling]
        if self.activations is not None:
            lines += ["", *self.activations.lines()]
        linears = [m for m in self.modules if m.kind == "linear"]
        fp8_linears = [m for m in linears if m.convert]
        lines += [
            "",
            f"modules: {len(fp8_linears)} of {len(linears)} Linear layers in FP8 "
            f"({100 * self.fp8_linear_param_fraction:.1f}% of Linear parameters)",
        ]
        others = [m for m in self.modules if m.kind != "linear"]
        if others:
            lines.append(f"         {sum(m.convert for m in others)} of {len(others)} norm layers replaced")
        shortfall = self.shortfall()
        if shortfall:
            lines += [f"  WARNING: {shortfall[0]}"] + [f"  {line}" for line in shortfall[1:]]
        split = _patterns(self.converted) & _patterns(self.skipped)
        lines += _grouped("  FP8:", self.converted, split)
        lines += _grouped("  kept in high precision:", self.skipped, split)
        if self.notes:
            lines += ["", "notes:"] + [f"  - {n}" for n in self.notes]
        return "\n".join(lines)


def _pattern(fqn: str) -> str:
    return re.sub(r"\.\d+(?=\.|$)", ".*", fqn)


def _patterns(decisions: list[ModuleDecision]) -> set[str]:
    return {_pattern(d.fqn) for d in decisions}


def _indices(pattern: str, names: list[str]) -> str | None:
    """'{0,2-5}' for the layer numbers of `names` where `pattern` has one `*`, else None."""
    if pattern.count("*") != 1:
        return None
    before, after = pattern.split("*")
    return before + "{" + number_runs(int(n[len(before):len(n) - len(after)]) for n in names) + "}" + after


def _grouped(title: str, decisions: list[ModuleDecision], split: set[str] = frozenset()) -> list[str]:
    """Collapse repeated layers (model.layers.0.mlp.up, model.layers.1.mlp.up, ...) to one line.

    A pattern whose layers are split between FP8 and kept (`split`) shows which layers each line
    holds, and a lone member its own name: "model.layers.*.q_proj" on both lines would hide that.
    Modules kept with their whole block share a line across blocks ("blocks 0-1 of model.layers ...");
    their reasons differ only in the block number."""
    if not decisions:
        return []
    groups: OrderedDict[tuple[str, tuple, str], list[ModuleDecision]] = OrderedDict()
    for d in decisions:
        reason = block_reason_key(d.reason) if d.rule in BLOCK_RULES else d.reason
        groups.setdefault((_pattern(d.fqn), d.shape, reason), []).append(d)
    lines = [title]
    for (pattern, shape, reason), members in groups.items():
        names = [d.fqn for d in members]
        if members[0].rule in BLOCK_RULES:
            reason = blocks_label([d.reason for d in members]) or reason
        if len(names) == 1:
            name = names[0]
        elif pattern in split:
            name = _indices(pattern, names) or pattern
        else:
            name = pattern
        dims = f"{shape[1]}->{shape[0]}" if len(shape) == 2 else "x".join(str(s) for s in shape)
        label = f"{name} x{len(names)}" if len(names) > 1 else name
        lines.append(f"    {label:<48} {dims:>12}  {'' if reason == 'FP8' else reason}".rstrip())
    return lines
