"""The committed validation runs predicted again by this zsim: the measured steps stay as they
were measured, the predictions come from the committed profiles (microbenchmarks only) and the
model as it is now. A model change that makes the loop worse shows here without a new run
(`tests/test_validation_committed.py`, `benchmarks/validation/summarize.py --repredict`).
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

from zsim.inputs.scenario import parse_model
from zsim.validate.compare import Prediction, error_pct, predict
from zsim.validate.runner import Case
from zsim.workload.parallel import ParallelConfig, Precision, ZeroStage


@dataclass(frozen=True)
class Committed:
    """One committed case: what it was, what was measured, what zsim predicts for it now."""

    case: Case
    measured_s: float
    prediction: Prediction
    profile: Path

    @property
    def error_pct(self) -> float:
        err = error_pct(self.prediction.step_time_s, self.measured_s)
        assert err is not None
        return err

    @property
    def in_band(self) -> bool:
        return self.prediction.low_s <= self.measured_s <= self.prediction.high_s


def case_of(row: dict[str, str]) -> Case:
    """The case a row of predicted_vs_measured.csv describes (dp = every rank)."""
    parallel = ParallelConfig(
        dp=int(row["world"]),
        zero_stage=ZeroStage(int(row["stage"])),
        micro_batch=int(row["micro_batch"]),
        grad_accum=int(row["grad_accum"]),
        precision=Precision(row["precision"]),
    )
    return Case(
        name=row["case"],
        model=parse_model(row["model_spec"]),
        parallel=parallel,
        topology=row["topology"],
        nodes=int(row["nodes"]),
        ranks_per_node=int(row["ranks_per_node"]),
        device=row["device"],
    )


def repredicted(folder: Path, root: Path, band_samples: int = 0) -> list[Committed]:
    """Every measured case of one `zsim validate` output folder, predicted again; profile
    paths in the rows are relative to `root` (the repository)."""
    out = []
    with (folder / "predicted_vs_measured.csv").open() as f:
        for row in csv.DictReader(f):
            if row["status"] != "ok" or not row["measured_step_s"]:
                continue
            profile = root / row["profile"]
            prediction = predict(case_of(row), profile, band_samples)
            out.append(Committed(case_of(row), float(row["measured_step_s"]), prediction, profile))
    return out
