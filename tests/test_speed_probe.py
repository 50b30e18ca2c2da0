"""The machine's speed probe (`zsim.calibrate.speed`): what it records, not how fast."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zsim.calibrate import speed

pytest.importorskip("torch")


def test_the_spread_is_the_slowest_over_the_fastest() -> None:
    probes = [{"gemm": 2.0, "copy": 1.0}, {"gemm": 2.5, "copy": 1.0}, {"gemm": 2.2, "copy": 1.1}]
    assert speed.spread_pct(probes) == pytest.approx({"gemm": 25.0, "copy": 10.0})


def test_each_round_appends_its_probe(tmp_path: Path) -> None:
    assert speed.settled_round(tmp_path, 0, ranks=1)  # no reference: every round counts
    assert speed.settled_round(tmp_path, 1, ranks=2)
    rounds = json.loads((tmp_path / "probes.json").read_text())
    assert [r["round"] for r in rounds] == [0, 1]
    for r in rounds:
        assert set(r["probe_s"]) == {"gemm_512x3072x768_s", "copy_64MiB_s", "add_64MiB_s"}
        assert all(seconds > 0 for seconds in r["probe_s"].values())


REFERENCE = {"gemm": 1.0, "copy": 2.0}


def test_drift_is_each_operations_change_against_the_reference() -> None:
    assert speed.drift_pct(REFERENCE, {"gemm": 1.05, "copy": 1.6}) == pytest.approx(
        {"gemm": 5.0, "copy": -20.0}
    )
    assert speed.within(REFERENCE, {"gemm": 1.09, "copy": 1.82})  # within 10 % either way
    assert not speed.within(REFERENCE, {"gemm": 1.0, "copy": 2.3})  # slower by 15 %
    assert not speed.within(REFERENCE, {"gemm": 0.85, "copy": 2.0})  # faster counts too
    assert speed.within(None, {"gemm": 9.0, "copy": 9.0})


def test_a_drifted_round_waits_then_runs_marked(tmp_path: Path) -> None:
    """The rule: probe, then again WAIT_S later while off the reference, RETRIES times."""
    probes = iter([{"gemm": 1.5, "copy": 2.0}, {"gemm": 1.3, "copy": 2.0}, REFERENCE])
    waited: list[float] = []
    ok = speed.settled_round(tmp_path, 0, 2, REFERENCE, lambda _: next(probes), waited.append)
    assert ok
    assert waited == [speed.WAIT_S] * 2
    rounds = json.loads((tmp_path / "probes.json").read_text())
    assert [r["within"] for r in rounds] == [False, False, True]
    slow = {"gemm": 2.0, "copy": 2.0}
    ok = speed.settled_round(tmp_path, 1, 2, REFERENCE, lambda _: slow, waited.append)
    assert not ok
    assert len(waited) == 2 + speed.RETRIES
