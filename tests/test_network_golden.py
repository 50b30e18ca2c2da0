"""The faster network answers as the flow-by-flow one did (issue 13): on each scenario of
tests/golden/network_scenarios.py, the step time within 0.1 % of the one recorded before the
speed work, and the bytes on each link class counted from the calls issued equal to those the
flow-by-flow simulation carried with every rank simulated and every flow on the network."""

from __future__ import annotations

import json

import pytest

from tests.golden.network_scenarios import SCENARIOS
from tests.golden.record_network import OUTPUTS, inputs
from zsim.simulation import simulate

RECORDED = json.loads(OUTPUTS.read_text())


def test_at_least_twenty_scenarios():
    assert len(SCENARIOS) >= 20
    assert sorted(RECORDED) == sorted(SCENARIOS)


@pytest.mark.consistency
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_step_time_and_bytes_per_link_class(name: str) -> None:
    s, want = SCENARIOS[name], RECORDED[name]
    model, cfg, topo, device = inputs(s)
    report = simulate(model, cfg, topo, device, full=s.full, stragglers=s.stragglers or None)
    assert report.step_time_s == pytest.approx(want["step_time_s"], rel=1e-3)
    assert report.link_traffic_bytes == pytest.approx(want["link_bytes"], rel=1e-12)
