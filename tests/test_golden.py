"""Every golden scenario gives exactly its recorded output (tests/golden): a refactoring moves
no number, to the last bit. Re-record only for a change meant to move numbers, and say why."""

from __future__ import annotations

import json

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
    assert output(SCENARIOS[name]) == RECORDED[name]
