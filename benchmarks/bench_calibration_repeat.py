"""How well a calibration repeats, and how well its fit predicts another calibration.

    python benchmarks/bench_calibration_repeat.py calibration/cpu-2rank.json \\
        calibration/repeat/cpu-2rank-a.json calibration/repeat/cpu-2rank-b.json
        # prints the markdown recorded in benchmarks/results/calibration_repeat.md

Calibrations of the same machine, same plan, measured one after the other. For every fitted
row of the first and each other one: how far its mean (`Measurement.time_s`, what the fits
target) moved (the measurement's own repeatability), how far the first profile's model is
from the first's mean (the fit's residual) and from the other's (a prediction of measurements
the fit never saw). On a shared
host the first number is the floor under the other two: no model reproduces a row closer than
the row repeats. Then the collective rows whose means, over all the calibrations, span more
than 1.1 / 0.9: no single predicted time is within 10 % of each of them, so a model fitted
within 10 % of one calibration's mean of such a row is more than 10 % off another's.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from zsim.calibrate.fit import fitted_rows
from zsim.calibrate.measurement import Kind
from zsim.calibrate.profile import Calibration, load_calibration
from zsim.calibrate.replay import model_of

TOLERANCE = 0.10


def rel(a: float, b: float) -> float:
    return a / b - 1.0


def summary(label: str, errors: Sequence[float]) -> str:
    over = sum(abs(e) > TOLERANCE for e in errors)
    absolute = [abs(e) for e in errors]
    return (
        f"| {label} | {len(errors)} | {100 * statistics.median(absolute):.1f} % "
        f"| {100 * max(absolute):.1f} % | {over} |"
    )


def main(argv: Sequence[str]) -> int:
    cals = [load_calibration(Path(p)) for p in argv]
    print(f"First: `{argv[0]}` ({cals[0].provenance.get('date')}).\n")
    for path, other in zip(argv[1:], cals[1:], strict=True):
        compare(cals[0], path, other)
    spread(argv, cals)
    return 0


def compare(first: Calibration, path: str, second: Calibration) -> None:
    """The table of `second` (at `path`) against `first` and the first's fit."""
    model = model_of(first)
    seconds = {(r.kind, r.label): r for r in fitted_rows(second.measurements, second.provenance)}
    moved: dict[str, list[float]] = {}
    residual: dict[str, list[float]] = {}
    predicted: dict[str, list[float]] = {}
    for row in fitted_rows(first.measurements, first.provenance):
        other = seconds.get((row.kind, row.label))
        if other is None:
            continue
        group = "collective" if row.kind is Kind.COLLECTIVE else "kernel"
        moved.setdefault(group, []).append(rel(other.time_s, row.time_s))
        residual.setdefault(group, []).append(rel(model(row), row.time_s))
        predicted.setdefault(group, []).append(rel(model(row), other.time_s))
    launches = second.provenance.get("launches", 1)
    print(f"Second: `{path}` ({second.provenance.get('date')}, {launches} launches).\n")
    print("| rows | count | median abs | worst abs | rows over 10 % |")
    print("|---|---:|---:|---:|---:|")
    for group in sorted(moved):
        print(summary(f"{group}: second mean vs first", moved[group]))
        print(summary(f"{group}: first's fit vs first (residual)", residual[group]))
        print(summary(f"{group}: first's fit vs second (unseen)", predicted[group]))
    print()


def spread(paths: Sequence[str], cals: Sequence[Calibration]) -> None:
    """The collective rows no single time is within 10 % of in every calibration."""
    by_label = [
        {r.label: r.time_s for r in fitted_rows(c.measurements, c.provenance)} for c in cals
    ]
    rows = fitted_rows(cals[0].measurements, cals[0].provenance)
    wide = []
    for row in rows:
        means = [b[row.label] for b in by_label if row.label in b]
        if row.kind is Kind.COLLECTIVE and max(means) / min(means) > 1.1 / 0.9:
            wide.append((row.label, means))
    total = sum(r.kind is Kind.COLLECTIVE for r in rows)
    print(f"Collective rows whose means over the {len(cals)} calibrations span more than")
    print(f"1.1 / 0.9 (no single time is within 10 % of each): {len(wide)} of {total}.\n")
    print("| row | " + " | ".join(f"`{Path(p).stem}` ms" for p in paths) + " |")
    print("|---|" + "---:|" * len(paths))
    for label, means in wide:
        print(f"| {label} | " + " | ".join(f"{1e3 * m:.3f}" for m in means) + " |")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
