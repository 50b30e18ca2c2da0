"""The validation's results as files: one CSV row per case (step time predicted vs measured,
memory by category), the figure (`zsim.validate.plots`) and summary.json (MAPE, statuses, the
emulated link)."""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from zsim.step.phases import PHASES
from zsim.testbed.emulate import LinkEmulation
from zsim.validate import plots
from zsim.validate.compare import MEMORY_CATEGORIES, Compared, error_pct, mape
from zsim.validate.runner import Status
from zsim.workload.parallel import DpEngine

PHASE_COLUMNS = (*PHASES, *(f"{p}_comm" for p in PHASES))


def row(c: Compared, context: dict[str, Any]) -> dict[str, Any]:
    """One CSV row: the case, the status, step time predicted vs measured, memory by category."""
    case, m, p = c.case, c.measurement, c.prediction
    out: dict[str, Any] = {
        "case": case.name,
        "stage": int(case.parallel.zero_stage),
        "model": case.model.name,
        "params": case.model.total_params(),
        "world": case.world,
        "tp": case.parallel.tp,
        "pp": case.parallel.pp,
        "nodes": case.nodes,
        "ranks_per_node": case.ranks_per_node,
        "topology": case.topology,
        "device": case.device,
        "precision": str(case.parallel.precision),
        "micro_batch": case.parallel.micro_batch,
        "grad_accum": case.parallel.grad_accum,
        "hpz_partition_size": case.parallel.knobs.hpz_partition_size,
        "dp_engine": str(case.parallel.dp_engine),
        "fsdp_sharding": str(case.parallel.fsdp_sharding) if _fsdp(c) else "",
        "fsdp_shard_size": case.parallel.fsdp_shard_size if _fsdp(c) else "",
        "status": str(m.status),
        "detail": m.detail,
        "measured_step_s": m.step_time_s,
        "predicted_step_s": p.step_time_s if p else None,
        "predicted_low_s": p.low_s if p else None,
        "predicted_high_s": p.high_s if p else None,
        "band_model_error_pct": 100 * p.model_error if p else None,
        "step_error_pct": c.step_error_pct,
        "prediction_note": c.prediction_note,
        "measured_samples_per_s": m.samples_per_s,
        "measured_tokens_per_s": m.tokens_per_s,
        "measured_steps_s": " ".join(f"{t:.4f}" for t in m.step_times_s),
    }
    measured, predicted = c.measured_memory(), c.ledger_memory()
    for cat in MEMORY_CATEGORIES:
        got, want = measured[cat], predicted[cat]
        out[f"measured_{cat}_bytes"] = got
        out[f"ledger_{cat}_bytes"] = None if math.isnan(want) else want
        out[f"{cat}_error_pct"] = (
            error_pct(want, got) if got is not None and not math.isnan(want) else None
        )
    for phase in PHASE_COLUMNS:
        out[f"measured_phase_{phase}_s"] = (m.phases or {}).get(phase)
        out[f"predicted_phase_{phase}_s"] = p.phases.get(phase) if p else None
    out["measured_nic_bytes_per_step"] = m.nic_bytes_per_step
    out["predicted_nic_bytes_per_step"] = p.nic_bytes if p else None
    out["nic_error_pct"] = c.nic_error_pct
    out["measured_other_bytes"] = (m.held_bytes or {}).get("other")
    out["measured_peak_rss_bytes"] = m.peak_rss_bytes
    out["measured_max_memory_allocated_bytes"] = m.max_memory_allocated_bytes
    out["wall_s"] = round(m.wall_s, 1)
    return out | context


def _fsdp(c: Compared) -> bool:
    return c.case.parallel.dp_engine is DpEngine.FSDP


def to_csv(rows: Sequence[dict[str, Any]]) -> str:
    buffer = io.StringIO()
    columns = list(dict.fromkeys(k for r in rows for k in r))
    writer = csv.DictWriter(buffer, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for r in rows:
        writer.writerow({k: _cell(v) for k, v in r.items()})
    return buffer.getvalue()


def _cell(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return value


def ok_cases(rows: Sequence[Compared]) -> list[Compared]:
    return [r for r in rows if r.measurement.status is Status.OK]


def write_results(
    rows: Sequence[Compared],
    context: dict[str, Any],
    out: Path,
    title: str,
    link: LinkEmulation | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """predicted_vs_measured.csv and .png, and summary.json (MAPE, statuses, the emulation)."""
    table = [row(r, context) for r in rows]
    (out / "predicted_vs_measured.csv").write_text(to_csv(table))
    fig = plots.figure(rows, title)
    fig.savefig(out / "predicted_vs_measured.png", dpi=120)
    summary = {
        "mape_pct": mape(rows),
        "cases": {r.case.name: str(r.measurement.status) for r in rows},
        "step_error_pct": {r.case.name: r.step_error_pct for r in rows},
        "nic_bytes_error_pct": {r.case.name: r.nic_error_pct for r in rows},
        "emulation": link.as_dict() if link is not None else None,
        "context": context,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return table, summary
