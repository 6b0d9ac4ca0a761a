"""The demo's training protocol (lowprec/demo/schedule.py), which `lowprec bench` and the two-GPU harness share."""

from __future__ import annotations

import pytest

from lowprec.demo.schedule import lr_schedule


@pytest.mark.parametrize("total", [4, 30, 300])
def test_the_rate_warms_up_over_a_fifth_then_falls_to_a_tenth(total):
    factor = lr_schedule(total)
    warm = max(2, total // 5)
    ramp = [factor(s) for s in range(warm)]
    assert ramp == [(s + 1) / warm for s in range(warm)] and ramp[-1] == 1.0  # no full-rate first step
    decay = [factor(s) for s in range(warm, total + 1)]
    assert decay[0] == 1.0 and all(a >= b for a, b in zip(decay, decay[1:]))
    assert decay[-1] == pytest.approx(0.1) and min(decay) >= 0.1 - 1e-12
