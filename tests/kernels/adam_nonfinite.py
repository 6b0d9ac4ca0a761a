"""An infinite or NaN gradient through the fused low-bit Adam step, against LowBitAdamW's plain-torch step.

`check(device)` steps a fused and a plain LowBitAdamW through the same gradients, one of them inf, -inf and NaN
at three elements, for moment formats where an infinite scaled moment is stored three ways: NaN in E4M3 (no inf),
the format's inf in FP16 (through the cast) and E5M2 (whose saturating Triton cast would give its max). Per
format pair, it returns each moment's decoded values as strings ("inf", "-inf", "nan" or the number) for both
steps. Run as a script, it prints `check("cpu")` as JSON: with TRITON_INTERPRET=1 the Triton kernels run on the
CPU (tests/kernels/test_adam_kernels.py); tests/gpu/test_msamp_gpu.py runs `check("cuda")`.
"""

from __future__ import annotations

import json
import math

import torch

GRAD = [float("inf"), float("-inf"), float("nan"), 1.0, -2.0, 0.5]
STATES = [("e4m3", "fp16"), ("e5m2", "e4m3"), ("fp16", "e5m2")]


def _as_text(values: torch.Tensor) -> list[str]:
    return [repr(v) if math.isfinite(v) else str(v) for v in values.tolist()]


def check(device: str) -> dict:
    from lowprec.optim import LowBitAdamW
    from lowprec.optim.low_bit_adam import _decode

    out = {}
    for m_dtype, v_dtype in STATES:
        fused, plain = (torch.nn.Parameter(torch.zeros(len(GRAD), device=device)) for _ in range(2))
        kw = dict(lr=1e-3, exp_avg_dtype=m_dtype, exp_avg_sq_dtype=v_dtype, stochastic_rounding=False)
        opt_fused, opt_plain = LowBitAdamW([fused], fused=True, **kw), LowBitAdamW([plain], fused=False, **kw)
        if device == "cpu":  # the kernels run on the CPU only under TRITON_INTERPRET=1
            opt_fused._use_fused = lambda p, grad, group: True
        row = {}
        for name, param, opt in (("fused", fused, opt_fused), ("plain", plain, opt_plain)):
            param.grad = torch.tensor(GRAD, device=device)
            opt.step()
            state = opt.state[param]
            row[name] = {key: _as_text(_decode(state[key], state[f"{key}_scale"]).cpu())
                         for key in ("exp_avg", "exp_avg_sq")}
            row[name]["param"] = _as_text(param.detach().cpu())
        out[f"{m_dtype}_{v_dtype}"] = row
    return out


def problems(result: dict) -> list[str]:
    """Where the fused step's result differs from the plain step's: a non-finite value not the same non-finite
    value (an inf and a NaN differ), or a finite one more than one FP8 code away: 12.5%, or E4M3's smallest
    subnormal at the scale of 1 kept beside a non-finite amax (an interpreted cast to FP8 may round otherwise
    than torch's: 0.001 to 0 rather than 2**-9)."""
    found = []
    for states, row in result.items():
        for key, plain in row["plain"].items():
            for i, (got, want) in enumerate(zip(row["fused"][key], plain)):
                g, w = float(got), float(want)
                finite = math.isfinite(g) and math.isfinite(w)
                same = abs(g - w) <= 0.125 * abs(w) + 2**-9 if finite else got == want
                if not same:
                    found.append(f"{states} {key}[{i}]: fused {got}, plain {want}")
    return found


if __name__ == "__main__":
    print(json.dumps(check("cpu")))
