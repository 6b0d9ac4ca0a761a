"""What the device can do in FP8: hardware GEMMs, or emulation."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DeviceInfo:
    """The accelerator lowprec plans for. `capability` is None for a CPU (or unknown) device."""

    type: str
    name: str
    capability: tuple[int, int] | None

    @property
    def fp8_gemm(self) -> bool:
        """True when the device runs FP8 tensor-core GEMMs (Ada SM 8.9 and newer)."""
        return self.type == "cuda" and self.capability is not None and self.capability >= (8, 9)

    @property
    def is_hopper_or_newer(self) -> bool:
        return self.type == "cuda" and self.capability is not None and self.capability >= (9, 0)

    @property
    def is_blackwell_or_newer(self) -> bool:
        return self.type == "cuda" and self.capability is not None and self.capability >= (10, 0)

    def describe(self) -> str:
        if self.type == "cuda" and self.capability is not None:
            return f"{self.name} (sm_{self.capability[0]}{self.capability[1]})"
        return self.name


def device_info(device: torch.device | str | None = None) -> DeviceInfo:
    """Describe `device` (default: the current CUDA device if any, else the CPU)."""
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        return DeviceInfo("cuda", torch.cuda.get_device_name(index), torch.cuda.get_device_capability(index))
    return DeviceInfo(device.type, device.type.upper(), None)


MAX_CAPABILITY_MAJOR = 15


def assumed_device(capability: str | None) -> DeviceInfo:
    """A device described by a compute capability string such as '9.0' (for planning elsewhere)."""
    if capability is None or capability.lower() == "cpu":
        return DeviceInfo("cpu", "CPU", None)
    try:
        major, minor = (int(x) for x in capability.split("."))
        # CUDA's minor is one digit (sm_90, sm_120); a major past 15 is no GPU yet made (Blackwell's are 10 and 12)
        if not 1 <= major <= MAX_CAPABILITY_MAJOR or not 0 <= minor <= 9:
            raise ValueError
    except ValueError:
        raise ValueError(
            f"capability={capability!r} is not of the form MAJOR.MINOR with MAJOR from 1 to {MAX_CAPABILITY_MAJOR} "
            "and MINOR one digit (e.g. '9.0' for H100, '8.9' for L4, '10.0' for B200) or 'cpu'"
        ) from None
    return DeviceInfo("cuda", "assumed GPU", (major, minor))
