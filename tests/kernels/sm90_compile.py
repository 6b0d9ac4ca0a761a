"""Compile every Triton kernel specialisation lowprec launches, for an H100 (sm_90), on a machine with no GPU.

Triton's interpreter (TRITON_INTERPRET=1, tests/kernels/test_adam_kernels.py) runs a kernel's Python, not
its compiler: a kernel it runs may still fail to compile (a name carried through a loop with two types did,
on the GPU host only). Here the launchers run on CPU tensors with each kernel replaced by a recorder, and
every distinct (kernel, signature, constants) they launched is compiled to a cubin for sm_90 by Triton's own
compiler and ptxas, which need no GPU. The launches cover every dtype, state and gradient form and both
alignments; not the 64-bit-offset form (WIDE: a tensor of 2**31 elements), nor the pointer-divisibility
specialisation Triton's launcher adds on a GPU. Run as a script, it prints `compile_all()` as JSON.
"""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import torch

POINTEE = {torch.uint8: "u8", torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int64: "i64",
           torch.int32: "i32", torch.int8: "i8", torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}
STATES = [("fp32", "fp32"), ("e4m3", "fp16"), ("fp16", "fp16"), ("bf16", "e5m2")]
PARAM_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


class Recorder:
    """Stands for a JIT kernel: `kernel[grid](*args, **kwargs)` records the launch instead of running it."""

    def __init__(self, fn, launches: dict):
        self.fn, self.launches = fn, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            sig, constexprs, options = specialise(self.fn, args, kwargs)
            key = f"{self.fn.__name__}({', '.join(f'{k}={v}' for k, v in sig.items() if v != 'constexpr')}; " + \
                ", ".join(f"{self.fn.arg_names[i[0]]}={v}" for i, v in constexprs.items()) + ")"
            self.launches.setdefault(key, (self.fn, sig, constexprs, options))
        return launch


