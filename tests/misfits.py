"""Print the known-misfit lists of tests/test_calibrate_profile.py for a calibration, after a
recalibration moved rows across the 10 % line: `python -m tests.misfits [PROFILE]`.

Each entry: the model against the median of the stored repeats, [quartiles], the median of
each launch, and whether one time is within 10 % of every launch's median (launches agree)."""

from __future__ import annotations

import sys
from pathlib import Path

from zsim.calibrate.fit import fitted_rows
from zsim.calibrate.measurement import FIT_TOLERANCE, Kind, Measurement
from zsim.calibrate.profile import load_calibration
from zsim.calibrate.replay import model_of


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g}"


def reason(row: Measurement, predicted: float) -> str:
    agree = "agree" if row.launches_agree else "apart"
    return (
        f"{predicted / row.time_s - 1:+.0%}: mean {_ms(row.time_s)} ms "
        f"(median {_ms(row.median_s)} [{_ms(row.q1_s)}-{_ms(row.q3_s)}]), "
        f"launches {'/'.join(_ms(m) for m in row.launch_times_s)} ms (launches {agree})"
    )


def misfits(path: Path) -> dict[str, dict[str, str]]:
    cal = load_calibration(path)
    model = model_of(cal)
    found: dict[str, dict[str, str]] = {"KERNEL": {}, "COLLECTIVE": {}}
    for row in fitted_rows(cal.measurements, cal.provenance):
        predicted = model(row)
        if abs(predicted / row.time_s - 1) > FIT_TOLERANCE:
            kind = "COLLECTIVE" if row.kind is Kind.COLLECTIVE else "KERNEL"
            found[kind][row.label] = reason(row, predicted)
    return found


def main(argv: list[str]) -> int:
    path = Path(argv[0]) if argv else Path("calibration/cpu-2rank.json")
    for kind, rows in misfits(path).items():
        print(f"KNOWN_{kind}_MISFITS = {{")
        for label, text in rows.items():
            line = f"    {label!r}: {text!r},"
            if len(line) > 100:  # split where the launches begin, as ruff would not
                head, tail = text.split(" launches ", 1)
                line = f"    {label!r}: {head + ' '!r}\n    {'launches ' + tail!r},"
            print(line.replace("'", '"'))
        print("}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
