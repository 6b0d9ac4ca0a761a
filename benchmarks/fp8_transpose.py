"""An FP8 weight's transpose: torch's copy against lowprec's Triton kernel (`lowprec.kernels.cast.fp8_transpose`).

    python benchmarks/fp8_transpose.py --out fp8_transpose.json [--shapes 4096x4096,14336x4096,4096x14336]

msamp O3 under FSDP2 transposes each gathered E4M3 weight for the backward's input-gradient GEMM (`torch._scaled_mm`
takes its second operand column-major). For each shape (default: the d4096 proxy's Linear weights) the JSON holds
the median microseconds of 50 transposes by each, the bytes per second they move (read + write), and whether their
bytes agree. Needs a CUDA device for the numbers that matter; on a CPU both are torch's copy (a smoke test).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def _shapes(text: str) -> list[tuple[int, int]]:
    try:
        shapes = [tuple(int(v) for v in item.split("x")) for item in text.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
        raise argparse.ArgumentTypeError(f"--shapes takes ROWSxCOLS[,ROWSxCOLS...] with sizes >= 1, got {text!r}")
    return shapes


def _median_us(fn, q: torch.Tensor, repeats: int = 50) -> float:
    times = []
    for _ in range(repeats):
        if q.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(q)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        else:
            t0 = time.perf_counter()
            fn(q)
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def main() -> None:
    from lowprec.kernels.cast import fp8_transpose

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", type=_shapes, default=_shapes("4096x4096,14336x4096,4096x14336"))
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = {}
    for m, n in args.shapes:
        q = torch.randint(0, 256, (m, n), dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
        torch_us = _median_us(lambda t: t.t().contiguous(), q)
        lowprec_us = _median_us(fp8_transpose, q)
        same = torch.equal(fp8_transpose(q).view(torch.uint8), q.t().contiguous().view(torch.uint8))
        rows[f"{m}x{n}"] = {"torch_us": torch_us, "lowprec_us": lowprec_us, "bytes_equal": same,
                            "torch_gb_s": 2 * m * n / torch_us / 1e3, "lowprec_gb_s": 2 * m * n / lowprec_us / 1e3}
        print(f"{m}x{n}: torch {torch_us:.1f} us, lowprec {lowprec_us:.1f} us, bytes equal: {same}")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    with open(args.out, "w") as f:
        json.dump({"device": name, "torch": torch.__version__, "shapes": rows}, f, indent=1)


if __name__ == "__main__":
    main()