def specialise(fn, args, kwargs):
    bound = dict(zip(fn.arg_names, args))
    bound.update({k: v for k, v in kwargs.items() if k in fn.arg_names})
    options = {k: v for k, v in kwargs.items() if k not in fn.arg_names}
    sig, constexprs = {}, {}
    for i, param in enumerate(fn.params):
        value = bound[param.name]
        if param.is_constexpr:
            sig[param.name], constexprs[(i,)] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            sig[param.name] = "*" + POINTEE[value.dtype]
        elif isinstance(value, bool):
            sig[param.name] = "i1"
        elif isinstance(value, int):
            sig[param.name] = "i32" if -2**31 <= value < 2**31 else "i64"
        elif isinstance(value, float):
            sig[param.name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: argument {param.name} of type {type(value).__name__}")
    return sig, constexprs, options


def record_adam(launches: dict) -> None:
    """The fused Adam step of LowBitAdamW and LowBitAdam over each parameter dtype and state pair, with
    gradients in `.grad` and in FP8 gradient stores (scaled, with presence flags)."""
    from lowprec.kernels import adam
    from lowprec.optim import LowBitAdam, LowBitAdamW

    real = adam._get_kernels()
    adam._get_kernels = lambda: tuple(Recorder(fn, launches) for fn in real)
    try:
        for cls in (LowBitAdamW, LowBitAdam):
            for dtype in PARAM_DTYPES:
                for m_dtype, v_dtype in STATES:
                    params = [torch.nn.Parameter(torch.randn(64, 32, dtype=dtype)) for _ in range(2)]
                    opt = cls(params, lr=1e-3, weight_decay=0.1, exp_avg_dtype=m_dtype, exp_avg_sq_dtype=v_dtype,
                              fused=True, maximize=cls is LowBitAdam)
                    opt._use_fused = lambda p, grad, group: True
                    store = SimpleNamespace(weight=params[0], fp8_grad_valid=torch.ones(()),
                                            fp8_grad_data=torch.zeros(64, 32, dtype=torch.float8_e4m3fn),
                                            fp8_grad_scale=torch.ones(()))
                    opt.attach_fp8_grads([store])
                    params[1].grad = torch.randn_like(params[1])
                    opt.step()
        # parameters that are views into one buffer at an odd offset: the kernels' unaligned form (ALIGNED=False)
        flat = torch.randn(2 * 64 * 32 + 1)
        views = [torch.nn.Parameter(flat[1 + i * 2048:1 + (i + 1) * 2048].view(64, 32)) for i in range(2)]
        opt = LowBitAdamW(views, lr=1e-3, exp_avg_dtype="e4m3", exp_avg_sq_dtype="fp16", fused=True)
        opt._use_fused = lambda p, grad, group: True
        for view in views:
            view.grad = torch.randn_like(view)
        opt.step()
        # an FP16 parameter rounded to nearest (stochastic_rounding=False): the update's plain store (P_SR=False)
        half = torch.nn.Parameter(torch.randn(64, 32, dtype=torch.float16))
        opt = LowBitAdamW([half], lr=1e-3, fused=True, stochastic_rounding=False)
        opt._use_fused = lambda p, grad, group: True
        half.grad = torch.randn_like(half)
        opt.step()
        adam.pow2_scale(torch.ones(4), torch.float8_e4m3fn, torch.ones(4))
    finally:
        adam._get_kernels = lambda: real


def record_cast(launches: dict) -> None:
    from lowprec.kernels import cast

    kernel = Recorder(cast._build_kernel(), launches)
    for dtype in (torch.float32, torch.bfloat16):
        for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
            for transpose in (True, False):
                x = torch.randn(96, 80, dtype=dtype)
                cast.launch_cast_transpose(kernel, x, torch.ones(()), fp8, torch.zeros(()), transpose)


def record_transpose(launches: dict) -> None:
    from lowprec.kernels import cast

    kernel = Recorder(cast._build_transpose_kernel(), launches)
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        cast.launch_transpose(kernel, torch.zeros(96, 80, dtype=dtype))


def record_activation_codec(launches: dict) -> None:
    """The FP8 storage of saved activations: every input and output dtype, whole and padded groups, a row shorter
    than a group, a strided input."""
    from lowprec.kernels import activations

    encode, decode = (Recorder(fn, launches) for fn in activations._triton_kernels())
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for last in (256, 200, 64):
            rows = torch.randn(40, last).to(dtype)
            size = activations.group_size(last)
            data, exponent = activations._encode(rows, size)
            activations.launch_encode(encode, rows, size)
            activations.launch_decode(decode, data, exponent, last, dtype)
        activations.launch_encode(encode, torch.randn(256, 40).to(dtype).t(), 128)


def compile_all() -> dict[str, dict]:
    """{"compiled": {specialisation: "ok" or the error}, "fma": {specialisation: FMA instructions in its PTX}}."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    launches: dict = {}
    record_adam(launches)
    record_cast(launches)
    record_transpose(launches)
    record_activation_codec(launches)
    compiled, fma, ftz = {}, {}, {}
    for key, (fn, sig, constexprs, options) in launches.items():
        try:
            kernel = compile(ASTSource(fn, sig, constexprs), target=GPUTarget("cuda", 90, 32), options=options)
        except Exception as e:  # noqa: BLE001 - every failure is reported, with its kernel
            compiled[key] = f"{type(e).__name__}: {str(e)[-1500:]}"
            continue
        compiled[key] = "ok"
        fma[key] = len(re.findall(r"\bfma\.", kernel.asm["ptx"]))  # any rounding, ftz or not
        ftz[key] = len(re.findall(r"\.ftz\b", kernel.asm["ptx"]))  # any instruction flushing subnormals to zero
    return {"compiled": compiled, "fma": fma, "ftz": ftz}


if __name__ == "__main__":
    print(json.dumps(compile_all()))
