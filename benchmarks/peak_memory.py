"""What is allocated at a step's peak, and where it was allocated: the CUDA caching allocator's trace of one step
(`torch.cuda.memory._record_memory_history`, the memory-snapshot API), replayed to the moment the allocated
total was highest, its live blocks grouped by the Python line that allocated them.

    from peak_memory import record_step
    report = record_step(step, "peak.txt")   # one call of step() under the recorder; None without CUDA

Used by headline.py's `--peak-configs`. A block a compiled graph allocated is shown with its line of generated
code (shape, stride, dtype) and the kernel that writes it, and the files of generated code that allocated blocks live
at the peak are copied beside the report (`PATH_code/`, as `pb_cpbx...py` for the site `pb/cpbx...py:LINE`): which
expression inductor stored, and why, is read there (results/gpu/2026-11-28-h200-act8-peak-05e9f2d took a device call
of its own to bring them back). The replay counts a block from its `alloc` to its
`free_completed` (a block freed on one stream while another may still read it stays allocated until then, as the
allocator counts it); blocks allocated before the recording started are `baseline` (torch.cuda.memory_allocated()
then).
"""

from __future__ import annotations

import contextlib
import linecache
import os
import shutil
from collections import defaultdict

# frames from these parts of a path say how torch did something, not what asked for it
MACHINERY = (f"{os.sep}torch{os.sep}", f"{os.sep}accelerate{os.sep}", f"{os.sep}site-packages{os.sep}", "<frozen",
              f"{os.sep}contextlib.py")


def _asking_frame(frames: list[dict]) -> dict | None:
    """The innermost of `frames` outside torch and Accelerate: the code that asked for the memory."""
    return next((f for f in frames if not any(m in f["filename"] for m in MACHINERY)), None)


def site(frames: list[dict]) -> str:
    """The innermost Python frame outside torch and Accelerate ("file:line function"), else the innermost Python
    frame; frames are the allocator's, innermost first. C++ frames (no `.py` file: `??:0 torch::unwind::unwind()`
    where the allocator could not symbolise them) never name a site."""
    frames = [f for f in frames if f["filename"].endswith(".py") or f["filename"].startswith("<")]
    if not frames:
        return "(no Python frame)"
    chosen = _asking_frame(frames) or frames[0]
    parts = chosen["filename"].split(os.sep)
    return f"{os.sep.join(parts[-2:])}:{chosen['line']} {chosen['name']}"


def _generated(filename: str) -> bool:
    """Whether `filename` is a file of inductor's generated code (it imports from `torch._inductor` at its top)."""
    return any("torch._inductor" in linecache.getline(filename, n) for n in range(1, 30))


def allocating_code(frames: list[dict]) -> str | None:
    """Where `site` is a line of a compiled graph's generated code (inductor's `bufN = empty_strided_cuda((shape),
    (stride), dtype)`), that line and the kernel call after it, read while the file is still on the machine: the
    site alone names a line of a file that goes with the machine, not which tensor it allocated."""
    chosen = _asking_frame([f for f in frames if f["filename"].endswith(".py")])
    if chosen is None:
        return None
    line = linecache.getline(chosen["filename"], chosen["line"]).strip()
    if "empty_strided" not in line:
        # an op that allocates its own output (`buf5 = torch.ops.aten._scaled_mm.default(...)`) in generated code
        return line[:160] if line and _generated(chosen["filename"]) else None
    # the next line that is not another allocation or an alias says what writes the buffer
    for offset in range(1, 8):
        after = linecache.getline(chosen["filename"], chosen["line"] + offset).strip()
        if after and "empty_strided" not in after and "reinterpret_tensor" not in after and not after.startswith("#"):
            return f"{line}  ->  {after[:120]}"
    return line


