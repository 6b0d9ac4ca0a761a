"""Where a model will train (`RunContext`), and the error a backend raises when it cannot run there."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..planning.engines import EnginePrecision, default_engine_precision
from ..planning.hardware import DeviceInfo


class BackendUnavailableError(RuntimeError):
    """The selected backend cannot run here (package missing, not in this version, or hardware)."""


@dataclass(frozen=True)
class RunContext:
    """Where the model will train: the facts a plan depends on besides the model itself."""

    device: DeviceInfo
    engine: str = "single"  # "single", "ddp", "fsdp2", "deepspeed", "fsdp1"
    world_size: int = 1
    # The hosts (machines) those processes run on: gradients crossing between hosts go over a network link many
    # times slower than the NVLink between one host's GPUs, which decides msamp O3's reduce-scatter dtype under FSDP2
    hosts: int = 1
    compiled: bool = False  # the model will run under torch.compile
    # Where `compiled` comes from, when not from this run's own arguments (an AcceleratorState an earlier
    # Accelerator of the process set up): the plan says so, since the user did not ask for it here.
    compile_source: str = ""
    # What the engine does with precision; None: what Accelerate gives the engine by default.
    precision: EnginePrecision | None = None

    ENGINES: ClassVar[tuple[str, ...]] = ("single", "ddp", "fsdp2", "deepspeed", "fsdp1")

    def __post_init__(self):
        if self.engine not in self.ENGINES:
            raise ValueError(f"RunContext.engine={self.engine!r} is not one of {self.ENGINES}")
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"RunContext.world_size={self.world_size!r} must be an integer >= 1 (the processes "
                             "training together)")
        if (isinstance(self.hosts, bool) or not isinstance(self.hosts, int) or not 1 <= self.hosts <= self.world_size):
            raise ValueError(f"RunContext.hosts={self.hosts!r} must be an integer from 1 to world_size="
                             f"{self.world_size} (the machines the processes run on)")

    @property
    def engine_precision(self) -> EnginePrecision:
        return self.precision if self.precision is not None else default_engine_precision(self.engine)
