"""Every Triton kernel specialisation lowprec launches compiles for an H100 (sm_90), here, with no GPU.

The interpreter tests run a kernel's Python but not Triton's compiler, which refuses code the interpreter
runs (the fused Adam kernels once failed to compile on the GPU host for every configuration while their
interpreted tests passed). tests/kernels/sm90_compile.py records the launches and compiles each one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")
HERE = os.path.dirname(__file__)


@pytest.fixture(scope="module")
def compilation():
    # a process of its own: TRITON_INTERPRET, which other tests set, must be unset when the kernels are defined
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), *filter(None, [os.environ.get("PYTHONPATH")])])
    proc = subprocess.run([sys.executable, os.path.join(HERE, "sm90_compile.py")], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture
def compiled(compilation):
    return compilation["compiled"]


@pytest.fixture
def flushed(compilation):
    return compilation["ftz"]


@pytest.fixture
def contracted(compilation):
    return compilation["fma"]


@pytest.mark.parametrize("kernel", ["amax_pass", "reduce_pass", "update_pass", "scale_kernel",
                                    "cast_transpose_kernel", "transpose_kernel", "encode_kernel", "decode_kernel"])
def test_every_launched_specialisation_compiles_for_sm90(compiled, kernel):
    mine = {key: result for key, result in compiled.items() if key.startswith(kernel + "(")}
    assert mine, f"no launch of {kernel} was recorded"
    failed = {key: result for key, result in mine.items() if result != "ok"}
    assert not failed, "\n\n".join(f"{key}\n  {result}" for key, result in list(failed.items())[:3])


def test_the_adam_launches_cover_every_gradient_and_state_form(compiled):
    updates = [key for key in compiled if key.startswith("update_pass(")]
    for form in ("G_VALID=True", "G_VALID=False", "G_TY=fp8e4nv", "M_TY=fp8e4nv", "V_TY=fp8e5", "P_TY=bf16",
                 "DECOUPLED=False", "MAXIMIZE=True", "ALIGNED=False", "ALIGNED=True",
                 "P_SR=True, P_MAX=65504.0, P_TY=fp16", "P_SR=True, P_MAX=3.3895313892515355e+38, P_TY=bf16",
                 "P_SR=False, P_MAX=0.0, P_TY=fp16"):
        assert any(form in key for key in updates), form


def test_the_adam_passes_contract_no_product_into_an_fma(contracted):
    # Where LLVM contracts a*b+c depends on the specialisation and the vector lane: an FP8 store's gradient
    # and the same gradient in .grad rounded differently on an H200 (tests/gpu/test_msamp_gpu.py), and the
    # amax pass must compute the moments the update pass stores. adam.py launches both with no FP fusion.
    passes = {key: n for key, n in contracted.items() if key.startswith(("amax_pass(", "update_pass("))}
    assert passes and not any(passes.values()), {k: n for k, n in passes.items() if n}


def test_the_activation_codec_keeps_subnormals(flushed):
    # a group scaled by 2**126 (a tiny amax) decodes to FP32 subnormals: a flushing multiply would zero them
    mine = {key: n for key, n in flushed.items() if key.startswith(("encode_kernel(", "decode_kernel("))}
    assert mine and not any(mine.values()), {k: n for k, n in mine.items() if n}


def test_the_activation_codec_launches_cover_every_dtype_and_group_form(compiled):
    encodes = [key for key in compiled if key.startswith("encode_kernel(")]
    decodes = [key for key in compiled if key.startswith("decode_kernel(")]
    for dtype in ("fp32", "bf16", "fp16"):
        assert any(f"x_ptr=*{dtype}" in key for key in encodes), dtype
        assert any(f"out_ptr=*{dtype}" in key for key in decodes), dtype
    assert any("BLOCK_G=64" in key for key in encodes) and any("BLOCK_G=128" in key for key in encodes)