def live_at_peak(events: list[dict], baseline: int = 0) -> dict:
    """Replay `events` (one device's allocator trace): the peak total (baseline included), the event index where it
    was reached, and the blocks live then as {site: [bytes, blocks]}, largest first."""
    current, peak, at = baseline, baseline, -1
    for i, event in enumerate(events):
        if event["action"] == "alloc":
            current += event["size"]
        elif event["action"] == "free_completed":
            current -= event["size"]
        if current > peak:
            peak, at = current, i
    live: dict[int, dict] = {}
    left: dict[int, dict] = {}  # allocated in the recording and still allocated at its end (a step's leftovers)
    for i, event in enumerate(events):
        if event["action"] == "alloc":
            left[event["addr"]] = event
        elif event["action"] == "free_completed":
            left.pop(event["addr"], None)
        if i == at:
            live = dict(left)
    left_sites: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for event in left.values():
        entry = left_sites[site(event.get("frames") or [])]
        entry[0] += event["size"]
        entry[1] += 1
    sites: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    code: dict[str, str] = {}
    files: set[str] = set()
    for event in live.values():
        name = site(event.get("frames") or [])
        entry = sites[name]
        entry[0] += event["size"]
        entry[1] += 1
        if name not in code:
            text = allocating_code(event.get("frames") or [])
            if text:
                code[name] = text
                files.add(_asking_frame([f for f in event["frames"] if f["filename"].endswith(".py")])["filename"])
    ordered = dict(sorted(sites.items(), key=lambda kv: -kv[1][0]))
    # the largest blocks by size say which tensors they are where a site is shared (logits: batch x length x vocab)
    largest = sorted(live.values(), key=lambda e: -e["size"])[:10]
    return {"peak_bytes": peak, "baseline_bytes": baseline, "peak_event": at, "events": len(events),
            "live_by_site": ordered, "code": code, "generated_files": sorted(files),
            "largest_blocks": [[e["size"], site(e.get("frames") or [])] for e in largest],
            "left_by_site": dict(sorted(left_sites.items(), key=lambda kv: -kv[1][0]))}


def format_report(report: dict, top: int = 25) -> str:
    gib = 2**30
    lines = [f"peak {report['peak_bytes'] / gib:.3f} GiB = {report['baseline_bytes'] / gib:.3f} GiB allocated before "
             f"the step + the blocks below (at event {report['peak_event']} of {report['events']})"]
    for name, (size, blocks) in list(report["live_by_site"].items())[:top]:
        lines.append(f"{size / gib:9.3f} GiB  {blocks:5d} blocks  {name}")
        if report.get("code", {}).get(name):
            lines.append(f"{'':27}| {report['code'][name]}")
    if report.get("largest_blocks"):
        lines.append("largest blocks live at the peak:")
        lines += [f"{size / gib:9.3f} GiB  {name}" for size, name in report["largest_blocks"]]
    if report.get("left_by_site"):
        # what the step leaves for the next: state created lazily in a first step, or held where it should not be
        lines.append("allocated in the step and still allocated after it:")
        lines += [f"{size / gib:9.3f} GiB  {blocks:5d} blocks  {name}"
                  for name, (size, blocks) in list(report["left_by_site"].items())[:top]]
    return "\n".join(lines) + "\n"


def copy_generated(report: dict, folder: str) -> list[str]:
    """Copy the report's files of generated code (those still on this machine) into `folder`, each named by its
    site's two last path parts joined by `_` (`pb/cpbx...py` -> `pb_cpbx...py`). Returns the names written."""
    written = []
    for filename in report.get("generated_files", []):
        if os.path.isfile(filename):
            os.makedirs(folder, exist_ok=True)
            name = "_".join(filename.split(os.sep)[-2:])
            shutil.copyfile(filename, os.path.join(folder, name))
            written.append(name)
    return written


@contextlib.contextmanager
def recorded(path: str | None, max_entries: int = 500_000):
    """The block run with the allocator's history recorded; after it, `format_report` written to `path` and the
    generated code it names to `PATH_code/` (`copy_generated`; PATH without its `.txt`). Yields a dict that then
    holds the report with its 25 largest sites (stays empty without CUDA)."""
    import torch

    report: dict = {}
    if not torch.cuda.is_available():
        yield report
        return
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    # Python frames only: with C++ frames the allocator's unwinder named every block `??:0 torch::unwind::unwind()`
    # on the GPU host (results/gpu/2026-11-27-h200-memory-d8a48fa)
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
    try:
        yield report
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    report.update(live_at_peak(snapshot["device_traces"][torch.cuda.current_device()], baseline))
    if path:
        with open(path, "w") as fh:
            fh.write(format_report(report))
        copy_generated(report, (path[:-4] if path.endswith(".txt") else path) + "_code")
    report["live_by_site"] = dict(list(report["live_by_site"].items())[:25])


def record_step(step, path: str | None, max_entries: int = 500_000) -> dict | None:
    """Run `step()` once under `recorded(path)`; returns its report (None without CUDA)."""
    with recorded(path, max_entries) as report:
        step()
    return report or None
