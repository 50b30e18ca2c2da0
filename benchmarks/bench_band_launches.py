"""Accuracy of the prediction band: profiles resampled by whole worker launches, or as if every
repeat were an independent draw.

    python benchmarks/bench_band_launches.py calibration/repeat/cpu-2rank-c.json \\
        benchmarks/validation/cpu-1x2      # prints the table in calibration_repeat.md

For each case of a committed validation run (its measured step time, DeepSpeed on this CPU),
zsim's step time and 5-95 % band under a calibration that recorded its launches, drawn as
`zsim validate` draws it (`sample_profiles`: whole launches first), and under the same
measurements with the launch boundaries dropped (every repeat independent). The profile comes
from microbenchmarks only; the measured step times are read, never fitted.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

from zsim.calibrate.profile import load_calibration, save_profile
from zsim.inputs.scenario import parse_model
from zsim.validate.compare import Prediction, predict
from zsim.validate.runner import Case
from zsim.workload.ds_config import from_ds_config
from zsim.workload.parallel import Precision


def cases(run: Path) -> list[tuple[Case, float]]:
    """The validation run's cases (as its first launch recorded them) and measured steps."""
    out = []
    with (run / "predicted_vs_measured.csv").open() as f:
        for row in csv.DictReader(f):
            case_file = run / "launch0" / "runs" / row["case"] / "case.json"
            recorded = json.loads(case_file.read_text())
            parallel = from_ds_config(
                recorded["ds_config"], dp=int(row["world"]), precision=Precision(row["precision"])
            )
            case = Case(row["case"], parse_model(row["model_spec"]), parallel, row["topology"])
            out.append((case, float(row["measured_step_s"])))
    return out


def band(p: Prediction) -> str:
    return f"{1e3 * p.step_time_s:.1f} [{1e3 * p.low_s:.1f}-{1e3 * p.high_s:.1f}]"


def main(argv: list[str]) -> int:
    profile, run = Path(argv[0]), Path(argv[1])
    cal = load_calibration(profile)
    flat = dataclasses.replace(
        cal,
        measurements=tuple(dataclasses.replace(r, launch_samples=()) for r in cal.measurements),
    )
    with tempfile.TemporaryDirectory() as tmp:
        flat_path = Path(tmp) / "flat.json"
        save_profile(flat, flat_path)
        print(f"Profile `{profile}`; measured: `{run}`.\n")
        print("| case | measured ms | by launches ms | independent repeats ms |")
        print("|---|---:|---:|---:|")
        for case, measured in cases(run):
            by_launch, flat_band = predict(case, profile), predict(case, flat_path)
            print(f"| {case.name} | {1e3 * measured:.1f} | {band(by_launch)} | {band(flat_band)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
