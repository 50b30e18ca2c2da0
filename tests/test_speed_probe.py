"""The machine's speed probe (`zsim.validate.speed`): what it records, not how fast."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zsim.validate import speed

pytest.importorskip("torch")


def test_the_spread_is_the_slowest_over_the_fastest() -> None:
    probes = [{"gemm": 2.0, "copy": 1.0}, {"gemm": 2.5, "copy": 1.0}, {"gemm": 2.2, "copy": 1.1}]
    assert speed.spread_pct(probes) == pytest.approx({"gemm": 25.0, "copy": 10.0})


def test_each_round_appends_its_probe(tmp_path: Path) -> None:
    speed.record_round(tmp_path, 0, ranks=1)
    speed.record_round(tmp_path, 1, ranks=2)
    rounds = json.loads((tmp_path / "probes.json").read_text())
    assert [r["round"] for r in rounds] == [0, 1]
    for r in rounds:
        assert set(r["probe_s"]) == {"gemm_512x3072x768_s", "copy_64MiB_s", "add_64MiB_s"}
        assert all(seconds > 0 for seconds in r["probe_s"].values())
