"""The fused low-bit Adam kernels (lowprec.kernels.adam) run on the CPU by Triton's interpreter.

CI has no GPU; Triton (a test requirement on Linux) runs the kernels' own code on CPU tensors with
TRITON_INTERPRET=1, in a separate process since the variable is read when the kernels are defined.
Interpreted, a cast to E4M3 rounds otherwise than torch's (2.2% of N(0, 10) values differ by a code), so
these tests compare two fused paths with each other (bitwise), never a fused path with the reference.
tests/gpu/test_msamp_gpu.py runs the same comparison on a GPU, where it also checks that the step makes no
host sync.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("triton")
HERE = os.path.dirname(__file__)


@pytest.fixture(scope="module")
def interpreted():
    from conftest import run_interpreted

    return run_interpreted(os.path.join(HERE, "adam_presence.py"))


@pytest.mark.parametrize("states", ["e4m3_fp16", "fp32_fp32", "fp16_params"])
def test_an_absent_fp8_gradient_is_skipped_on_the_device_as_torch_skips_a_none_grad(interpreted, states):
    from adam_presence import PRESENCE

    r = interpreted[states]
    expected = [float(sum(column)) for column in zip(*PRESENCE)] + [float(len(PRESENCE))]
    assert r["steps"] == expected and r["plain_steps"] == expected
    assert all(r["params_equal"]), r["params_equal"]
    assert all(r["states_equal"]), r["states_equal"]


@pytest.fixture(scope="module")
def rounded():
    from conftest import run_interpreted

    return run_interpreted(os.path.join(HERE, "adam_rounding.py"))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_kernels_round_a_parameter_stochastically_to_a_neighbour_without_bias(rounded, dtype):
    r = rounded[dtype]
    assert r["neighbours"] and r["both_ways"]
    assert abs(r["mean_error"]) < 6 * r["sigma"], r
    # the same updates rounded to nearest are all lost; Triton's interpreter casts FP32 to BF16 by truncation
    # (0.999 -> 0.996), the GPU to nearest: BF16's half is checked there (tests/gpu/test_msamp_gpu.py)
    assert not r["nearest_moved"] or dtype == "bfloat16"


def test_the_rounding_random_numbers_are_uniform_and_independent_across_steps_and_parameters():
    # the kernels' counter-based hash, not Philox: what stochastic rounding needs of it, on 2**14 offsets per stream
    from conftest import run_interpreted

    r = run_interpreted(os.path.join(HERE, "adam_uniform.py"))
    n, sigma = r["n"], (1 / 12 / r["n"]) ** 0.5
    assert r["in_range"] and min(r["distinct"]) > 0.99 * n
    assert all(abs(m - 0.5) < 5 * sigma for m in r["means"]), r["means"]
    assert all(abs(v - 1 / 12) < 0.004 for v in r["variances"]), r["variances"]
    assert all(abs(c) < 5 / n**0.5 for c in r["lag1"]), r["lag1"]
    assert r["max_cross_correlation"] < 6 / n**0.5, r["max_cross_correlation"]


def test_an_infinite_moment_is_stored_as_the_plain_step_stores_it():
    # NaN in E4M3, the format's inf in FP16 and E5M2 (not its max, which the saturating cast gives)
    from adam_nonfinite import problems
    from conftest import run_interpreted

    result = run_interpreted(os.path.join(HERE, "adam_nonfinite.py"))
    assert not problems(result), problems(result)
    assert result["e4m3_fp16"]["fused"]["exp_avg"][:3] == ["nan"] * 3
    assert result["fp16_e5m2"]["fused"]["exp_avg"][:3] == ["inf", "-inf", "nan"]
    assert result["fp16_e5m2"]["fused"]["exp_avg_sq"][:3] == ["inf", "inf", "nan"]
    assert result["e5m2_e4m3"]["fused"]["exp_avg"][:3] == ["inf", "-inf", "nan"]
