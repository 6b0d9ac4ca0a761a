"""The FP8 storage of saved activations (`activation_dtype="fp8"`): lowprec's Triton encode and decode against the
inductor-compiled definitions they replace on a GPU.

    python benchmarks/activation_codec.py --out activation_codec.json [--shapes 8192x4096,8192x14336,...]

Eager models (FSDP2's, te's, msamp O3's eager FP8 layers) store their saved tensors through Python hooks, one encode
in the forward and one decode in the backward for each (`lowprec.kernels.activations.pack_fp8` / `unpack_fp8`). For
each shape (default: what one d4096-proxy rank of 4 x 2048 tokens saves: hidden-size rows, FFN-width rows, one
attention head per row) and dtype, the JSON holds the median microseconds of 50 encodes and 50 decodes by each, the
bytes per second they move, and whether their bytes agree. Needs a CUDA device for the numbers that matter; on a CPU
both are the plain-torch definitions (a smoke test).
"""

from __future__ import annotations

import argparse
import json

import torch
from fp8_transpose import _median_us, _shapes  # this folder's FP8 transpose benchmark: the same timing and --shapes

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def _dtypes(text: str) -> list[str]:
    names = text.split(",")
    if not names or any(name not in DTYPES for name in names):
        raise argparse.ArgumentTypeError(f"--dtypes takes a comma-separated list of {', '.join(DTYPES)}, got {text!r}")
    return names


def _times(activations, x: torch.Tensor, size: int, data: torch.Tensor, exponent: torch.Tensor) -> dict[str, float]:
    n, dtype = x.shape[-1], x.dtype
    return {
        "encode_us": _median_us(lambda t: activations.encode_rows(t, size), x),
        "fused_encode_us": _median_us(lambda t: activations._encode(t, size), x),
        "decode_us": _median_us(lambda t: activations.decode_rows(data, exponent, n, dtype), x),
        "fused_decode_us": _median_us(lambda t: activations._decode(data, exponent, n, dtype), x),
    }


def main() -> None:
    from lowprec.kernels import activations

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", type=_shapes, default=_shapes("8192x4096,8192x14336,262144x128"))
    parser.add_argument("--dtypes", type=_dtypes, default=_dtypes("bf16,fp32"))
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = {}
    for m, n in args.shapes:
        for name in args.dtypes:
            dtype = DTYPES[name]
            x = torch.randn(m, n, device=device).to(dtype)
            size = activations.group_size(n)
            data, exponent = activations.encode_rows(x, size)
            fused_data, fused_exponent = activations._encode(x, size)
            same = (torch.equal(data.view(torch.uint8), fused_data.view(torch.uint8))
                    and torch.equal(exponent, fused_exponent)
                    and torch.equal(activations.decode_rows(data, exponent, n, dtype),
                                    activations._decode(data, exponent, n, dtype)))
            times = _times(activations, x, size, data, exponent)
            moved = m * n * (x.element_size() + 1)  # read the tensor, write its bytes (or the reverse)
            rows[f"{m}x{n}-{name}"] = {**times, "bytes_equal": same,
                                       "encode_gb_s": moved / times["encode_us"] / 1e3,
                                       "decode_gb_s": moved / times["decode_us"] / 1e3}
            print(f"{m}x{n} {name}: encode {times['encode_us']:.1f} us (inductor {times['fused_encode_us']:.1f}), "
                  f"decode {times['decode_us']:.1f} us (inductor {times['fused_decode_us']:.1f}), bytes equal: {same}")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    with open(args.out, "w") as f:
        json.dump({"device": name, "torch": torch.__version__, "shapes": rows}, f, indent=1)


if __name__ == "__main__":
    main()
