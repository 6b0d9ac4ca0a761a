"""Which operators, with which inputs, from which Python lines, take a step's device time: one step under
torch.profiler with CPU activity, input shapes and Python stacks, its operators ranked by the device time of the
kernels each launched itself.

    from call_sites import record_call_sites
    record_call_sites(step, ids, cuda, "d4096_te_O2_act8.sites.txt")

Used by headline.py's `--profile-dir` beside each kernel table (`WIDTH_LABEL.prof.txt`): a kernel table says that a
copy kernel took 5 ms a step (te O2 act8's `direct_copy_kernel`, results/gpu/2026-11-28-h200-act8-peak-05e9f2d), not
whose copy it was, of which tensors. Without CUDA the operators are ranked by their own CPU time.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict

from peak_memory import MACHINERY  # frames that say how an operator ran, not what asked for it

# The profiler names a frame by its path below the sys.path entry it was imported from ("torchao/float8/x.py(130):
# forward"), so an installed library is told by its first part, not by a site-packages directory
LIBRARIES = frozenset({"torch", "torchao", "accelerate", "transformer_engine", "transformers", "triton", "deepspeed"})


def _machinery(frame: str) -> bool:
    return (any(m in frame for m in MACHINERY) or frame.split("/", 1)[0] in LIBRARIES
            or os.path.basename(frame.split("(", 1)[0]) == os.path.basename(__file__))


def asking_frames(stack: list[str], n: int = 3) -> list[str]:
    """The innermost `n` frames of a profiler stack ("file.py(line): function", innermost first) outside torch, the
    FP8 libraries, Accelerate, installed packages and this module; the innermost frames as they are where none is."""
    own = [frame for frame in stack if not _machinery(frame)]
    return (own or stack)[:n]


# the profiler's Python-function events (with_stack=True) are named "file.py(line): function"
_FRAME = re.compile(r".+\(\d+\): .+")


def by_shape(averages, attr: str, top: int = 30) -> list[dict]:
    """Operators of the key averages grouped by input shapes that took time of their own (`attr`: the kernels each
    launched itself, or its own CPU time), most first: name, ms and calls, input shapes."""
    rows = [{"name": e.key, "ms": getattr(e, attr) / 1000, "calls": e.count, "input_shapes": str(e.input_shapes)[:160],
             "sites": []}
            for e in averages if getattr(e, attr, 0) > 0 and e.input_shapes and not _FRAME.fullmatch(e.key)]
    return sorted(rows, key=lambda r: -r["ms"])[:top]


def by_site(events, attr: str, top: int = 30) -> list[dict]:
    """The profiler's operator events with time of their own, grouped by name and by the Python frames around them
    (`asking_frames` of the Python-function events above each, innermost first), most time first."""
    from torch.autograd import DeviceType

    groups: dict[tuple, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in events:
        own = getattr(event, attr, 0)
        # operators only: not the kernels themselves (counted in their operator's time), not Python's own calls
        if (own <= 0 or event.device_type != DeviceType.CPU or _FRAME.fullmatch(event.name)
                or event.name.startswith("<built-in")):
            continue
        frames, parent = [], event.cpu_parent
        while parent is not None:
            if _FRAME.fullmatch(parent.name):
                frames.append(parent.name)
            parent = parent.cpu_parent
        # where Python's calls are not parents of the operator (none were on the GPU host's torch 2.11, at 2a04d10),
        # the event's own stack, if the profiler kept one
        frames = frames or [frame for frame in (getattr(event, "stack", None) or []) if _FRAME.fullmatch(frame)]
        entry = groups[(event.name, tuple(asking_frames(frames)))]
        entry[0] += own
        entry[1] += 1
    rows = [{"name": name, "ms": total / 1000, "calls": count, "input_shapes": "", "sites": list(sites)}
            for (name, sites), (total, count) in groups.items()]
    return sorted(rows, key=lambda r: -r["ms"])[:top]


def format_rows(title: str, rows: list[dict]) -> str:
    lines = [title]
    for row in rows:
        lines.append(f"{row['ms']:9.3f} ms {row['calls']:6d} calls  {row['name'][:70]}"
                     + (f"  {row['input_shapes']}" if row["input_shapes"] else ""))
        lines += [f"{'':30}<- {site}" for site in row["sites"]]
    return "\n".join(lines) + "\n"


def record_call_sites(step, ids, cuda: bool, path: str, top: int = 30) -> dict:
    """One `step(ids)` profiled with input shapes and Python stacks; writes two rankings to `path` (by operator and
    input shapes, by operator and call site) and returns them."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, record_shapes=True, with_stack=True) as prof:
        step(ids)
        if cuda:
            torch.cuda.synchronize()
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    result = {"by_shape": by_shape(prof.key_averages(group_by_input_shape=True), attr, top),
              "by_site": by_site(prof.events(), attr, top)}
    what = "device time of the kernels each launched" if cuda else "own CPU time"
    with open(path, "w") as fh:
        fh.write(format_rows(f"one step, operators by input shapes ({what}):", result["by_shape"]) + "\n")
        fh.write(format_rows(f"one step, operators by call site ({what}):", result["by_site"]))
        if not any(row["sites"] for row in result["by_site"]):
            fh.write("(the profiler recorded no Python frame around these operators: no call site to name)\n")
    return result
