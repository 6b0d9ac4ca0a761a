"""Where one profiled step's host (CPU) time goes, from a Chrome trace that multi.sh's PROFILE=1 wrote.

    python scripts/gpu/trace_host.py NAME.prof.rank1.trace.json.gz [...]

A step whose GPU waits on the host (busy far below span in `profiled_step`) is as fast as its Python and
launches: this prints, per trace, the host time of the forward, the backward and the optimizer step, and the
FSDP2 annotations summed by kind (all-gather, reduce, ...). Host times include the profiler's own cost
per recorded event (tens of microseconds), so compare traces with each other, not with unprofiled steps.
"""

from __future__ import annotations

import collections
import gzip
import json
import re
import sys


def _events(path: str) -> list[dict]:
    with gzip.open(path) if path.endswith(".gz") else open(path) as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def host_breakdown(path: str) -> dict:
    events = _events(path)
    cpu = sorted((e for e in events if e.get("cat") in ("cpu_op", "user_annotation")), key=lambda e: e["ts"])
    notes = [e for e in events if e.get("cat") == "user_annotation"]

    def first(prefix: str) -> dict | None:
        found = [e for e in notes if e["name"].startswith(prefix)]
        return min(found, key=lambda e: e["ts"]) if found else None

    start, end = cpu[0]["ts"], max(e["ts"] + e["dur"] for e in cpu)
    forward, backward = first("FSDP::root_pre_forward"), first("FSDP::pre_backward")
    backward_end = first("FSDP::root_post_backward_callback")
    step = first("Optimizer.step")
    phases = {"span_ms": (end - start) / 1e3}
    if forward and backward:
        phases["forward_ms"] = (backward["ts"] - forward["ts"]) / 1e3
    if backward and backward_end:
        phases["backward_ms"] = (backward_end["ts"] + backward_end["dur"] - backward["ts"]) / 1e3
    if step:
        phases["optimizer_step_ms"] = step["dur"] / 1e3
    kinds: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    for e in notes:
        kind = re.sub(r" (\(.*|for .*)$", "", e["name"])
        kinds[kind][0] += 1
        kinds[kind][1] += e["dur"] / 1e3
    phases["annotations"] = {k: {"calls": n, "ms": round(ms, 2)} for k, (n, ms) in
                             sorted(kinds.items(), key=lambda kv: -kv[1][1])}
    return phases


def main(paths: list[str]) -> None:
    for path in paths:
        print(path)
        result = host_breakdown(path)
        for key, value in result.items():
            if key != "annotations":
                print(f"  {key}: {value:.1f}")
        for kind, v in list(result["annotations"].items())[:12]:
            print(f"    {kind}: {v['calls']} calls, {v['ms']} ms")


if __name__ == "__main__":
    main(sys.argv[1:])
