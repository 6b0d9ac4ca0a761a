"""lowprec's LOWPREC_*=0|1 switches, read by one function."""

from __future__ import annotations

import pytest

from lowprec.utils.env import switch


@pytest.mark.parametrize(("value", "expected"), [(None, None), ("", None), ("  ", None), ("0", False), (" 1 ", True)])
def test_a_switch_reads_0_1_and_unset(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("LOWPREC_TEST_SWITCH", raising=False)
    else:
        monkeypatch.setenv("LOWPREC_TEST_SWITCH", value)
    assert switch("LOWPREC_TEST_SWITCH", "what it does") is expected


@pytest.mark.parametrize("value", ["yes", "true", "2", "on"])
def test_anything_else_is_refused_naming_the_variable_its_values_and_meaning(monkeypatch, value):
    monkeypatch.setenv("LOWPREC_TEST_SWITCH", value)
    with pytest.raises(ValueError, match=rf"LOWPREC_TEST_SWITCH='{value}' is not one of '0', '1' \(what it does\)"):
        switch("LOWPREC_TEST_SWITCH", "what it does")
