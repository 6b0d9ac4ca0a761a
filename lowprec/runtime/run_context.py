"""The RunContext an Accelerator's plans are made for: device, distributed engine and the engine's own
precision, world size, and whether the model is compiled (by a dynamo setting an earlier Accelerator left, too)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
from accelerate.utils import DistributedType, DynamoBackend

from ..backends import RunContext
from ..planning.engines import EnginePrecision, deepspeed_precision, fsdp_precision
from ..planning.hardware import device_info

if TYPE_CHECKING:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState


def run_context_of(accelerator: Accelerator, compile_source: str) -> RunContext:
    """The context of `accelerator`'s run; `compile_source` says what compiles the model where its own
    arguments did not ask for that."""
    engines = {
        DistributedType.NO: "single",
        DistributedType.MULTI_GPU: "ddp",
        DistributedType.MULTI_CPU: "ddp",
        DistributedType.MULTI_XPU: "ddp",
        DistributedType.DEEPSPEED: "deepspeed",
    }
    if accelerator.distributed_type == DistributedType.FSDP:
        if getattr(accelerator.state, "fsdp_plugin", None) is None:
            # Accelerate writes FSDP back into PartialState's shared state; an AcceleratorState made over that after
            # AcceleratorState._reset_state() skips the branch that keeps its plugin (is_fsdp2 then raises a bare
            # AttributeError): the engine cannot be known, so neither can the plan
            raise ValueError(
                "lowprec: Accelerate's state says distributed_type=FSDP but holds no fsdp_plugin: an Accelerator was "
                "built after AcceleratorState._reset_state(reset_partial_state=False) in a process whose earlier "
                "Accelerator used FSDP (Accelerate keeps that engine in PartialState). Call "
                "AcceleratorState._reset_state(reset_partial_state=True) before building it, or run each "
                "configuration in its own process"
            )
        engine = "fsdp2" if accelerator.is_fsdp2 else "fsdp1"
    elif accelerator.distributed_type in engines:
        engine = engines[accelerator.distributed_type]
    else:
        raise ValueError(
            f"lowprec FP8 does not support distributed_type={accelerator.distributed_type.value!r}; "
            "use single-process, DDP (multi-GPU), FSDP or DeepSpeed"
        )
    state = accelerator.state
    compiled = state.dynamo_plugin is not None and state.dynamo_plugin.backend != DynamoBackend.NO
    processes = accelerator.num_processes
    return RunContext(device=device_info(accelerator.device), engine=engine, world_size=processes,
                      hosts=hosts_of(processes), compiled=compiled, compile_source=compile_source if compiled else "",
                      precision=engine_precision(state, engine))


def hosts_of(world_size: int) -> int:
    """The machines `world_size` processes run on, from the launcher's LOCAL_WORLD_SIZE (torchrun's, and so
    `accelerate launch`'s: the processes on this machine); 1 where it is not set (a launcher without it: name
    `grad_comm_dtype` there). Every rank must reach the same answer to "one host or several" (the gradient
    collectives follow it), and each sees only its own machine's count: one host is LOCAL_WORLD_SIZE ==
    WORLD_SIZE on every rank, several hosts LOCAL_WORLD_SIZE < WORLD_SIZE on every rank, whatever the machines'
    counts (4 + 2 processes: 2 on the first machine, 3 on the second; both more than 1)."""
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    except ValueError:
        return 1
    if local < 1 or local >= world_size:
        return 1
    return max(2, world_size // local)


def engine_plugin(state: AcceleratorState, engine: str):
    """Accelerate's plugin for `engine` (FSDP or DeepSpeed), or None."""
    if engine in ("fsdp2", "fsdp1"):
        return state.fsdp_plugin
    if engine == "deepspeed":
        return state.deepspeed_plugin
    return None


def engine_precision(state: AcceleratorState, engine: str) -> EnginePrecision | None:
    """The dtypes the engine's own plugin will apply (None: nothing beyond the defaults)."""
    plugin = engine_plugin(state, engine)
    if plugin is None:
        return None
    if engine == "deepspeed":
        return deepspeed_precision(plugin.deepspeed_config)
    return fsdp_precision(plugin.mixed_precision_policy)


