"""The Triton kernels of the FP8 storage of saved activations (`lowprec.kernels.activations_triton`) against their
definitions `_encode` / `_decode`, and when `encode_rows` / `decode_rows` launch them.

The kernels run here through Triton's interpreter (TRITON_INTERPRET=1, in a process of its own since the variable is
read when a kernel is defined). The interpreter's FP32 -> E4M3 conversion is not the GPU's: it rounds ties away from
zero, flushes E4M3 subnormals, turns NaN into a number and rounded -1.98 to -1 (Triton 3.9). So here the scales'
exponents, the strided reads and the decode of finite values are checked exactly, and the stored bytes where no value
needs rounding;
tests/gpu/test_activations_gpu.py checks the bytes, subnormals and NaN on the GPU, and
tests/kernels/test_kernels_compile.py compiles every launch for sm_90.
"""

from __future__ import annotations

import pytest
import torch

from lowprec.kernels import activations

INTERPRETED = """
import json, torch
from lowprec.kernels import activations as A
encode, decode = A._triton_kernels()
out = {}
g = torch.Generator().manual_seed(0)
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    span = 12 if dtype == torch.float16 else 60
    for rows, last in [(1, 5), (3, 128), (5, 200), (33, 256), (2, 1), (40, 70), (7, 384)]:
        power = torch.randint(-span, span // 2, (rows, last), generator=g)
        x = torch.randn(rows, last, generator=g) * torch.exp2(power)
        x = x.to(dtype)
        x[0, 0] = 0
        if rows == 5 and dtype != torch.float16:
            x[1, :2] = torch.tensor([3.3e38, -3.1e38])  # a group whose scale is held at 2**MIN_EXPONENT
        if rows > 2:
            x[2] = 0  # a row of zeros: scale 1
        size = A.group_size(last)
        want_data, want_exponent = A._encode.eager(x, size)
        data, exponent = A.launch_encode(encode, x, size)
        strided_data, strided_exponent = A.launch_encode(encode, x.t().contiguous().t(), size)
        # values that are E4M3 numbers times a power of two per row (within 448x of each other: none scales into
        # E4M3's subnormals), so that every scaled value is exact and the interpreter's conversion agrees
        e4m3 = torch.randint(0x38, 0x7F, (rows, last), generator=g).to(torch.uint8).view(torch.float8_e4m3fn).float()
        sign = torch.randint(0, 2, (rows, last), generator=g) * 2 - 1
        power = torch.exp2(torch.randint(-6 if dtype == torch.float16 else -40, 4, (rows, 1), generator=g).float())
        exact = (e4m3 * sign * power).to(dtype)
        exact_data, exact_exponent = A.launch_encode(encode, exact, size)
        want_exact, want_exact_exponent = A._encode.eager(exact, size)
        decoded = A.launch_decode(decode, want_data, want_exponent, last, dtype)
        out[f"{dtype}-{rows}x{last}"] = {
            "shapes": data.shape == want_data.shape and exponent.shape == want_exponent.shape,
            "exponents": torch.equal(exponent, want_exponent)
                         and (rows != 5 or dtype == torch.float16 or int(exponent[1, 0]) == A.MIN_EXPONENT),
            "exact_bytes": torch.equal(exact_data.view(torch.uint8), want_exact.view(torch.uint8))
                           and torch.equal(exact_exponent, want_exact_exponent),
            "strided_read": torch.equal(strided_data.view(torch.uint8), data.view(torch.uint8))
                            and torch.equal(strided_exponent, exponent),
            "decode": decoded.dtype == dtype
                      and torch.equal(decoded, A._decode.eager(want_data, want_exponent, last, dtype)),
        }
print(json.dumps(out))
"""


def test_the_kernels_interpreted_match_their_definitions():
    pytest.importorskip("triton")
    from conftest import run_interpreted

    results = run_interpreted("-c", INTERPRETED)
    assert len(results) == 21
    failed = {case: checks for case, checks in results.items() if not all(checks.values())}
    assert not failed, failed


class _Launched(Exception):
    pass


@pytest.fixture
def kernels_apply(monkeypatch):
    """`encode_rows` / `decode_rows` as on a GPU with FP8 code generation, with the launches recorded (and stopped)."""
    launched = []

    def launch(name):
        def record(kernel, *args):
            launched.append(name)
            raise _Launched

        return record

    monkeypatch.setattr(activations, "_triton_kernels", lambda: (object(), object()))
    monkeypatch.setattr(activations, "launch_encode", launch("encode"))
    monkeypatch.setattr(activations, "launch_decode", launch("decode"))
    monkeypatch.setattr(activations, "triton_available", lambda: True)
    monkeypatch.setattr(activations, "fp8_codegen", lambda index: True)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    return launched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_cuda_tensor_goes_to_the_kernels(kernels_apply, dtype):
    rows = torch.randn(4, 300).to(dtype)
    with pytest.raises(_Launched):
        activations.encode_rows(rows, 128)
    data, exponent = activations._encode.eager(rows, 128)
    with pytest.raises(_Launched):
        activations.decode_rows(data, exponent, 300, dtype)
    assert kernels_apply == ["encode", "decode"]


def test_what_the_kernels_do_not_take_goes_to_the_definitions(kernels_apply, monkeypatch):
    rows = torch.randn(4, 256, dtype=torch.float64)  # a dtype the kernels do not read
    data, exponent = activations.encode_rows(rows, 128)
    assert torch.equal(activations.decode_rows(data, exponent, 256, torch.float64),
                       activations._decode.eager(data, exponent, 256, torch.float64))
    # more groups in a row than CUDA's grid holds
    wide = torch.zeros(1, 128 * (activations._MAX_GROUPS + 1), dtype=torch.bfloat16)
    assert activations.encode_rows(wide, 128)[1].shape == (1, activations._MAX_GROUPS + 1)
    # a graph being traced writes its own kernels
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    activations.encode_rows(torch.randn(4, 256), 128)
    assert kernels_apply == []


def test_off_the_gpu_the_definitions_run():
    rows = torch.randn(6, 200, dtype=torch.bfloat16)
    data, exponent = activations.encode_rows(rows, 128)
    want_data, want_exponent = activations._encode.eager(rows, 128)
    assert torch.equal(data.view(torch.uint8), want_data.view(torch.uint8)) and torch.equal(exponent, want_exponent)
    assert torch.equal(activations.decode_rows(data, exponent, 200, torch.bfloat16),
                       activations._decode.eager(data, exponent, 200, torch.bfloat16))
