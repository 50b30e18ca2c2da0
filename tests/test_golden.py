"""Every golden scenario gives its recorded output (tests/golden): a refactoring moves no
number. Integers and strings are equal; floats agree to 1e-12 relative, the rounding of the
last bits that numpy's releases change (numpy 2.4's sums moved seven scenarios by 1 ulp) and
an exactly-equal refactoring keeps. Re-record only for a change meant to move numbers, and
say why."""

from __future__ import annotations

import json
import math

import pytest

from tests.golden.record import OUTPUTS, output
from tests.golden.scenarios import SCENARIOS

RECORDED = json.loads(OUTPUTS.read_text())


def test_every_scenario_is_recorded() -> None:
    assert sorted(RECORDED) == sorted(SCENARIOS)
    assert len(SCENARIOS) >= 30


@pytest.mark.consistency
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_output_is_the_recorded_one(name: str) -> None:
    assert _same(output(SCENARIOS[name]), RECORDED[name]), name


def _same(got: object, want: object, path: str = "") -> bool:
    if isinstance(want, dict) and isinstance(got, dict):
        assert sorted(got) == sorted(want), path
        return all(_same(got[k], want[k], f"{path}.{k}") for k in want)
    if isinstance(want, list) and isinstance(got, list):
        assert len(got) == len(want), path
        return all(
            _same(g, w, f"{path}[{i}]") for i, (g, w) in enumerate(zip(got, want, strict=True))
        )
    if _number(want) and _number(got) and (isinstance(want, float) or isinstance(got, float)):
        assert math.isclose(got, want, rel_tol=1e-12, abs_tol=1e-15), (path, got, want)
        return True
    assert type(got) is type(want), (path, got, want)
    assert got == want, (path, got, want)
    return True


def _number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)
