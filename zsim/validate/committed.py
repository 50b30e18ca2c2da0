"""The committed validation runs predicted again by this zsim: the measured steps stay as they
were measured, the predictions come from the committed profiles (microbenchmarks only) and the
model as it is now. A model change that makes the loop worse shows here without a new run
(`tests/test_validation_committed.py`, `benchmarks/validation/summarize.py --repredict`).
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from zsim.inputs.scenario import parse_model
from zsim.validate.compare import Prediction, compare, error_pct, predict
from zsim.validate.results import write_results
from zsim.validate.runner import Case, Measurement, Status, collect, combine_launches
from zsim.workload.parallel import DpEngine, ParallelConfig, Precision, ZeroStage
from zsim.workload.sharding import FsdpSharding


@dataclass(frozen=True)
class Committed:
    """One committed case: what it was, what was measured, what zsim predicts for it now."""

    case: Case
    measured_s: float
    prediction: Prediction
    profile: Path
    measured_nic_bytes: float | None = None  # per step, every node's interface, rx + tx

    @property
    def error_pct(self) -> float:
        err = error_pct(self.prediction.step_time_s, self.measured_s)
        assert err is not None
        return err

    @property
    def in_band(self) -> bool:
        return self.prediction.low_s <= self.measured_s <= self.prediction.high_s


def case_of(row: dict[str, str]) -> Case:
    """The case a row of predicted_vs_measured.csv describes (dp = the ranks over tp x pp;
    rows written before the tp and pp columns are pure data parallelism, rows written before
    the dp_engine column are DeepSpeed's unless `zsim validate --engine fsdp` named them
    fsdp-<sharding>)."""
    tp, pp = int(row.get("tp") or 1), int(row.get("pp") or 1)
    parallel = ParallelConfig(
        dp=int(row["world"]) // (tp * pp),
        tp=tp,
        pp=pp,
        zero_stage=ZeroStage(int(row["stage"])),
        micro_batch=int(row["micro_batch"]),
        grad_accum=int(row["grad_accum"]),
        precision=Precision(row["precision"]),
        **_fsdp_fields(row, int(row["ranks_per_node"])),
    )
    hpz = int(row.get("hpz_partition_size") or 1)  # ZeRO++'s hpZ, from a --ds-config case
    if hpz > 1:
        parallel = replace(parallel, knobs=replace(parallel.knobs, hpz_partition_size=hpz))
    return Case(
        name=row["case"],
        model=parse_model(row["model_spec"]),
        parallel=parallel,
        topology=row["topology"],
        nodes=int(row["nodes"]),
        ranks_per_node=int(row["ranks_per_node"]),
        device=row["device"],
    )


def _fsdp_fields(row: dict[str, str], ranks_per_node: int) -> dict[str, Any]:
    engine = row.get("dp_engine") or ("fsdp" if row["case"].startswith("fsdp-") else "")
    if engine != "fsdp":
        return {}
    sharding = FsdpSharding(row.get("fsdp_sharding") or row["case"].removeprefix("fsdp-"))
    hybrid = sharding is FsdpSharding.HYBRID
    size = int(row.get("fsdp_shard_size") or 0) or (ranks_per_node if hybrid else 0)
    return {"dp_engine": DpEngine.FSDP, "fsdp_sharding": sharding, "fsdp_shard_size": size}


def repredicted(folder: Path, root: Path, band_samples: int = 0) -> list[Committed]:
    """Every measured case of one `zsim validate` output folder, predicted again; profile
    paths in the rows are relative to `root` (the repository)."""
    out = []
    burst = burst_bytes(folder)
    with (folder / "predicted_vs_measured.csv").open() as f:
        for row in csv.DictReader(f):
            if row["status"] != "ok" or not row["measured_step_s"]:
                continue
            profile = root / row["profile"]
            prediction = predict(case_of(row), profile, band_samples, burst)
            nic = (
                float(row["measured_nic_bytes_per_step"] or "nan")
                if row.get("measured_nic_bytes_per_step")
                else None
            )
            measured = float(row["measured_step_s"])
            out.append(Committed(case_of(row), measured, prediction, profile, nic))
    return out


def burst_bytes(folder: Path) -> int | None:
    """The tbf bucket of the emulated links a committed folder ran on (None: not emulated)."""
    emulation = json.loads((folder / "summary.json").read_text()).get("emulation") or {}
    burst = emulation.get("burst_bytes")
    return None if burst is None else int(burst)


def remeasured(folder: Path, row: dict[str, str]) -> Measurement:
    """The measurement of one case as `zsim validate` combined it, read again from the raw
    records its launches left (`launch<i>/runs/<case>/`, or `runs/<case>/` for one launch)."""
    case = case_of(row)
    dirs = sorted(folder.glob(f"launch*/runs/{case.name}")) or [folder / "runs" / case.name]
    runs = [collect(case, d, Status.OK, "", 0.0) for d in dirs]
    combined = combine_launches(runs)
    return replace(combined, wall_s=float(row.get("wall_s") or 0.0))


def repredict_folder(folder: Path, root: Path, band_samples: int = 20) -> float | None:
    """Rewrite a committed folder's predictions (CSV, PNG, summary.json) with this zsim: the
    measurements as they were measured, the predictions from the committed profiles."""
    with (folder / "predicted_vs_measured.csv").open() as f:
        rows = [r for r in csv.DictReader(f) if r["status"] == "ok"]
    old = json.loads((folder / "summary.json").read_text())
    context = old["context"]
    burst = burst_bytes(folder)
    compared = [
        compare(remeasured(folder, r), root / r["profile"], band_samples, burst) for r in rows
    ]
    title = f"{context['model_spec']} on {context['requested_topology']}"
    if context.get("emulated"):
        rate, scale = context["emulated_rate_bps"], context.get("emulation_scale", 1.0)
        title += f" (emulated at {rate * 8 / 1e6:.0f} Mbit/s, scale {scale:g})"
    _, summary = write_results(compared, context, folder, title)
    summary["emulation"] = old.get("emulation")
    (folder / "summary.json").write_text(json.dumps(summary, indent=1))
    mape: float | None = summary["mape_pct"]
    return mape
