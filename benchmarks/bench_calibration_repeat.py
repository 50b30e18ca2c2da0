"""How well a calibration repeats, and how well its fit predicts another calibration.

    python benchmarks/bench_calibration_repeat.py calibration/cpu-2rank.json \\
        calibration/repeat/cpu-2rank-a.json      # prints the markdown recorded in
                                                 # benchmarks/results/calibration_repeat.md

Two calibrations of the same machine, same plan, measured one after the other. For every
fitted row: how far its median moved between the two (the measurement's own repeatability),
how far the first profile's model is from the first's median (the fit's residual) and from the
second's (a prediction of measurements the fit never saw). On a shared host the first number
is the floor under the other two: no model reproduces a row closer than the row repeats.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from zsim import presets
from zsim.calibrate.fit import fitted_rows
from zsim.calibrate.links import apply_profile
from zsim.calibrate.plan import Kind, Measurement
from zsim.calibrate.profile import Calibration, load_calibration
from zsim.calibrate.replay import simulated_s

TOLERANCE = 0.10


def model_of(cal: Calibration) -> Callable[[Measurement], float]:
    """The simulator's time of a row under the calibration's profile."""
    topo = apply_profile(presets.topology(str(cal.provenance["topology"])), cal.profile)
    return lambda row: simulated_s(cal.profile, topo, row)


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
    first, second = (load_calibration(Path(p)) for p in argv[:2])
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
        moved.setdefault(group, []).append(rel(other.median_s, row.median_s))
        residual.setdefault(group, []).append(rel(model(row), row.median_s))
        predicted.setdefault(group, []).append(rel(model(row), other.median_s))
    dates = [c.provenance.get("date") for c in (first, second)]
    print(f"First: `{argv[0]}` ({dates[0]}); second: `{argv[1]}` ({dates[1]}).\n")
    print("| rows | count | median abs | worst abs | rows over 10 % |")
    print("|---|---:|---:|---:|---:|")
    for group in sorted(moved):
        print(summary(f"{group}: second median vs first", moved[group]))
        print(summary(f"{group}: first's fit vs first (residual)", residual[group]))
        print(summary(f"{group}: first's fit vs second (unseen)", predicted[group]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
