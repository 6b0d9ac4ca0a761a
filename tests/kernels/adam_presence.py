"""The fused low-bit Adam step on FP8 gradients whose presence only the device knows.

`compare(device)` steps two `LowBitAdamW`s through the same gradients, both through the fused kernels:
one reads them from FP8 gradient stores with presence flags (the kernels skip an absent one), the other
from `.grad` (None where absent: the host skips it, as torch's optimizers do). Every parameter, state,
scale and step count must come out bitwise the same. Run as a script, it prints `compare("cpu")` as JSON:
with TRITON_INTERPRET=1 the Triton kernels run on the CPU (tests/kernels/test_adam_kernels.py).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch

E4M3 = torch.float8_e4m3fn
SHAPES = [(64, 48), (33,), (128, 16), (5000,)]
# per step, which of the layers got a gradient: the third none at first, the second none twice in a row
PRESENCE = [(1, 1, 0, 1), (1, 0, 1, 1), (0, 0, 1, 1), (1, 1, 0, 0), (1, 1, 1, 1)]
STATE_KEYS = ("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale")


def compare(device: str, states: tuple[str, str] = ("e4m3", "fp16"), sync_mode: str | None = None,
            param_dtype: torch.dtype = torch.float32) -> dict:
    """`sync_mode` ('error' on a GPU) is CUDA's sync debug mode while the flagged optimizer steps. FP16 parameters
    are rounded stochastically: from seeds computed on the device for the flagged ones, on the host for the others,
    which must be the same numbers."""
    from lowprec.optim import LowBitAdamW

    torch.manual_seed(0)
    flagged = [torch.nn.Parameter(torch.randn(s, device=device).to(param_dtype)) for s in SHAPES]
    plain = [torch.nn.Parameter(w.detach().clone()) for w in flagged]
    plain_extra = torch.nn.Parameter(torch.randn(7, device=device).to(param_dtype))  # a .grad parameter beside them
    flagged_extra = torch.nn.Parameter(plain_extra.detach().clone())
    layers = [SimpleNamespace(weight=w, fp8_grad_data=torch.zeros(w.shape, dtype=E4M3, device=device),
                              fp8_grad_scale=torch.ones((), device=device),
                              fp8_grad_valid=torch.zeros((), device=device)) for w in flagged]
    kw = dict(lr=1e-2, weight_decay=0.1, exp_avg_dtype=states[0], exp_avg_sq_dtype=states[1], fused=True)
    opt_flagged = LowBitAdamW([*flagged, flagged_extra], **kw)
    opt_plain = LowBitAdamW([*plain, plain_extra], **kw)
    if device == "cpu":  # the kernels run on the CPU only under TRITON_INTERPRET=1
        opt_flagged._use_fused = opt_plain._use_fused = lambda p, grad, group: True
    opt_flagged.attach_fp8_grads(layers)
    for step, present in enumerate(PRESENCE):
        for layer, param, shape, here in zip(layers, plain, SHAPES, present):
            scale = torch.tensor(2.0 ** (step - 2), device=device)
            q = (torch.randn(shape, device=device) * scale).to(E4M3)
            layer.fp8_grad_data.copy_(q)
            layer.fp8_grad_scale.copy_(scale)
            layer.fp8_grad_valid.fill_(float(here))
            param.grad = (q.float() / scale).to(param_dtype) if here else None  # exact: a power-of-two scale
        extra = torch.randn(7, device=device).to(param_dtype)
        flagged_extra.grad, plain_extra.grad = extra.clone(), extra.clone()
        opt_plain.step()
        if sync_mode:
            torch.cuda.set_sync_debug_mode(sync_mode)
        try:
            opt_flagged.step()
        finally:
            if sync_mode:
                torch.cuda.set_sync_debug_mode("default")
    out = {"params_equal": [], "states_equal": [], "steps": [], "plain_steps": []}
    for a, b in zip([*flagged, flagged_extra], [*plain, plain_extra]):
        sa, sb = opt_flagged.state[a], opt_plain.state[b]
        out["params_equal"].append(torch.equal(a, b))
        out["states_equal"].append(all(torch.equal(sa[k].float(), sb[k].float()) for k in STATE_KEYS))
        out["steps"].append(float(sa["step"]))
        out["plain_steps"].append(float(sb["step"]))
    return out


if __name__ == "__main__":
    print(json.dumps({"e4m3_fp16": compare("cpu"), "fp32_fp32": compare("cpu", ("fp32", "fp32")),
                      "fp16_params": compare("cpu", param_dtype=torch.float16)}))