def inherited_dynamo(kwargs: dict[str, Any]) -> tuple[str, str] | None:
    """The dynamo backend an earlier Accelerator of this process left in Accelerate's shared AcceleratorState,
    where it differs from what these Accelerator arguments ask for; None where they agree (or nothing is left).

    Accelerate keeps the first AcceleratorState of a process and ignores a later Accelerator's dynamo settings:
    an Accelerator built after a compiled one compiles its model too, silently. lowprec plans by whether the
    model is compiled (speed rules, auto's order), so a run measured as "eager" would get the compiled plan.
    Raises ValueError where the arguments name a dynamo setting explicitly, as Accelerate does for
    mixed_precision; returns (inherited, asked) where they leave it to the default (ACCELERATE_DYNAMO_BACKEND).
    """
    from accelerate.state import AcceleratorState
    from accelerate.utils import TorchDynamoPlugin

    previous = AcceleratorState._shared_state.get("dynamo_plugin") if AcceleratorState._shared_state else None
    if previous is None:
        return None
    plugin, named = kwargs.get("dynamo_plugin"), kwargs.get("dynamo_backend")
    explicit = plugin is not None or named is not None
    if plugin is None:
        plugin = TorchDynamoPlugin(backend=named) if named is not None else TorchDynamoPlugin()
    if plugin.backend == previous.backend:
        return None
    was, asked = previous.backend.value, plugin.backend.value
    if explicit:
        raise ValueError(
            f"lowprec: this Accelerator asks for dynamo_backend={asked}, but an earlier Accelerator in this process "
            f"set dynamo_backend={was}, and Accelerate keeps the first (one AcceleratorState per process): it would "
            f"run {was} and ignore {asked}. Call accelerate.state.AcceleratorState._reset_state("
            "reset_partial_state=True) before building this Accelerator, or run it in its own process."
        )
    return was, asked


def split_launch_warning(num_processes: int) -> str | None:
    """What to tell rank 0 when the launcher started several processes but Accelerate runs each as a job of its own.

    `accelerate launch --multi_gpu` (or a config file's `distributed_type: MULTI_GPU`, as examples/configs/ddp.yaml)
    on a host without GPUs starts N processes under torchrun, and each Accelerate state finds no GPU and no `cpu`
    flag: distributed_type NO, num_processes 1, process_index 0, while torch.distributed is initialised with N
    ranks (checked against accelerate 1.15). Nothing fails; N copies train apart, each its own main process.
    None where Accelerate's process count agrees with the launcher's, or on ranks other than 0."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        launched, rank = dist.get_world_size(), dist.get_rank()
    else:
        try:
            launched, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
        except ValueError:
            return None
    if launched <= 1 or num_processes != 1 or rank != 0:
        return None
    message = (f"lowprec: the launcher started {launched} processes (WORLD_SIZE={launched}), but Accelerate runs each "
               "as a job of its own (distributed_type NO, num_processes 1)")
    if torch.cuda.is_available():
        return message + (f": the {launched} processes train apart, with no gradient averaging. Check the launch "
                          "command and the Accelerator's arguments (cpu=...)")
    return message + (
        f": this host has no GPU, which `accelerate launch --multi_gpu` (a config's distributed_type: MULTI_GPU) "
        f"needs. The {launched} processes train apart, with no gradient averaging, each its own main process: every "
        f"print, log line and checkpoint comes {launched} times. To train them as one job on CPU, launch with "
        f"ACCELERATE_USE_CPU=1 in the environment (`ACCELERATE_USE_CPU=1 accelerate launch ...`, or "
        f"`ACCELERATE_USE_CPU=1 torchrun --nproc_per_node {launched} ...`: Accelerate's MULTI_CPU over gloo) or pass "
        "cpu=True to the Accelerator; `accelerate launch --cpu` starts one process, and `use_cpu: true` in the config "
        "file does not reach a multi-GPU launch. For one process, launch with --num_processes 1.")
