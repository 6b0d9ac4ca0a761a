"""One profiled step, summarised per rank for gpu_engines.py: where a step's wall time goes on the device.

A step can be slow because its kernels are (busy time near the span), because the GPU waits for the host to
launch work (busy well under the span), or because one rank waits for the other inside a collective (NCCL
kernel time far above what the bytes need: the time is the peer's lateness). `kernel_summary` tells these apart
from the profiler's device events; every rank writes its own table, summary and Chrome trace, so that the ranks
can be compared (rank 0 alone could not show the skew).
"""

from __future__ import annotations

import gzip
import json
import os
import shutil

# msamp's delayed scaling warms up for its first 16 steps (scales from the tensor at hand, a different and slower
# graph), and compiled layers compile again when it ends: a run is in its steady state from this step on. Until
# 2026-11-27 every 20-step msamp cell's median fell inside the warm-up
# (results/gpu/2026-11-27-h200x2-lean-layer-2e2b20b: O3 under FSDP2 with eager layers 145.9 ms by the median from
# step 5, 117 ms in the steps after the warm-up).
STEADY_FROM = 18


def step_medians(times: list[float], instrumented: set[int], first: int = 5, steady_from: int = STEADY_FROM,
                 min_steady: int = 5) -> tuple[float | None, float | None]:
    """(the median step time from step `first` on, the median from `steady_from` on or None with fewer than
    `min_steady` such steps), both over the steps no measurement ran in (`instrumented`: the profiled step, the
    sync-watch step, the model-state count), which are slower than the others."""
    def median(steps):
        values = sorted(t for i, t in enumerate(times) if i >= steps and i not in instrumented)
        return values[len(values) // 2] if values else None

    steady = [i for i in range(steady_from, len(times)) if i not in instrumented]
    return median(first), (median(steady_from) if len(steady) >= min_steady else None)


def kernel_summary(kernels: list[tuple[str, float, float]]) -> dict[str, float]:
    """`kernels`: (name, start_us, end_us) of each device kernel (no user annotations). Returns the count, the sum
    of kernel times, the part in NCCL kernels, the busy time (the union of the intervals: streams overlap) and
    the span from the first kernel's start to the last one's end, in ms."""
    if not kernels:
        return {"kernels": 0, "kernel_ms": 0.0, "nccl_ms": 0.0, "busy_ms": 0.0, "span_ms": 0.0}
    busy, end = 0.0, float("-inf")
    for _, start, stop in sorted(kernels, key=lambda k: k[1]):
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    total = sum(stop - start for _, start, stop in kernels)
    nccl = sum(stop - start for name, start, stop in kernels if "nccl" in name.lower())
    span = max(k[2] for k in kernels) - min(k[1] for k in kernels)
    return {"kernels": len(kernels), "kernel_ms": round(total / 1000, 3), "nccl_ms": round(nccl / 1000, 3),
            "busy_ms": round(busy / 1000, 3), "span_ms": round(span / 1000, 3)}


def device_kernels(prof) -> list[tuple[str, float, float]]:
    """(name, start_us, end_us) of the profile's device kernels and copies; user annotations (a module's or
    the optimizer's range on the GPU timeline) are intervals around kernels, not work."""
    import torch

    return [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]


def rank_path(path: str, rank: int) -> str:
    """`path` for rank 0; `NAME.rankR.EXT` beside it for the others."""
    if rank == 0:
        return path
    stem, ext = os.path.splitext(path)
    return f"{stem}.rank{rank}{ext}"


def write_profile(prof, path: str, rank: int, summary: dict[str, float], sort_key: str) -> None:
    """This rank's kernel table (with `summary` on top) at `rank_path(path, rank)` and its Chrome trace, gzipped,
    beside it (`.trace.json.gz`; open in https://ui.perfetto.dev)."""
    mine = rank_path(path, rank)
    with open(mine, "w") as fh:
        fh.write(f"rank {rank}: {json.dumps(summary)}\n")
        fh.write(prof.key_averages().table(sort_by=sort_key, row_limit=80, max_name_column_width=90))
    trace = os.path.splitext(mine)[0] + ".trace.json"
    prof.export_chrome_trace(trace)
    with open(trace, "rb") as src, gzip.open(trace + ".gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.remove(trace)
