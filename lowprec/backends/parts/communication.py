"""Communication precision, the part adapters share (msamp's extends it): `grad_comm_dtype` hooks, the engine's rows."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ...planning.engines import BYTES, GRAD_COMM_MEANS, comm_dtype_name, grad_comm_problem
from ..context import BackendUnavailableError

if TYPE_CHECKING:
    from ...planning.plan import PrecisionPlan, TensorPrecision
    from .owner import Owner


# benchmarks/fp8_comm.py on two H200s of one host, the d4096 proxy's 973 M gradient elements
# (results/gpu/2026-11-27-h200x2-codec-55c8b60/fp8_comm.json)
FP8_COMM_ONE_HOST_NOTE = (
    "grad_comm_dtype='fp8' on one host: FP8 halves the bytes but not the time over NVLink (two H200s, the d4096 "
    "proxy's gradients: DDP's FP8 hook 246 ms against BF16's 20, FSDP2's FP8 reduce-scatter 10.3 ms against BF16's "
    "4.6); grad_comm_dtype='bf16' is faster there. FP8 is for links between hosts"
)


class GradientCommunication:
    """How gradients travel between ranks, and what the engine does to weights and master weights.

    The engine hooks (`engine_config_problem`, `before_engine_prepare`, `after_backward`) do nothing here:
    the shared part needs no more than the engines' own settings and the hooks `install` puts in place."""

    def __init__(self, owner: Owner):
        self.owner = owner
        self.state = None  # the FP8 DDP hook's (or FSDP2 reduce-scatter's) state, once installed

    @property
    def choice(self) -> str | None:
        """The gradient-communication dtype in force: `grad_comm_dtype` as the recipe names it."""
        return self.owner.recipe.grad_comm_dtype

    def check(self) -> None:
        """Raise `BackendUnavailableError` where the engine cannot send gradients in the dtype in force."""
        problem = grad_comm_problem(self.choice, self.owner.context.engine)
        if problem is not None:
            raise BackendUnavailableError(problem)

    def install(self, model: nn.Module) -> None:
        """Put in place the gradient communication `grad_comm_dtype` asks for: a communication hook on
        the DDP wrapper, or FP8 reduce-scatters on FSDP2's sharded modules. (FP32/BF16 under FSDP and
        DeepSpeed are the engines' own settings, applied before they wrap: `engines.apply_grad_comm_dtype`.)"""
        choice = self.choice
        engine = self.owner.context.engine
        if choice == "fp8" and engine == "fsdp2":
            from ...optim.comm_hooks import install_fp8_reduce_scatter

            owner = self.owner
            self.state = install_fp8_reduce_scatter(model, holds_fp8=lambda m: owner.converted_kind(m) == "linear")
            return
        if choice is None or engine != "ddp":
            return
        ddp = model if isinstance(model, nn.parallel.DistributedDataParallel) else getattr(model, "_orig_mod", None)
        if not isinstance(ddp, nn.parallel.DistributedDataParallel):
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                raise RuntimeError(f"lowprec: grad_comm_dtype={choice!r} needs the DDP wrapper to hook, and "
                                   f"prepare() returned {type(model).__name__}")
            return  # one process: nothing is communicated
        from ...optim.comm_hooks import FP8CommState, bf16_allreduce_hook, fp8_allreduce_hook, fp32_allreduce_hook

        if choice == "fp8":
            self.state = FP8CommState(ddp.process_group)
            ddp.register_comm_hook(self.state, fp8_allreduce_hook)
        else:
            hook = bf16_allreduce_hook if choice == "bf16" else fp32_allreduce_hook
            ddp.register_comm_hook(ddp.process_group, hook)

    def notes(self) -> list[str]:
        """What the printed plan says of the gradient communication in force."""
        context = self.owner.context
        one_host = context.hosts == 1 and context.world_size > 1
        if self.choice == "fp8" and context.engine in ("ddp", "fsdp2") and one_host:
            return [FP8_COMM_ONE_HOST_NOTE]
        return []

    def engine_config_problem(self, config: dict) -> str | None:
        """Why the backend cannot run under the engine's configuration (a DeepSpeed config dict), or None."""
        return None

    def before_engine_prepare(self, objects: list, accelerator=None) -> None:
        """Adjust, in place, what Accelerate's `prepare()` is about to wrap."""

    def after_engine_prepare(self) -> None:
        """Undo what `before_engine_prepare` changed outside the objects prepared; runs whether Accelerate's
        `prepare()` returned or raised."""

    def after_backward(self, sync_gradients: bool) -> None:
        """Called by `Accelerator.backward` after the storage part's `after_backward`; `sync_gradients` is
        False inside accumulation windows."""

    def rows(self, plan: PrecisionPlan) -> list[TensorPrecision]:
        """The gradient-communication, weight, master-weight and weight-gradient rows of `plan` as the
        engine realises them (the storage part then changes what its knobs change)."""
        from ...planning.plan import TensorPrecision

        hp = plan.param_dtype
        return [*self.engine_rows(hp, fp8_gather=self.owner.gathers_fp8_weights),
                TensorPrecision("weight_grad", self.owner.context.engine_precision.weight or hp)]

    def engine_rows(self, hp: str, *, fp8_gather: bool = False) -> list[TensorPrecision]:
        """The gradient-communication, weight and master-weight rows as the engine realises them.

        `hp` is the parameters' dtype; `fp8_gather` says the backend all-gathers weights in FP8.
        """
        from ...planning.plan import TensorPrecision

        context = self.owner.context
        ep = context.engine_precision
        why = f"from {ep.source}" if ep.source else ""
        choice = self.choice
        if context.engine == "single":
            comm = TensorPrecision("grad_comm", "N/A (one process)")
        elif choice is not None:
            comm = TensorPrecision("grad_comm", comm_dtype_name(choice, context.engine),
                                   f"grad_comm_dtype={choice!r}: {GRAD_COMM_MEANS[context.engine, choice]}")
        else:
            comm = TensorPrecision("grad_comm", ep.grad_reduce or hp, why if ep.grad_reduce else "")
        weight = ep.weight or hp
        if fp8_gather:
            weight = f"{weight} (all-gathered as FP8 E4M3)"
        elif ep.param_gather and ep.param_gather != weight:
            weight = f"{weight} (all-gathered as {ep.param_gather})"
        master = TensorPrecision("master_weight", f"{ep.master_weight} ({context.engine})" if ep.master_weight
                                 else "N/A", why if ep.master_weight else "")
        return [comm, TensorPrecision("weight", weight, why if weight != hp else ""), master]

    def state_bytes(self, param_dtype: torch.dtype) -> dict[str, float]:
        """Bytes per parameter the engine changes: DeepSpeed's BF16 weights/grads + FP32 masters."""
        ep = self.owner.context.engine_precision
        out: dict[str, float] = {}
        if ep.weight is not None:
            out["weight"] = out["weight_grad"] = float(BYTES.get(ep.weight, param_dtype.itemsize))
        if ep.master_weight is not None:
            out["master_weight"] = float(BYTES.get(ep.master_weight, 4))
        return out
