"""The largest model each configuration trains on this GPU: headline.py's proxy (batch 4 x 2048), deepened.

    python3 benchmarks/largest_model.py --out OUT.json [--width d4096] [--configs "bf16 compiled" "msamp O2" ...]

Per configuration: the peak memory of two training steps at two depths (blocks `--probe`, default 2 and 4)
gives the memory per block and the rest; the deepest model whose predicted peak fits under `--fraction` of
the GPU's memory is then trained for two steps to confirm it fits (one block fewer at a time if it runs
out, at most `--tries` runs). An msamp configuration runs its warm-up's steps too (`headline.MSAMP_WINDOW`) and two
after: the graph of its delayed scales, compiled when the warm-up ends, is the one it trains with. Each run is its own
process (headline.py), so an out-of-memory error leaves nothing behind. Reports blocks and parameters per
configuration, and their ratio to BF16's.

`--capacity-gib 78.5` answers for an 80 GB H100 on a larger GPU (an H200): every run's CUDA allocator is capped
at that many GiB (headline.py --memory-gib), so a model that would not fit the smaller card runs out of memory.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import headline  # noqa: E402


def command(config: str, width: str, blocks: int, out: str, memory_gib: float | None = None) -> list[str]:
    """headline.py's command line for two steps (past msamp's warm-up); `memory_gib` caps its allocator (a smaller GPU
    on a larger one)."""
    warmup = headline.MSAMP_WINDOW + 1 if headline.uses_msamp(config) else 1
    cmd = [sys.executable, os.path.join(HERE, "headline.py"), "--widths", f"{width}x{blocks}", "--configs",
           config, "--steps", str(warmup + 1), "--warmup", str(warmup), "--out", out]
    return cmd + (["--memory-gib", str(memory_gib)] if memory_gib is not None else [])


def measure(config: str, width: str, blocks: int, memory_gib: float | None = None) -> dict:
    """Two steps of `config` at `width` with `blocks` blocks, in a fresh process: {"peak_gib"} or {"error"}."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "run.json")
        cmd = command(config, width, blocks, out, memory_gib)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if not os.path.exists(out):
            return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1]}
        with open(out) as fh:
            run = json.load(fh)["widths"][f"{width}x{blocks}"][config]
    if "error" in run:
        return {"error": run["error"][:300]}
    if run.get("peak_gib") is None:
        return {"error": "peak memory is measured on a CUDA device only"}
    return {"peak_gib": run["peak_gib"]}


def largest(fits: Callable[[int], dict], probe: tuple[int, int], capacity_gib: float, tries: int) -> dict:
    """The deepest model that fits: a line through the peaks at the two `probe` depths predicts it, and
    runs confirm it (one block fewer after each out-of-memory run)."""
    low, high = (fits(n) for n in probe)
    record = {"probe": {str(probe[0]): low, str(probe[1]): high}, "tries": {}}
    if "error" in low or "error" in high:
        record["error"] = (low.get("error") or high.get("error"))
        return record
    per_block = (high["peak_gib"] - low["peak_gib"]) / (probe[1] - probe[0])
    rest = low["peak_gib"] - probe[0] * per_block
    record.update(per_block_gib=per_block, rest_gib=rest)
    if per_block <= 0:
        record["error"] = f"peak did not grow with depth ({low['peak_gib']} -> {high['peak_gib']} GiB)"
        return record
    blocks = math.floor((capacity_gib - rest) / per_block)
    for _ in range(tries):
        if blocks <= probe[1]:
            record["blocks"] = probe[1]  # measured above
            return record
        run = fits(blocks)
        record["tries"][str(blocks)] = run
        if "error" not in run:
            record["blocks"] = blocks
            return record
        if "out of memory" not in run["error"].lower():
            record["error"] = run["error"]
            return record
        blocks -= 1
    record["error"] = f"still out of memory at {blocks + 1} blocks after {tries} tries"
    return record


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", default="d4096", choices=list(headline.WIDTHS))
    p.add_argument("--configs", nargs="+", default=["bf16 compiled", "torchao", "msamp O2", "msamp O2 act8"],
                   choices=list(headline.CONFIGS))
    p.add_argument("--probe", nargs=2, type=int, default=[2, 4], metavar=("LOW", "HIGH"))
    p.add_argument("--fraction", type=float, default=None,
                   help="of the GPU's memory the predicted peak may take (default 0.92; 1.0 with --capacity-gib, "
                        "whose cap makes the confirming runs fail where the real GPU would)")
    p.add_argument("--capacity-gib", type=float, default=None,
                   help="the GPU's memory (default: the device's); given, every run's allocator is capped at it, so "
                        "that an 80 GB GPU's answer comes from a larger one (78.5: an H100's 79.2 GiB less the "
                        "CUDA context's, which the cap does not count)")
    p.add_argument("--tries", type=int, default=3)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if not 0 < args.probe[0] < args.probe[1]:
        p.error("--probe needs 0 < LOW < HIGH")
    cap = args.capacity_gib  # given: each run's allocator is capped at it
    if cap is not None and cap <= 0:
        p.error(f"--capacity-gib must be positive, got {cap}")
    if args.fraction is None:
        args.fraction = 0.92 if cap is None else 1.0
    if not 0 < args.fraction <= 1:
        p.error(f"--fraction must be in (0, 1], got {args.fraction}")
    capacity = cap
    if capacity is None:
        import torch

        if not torch.cuda.is_available():
            p.error("no CUDA device: give --capacity-gib")
        capacity = torch.cuda.get_device_properties(0).total_memory / 2**30
    results = {"width": args.width, "capacity_gib": capacity, "memory_capped": cap is not None,
               "fraction": args.fraction, "configs": {}}
    for config in args.configs:
        record = largest(lambda n, c=config: measure(c, args.width, n, cap), tuple(args.probe),
                         args.fraction * capacity, args.tries)
        if "blocks" in record:
            record["params"] = headline.params(f"{args.width}x{record['blocks']}")
        results["configs"][config] = record
        with open(args.out, "w") as fh:
            json.dump(results, fh, indent=1)
        print(f"{config}: " + (f"{record['blocks']} blocks, {record['params'] / 1e9:.2f}B parameters"
                               if "blocks" in record else record["error"]), flush=True)
    base = next((r for c, r in results["configs"].items() if c.startswith("bf16") and "params" in r), None)
    for record in results["configs"].values():
        if base is not None and "params" in record:
            record["params_vs_bf16"] = record["params"] / base["params"]
    with open(args.out, "w") as fh:
        json.dump(results, fh, indent=1)
    return results


if __name__ == "__main__":
    main()
