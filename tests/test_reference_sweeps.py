"""The reference benchmark's layout-sweep table: rows of one source, model, cluster and global
batch in several layouts, zsim's order of them against the measured order, and what taking
zsim's fastest would have cost in measured step time. Expected values worked by hand."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

from reference_report import _sweeps  # noqa: E402


def _row(layout: str, dp: int, measured: float, predicted: float, tp: int = 1) -> dict:
    return {
        "source_id": "s",
        "scenario": f"l2 h64; tp{tp} pp1 dp{dp} {layout} z1 full fp16; 1x8-c gpu",
        "dp": dp,
        "tp": tp,
        "pp": 1,
        "micro_batch": int(layout.split()[0][2:]),
        "measured_step_s": measured,
        "predicted_step_s": predicted,
    }


def test_a_sweep_is_scored_by_order_and_by_what_zsims_pick_costs() -> None:
    rows = [  # one global batch (dp x mb x ga = 16); zsim likes the measured slowest best
        _row("mb1 ga2", 8, 10.0, 9.0),
        _row("mb2 ga2", 4, 11.0, 9.5, tp=2),
        _row("mb4 ga2", 2, 12.0, 8.0, tp=4),
    ]
    lines = _sweeps(rows)
    assert len(lines) == 6  # the heading and one sweep
    # ranks measured (0, 1, 2), predicted (1, 2, 0): 1 - 6 x (1 + 1 + 4) / (3 x 8) = -0.5
    assert "| 3 | 3 | -0.50 | +20.0% |" in lines[-1]  # 12 s against the best 10 s


def test_one_layout_or_another_batch_is_not_a_sweep() -> None:
    rows = [_row("mb1 ga2", 8, 10.0, 9.0), _row("mb1 ga2", 8, 10.5, 9.0)]
    rows.append(_row("mb1 ga4", 8, 20.0, 18.0, tp=2))  # another global batch
    assert len(_sweeps(rows)) == 5  # the heading only
