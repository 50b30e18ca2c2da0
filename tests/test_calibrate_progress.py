"""Calibration's progress where no terminal shows a bar (`loop.py`'s logs, CI): a plain line
per tenth of the work, so a log says how far a 20-minute calibration is."""

from __future__ import annotations

import io

from zsim.calibrate.runner import progress_bar


def test_a_log_gets_a_line_per_tenth_of_the_work():
    log = io.StringIO()  # not a terminal
    with progress_bar(True, log) as update:
        for done in range(201):
            update(done, 200, f"row {done}")
    lines = log.getvalue().splitlines()
    assert lines[0] == "calibrating: 0/200 row 0"
    assert lines[-1] == "calibrating: 200/200 row 200"
    assert len(lines) == 11  # 0 %, 10 %, ..., 100 %


def test_disabled_progress_writes_nothing():
    log = io.StringIO()
    with progress_bar(False, log) as update:
        update(5, 10, "row")
    assert log.getvalue() == ""
