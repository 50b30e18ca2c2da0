"""The tables of benchmarks/results/reference_runs.md from the compared rows: MAPE per file and
per source, the error by slice, the worst rows and why rows were not simulated."""

from __future__ import annotations

import csv
import math
import re
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from reference_mapping import FILES, MD_OUT
from results_md import write_block

from zsim.plan.agreement import spearman
from zsim.plan.robustness import SLOWER_LINKS  # the sweeps' what-if is zsim plan's default

COLUMNS = [
    "row_id",
    "file",
    "source_id",
    "status",
    "scenario",
    "measured_from",
    "measured_step_s",
    "predicted_step_s",
    "error_pct",
    "compute_frac",
    "exposed_comm_frac",
    "idle_frac",
    "predicted_mfu_pct",
    "fits_memory",
    "predicted_slower_links_s",
    "assumed",
    "notes",
    "reason",
    "gpu",
    "tp",
    "pp",
    "dp",
    "micro_batch",
    "seq_len",
    "flash",
    "sim_wall_s",
]


# slices of the simulated rows: how the error moves with one variable
SLICES: dict[str, Any] = {
    "GPU": lambda r: r["gpu"],
    "tensor parallel": lambda r: f"tp {r['tp']}",
    "pipeline stages": lambda r: (
        "pp 1" if r["pp"] == 1 else ("pp 2-8" if r["pp"] <= 8 else "pp > 8")
    ),
    "micro-batch": lambda r: f"mb {r['micro_batch']}" if r["micro_batch"] < 8 else "mb >= 8",
    "sequence": lambda r: (
        "s <= 1k"
        if r["seq_len"] <= 1024
        else (
            "s 2-4k"
            if r["seq_len"] <= 4096
            else ("s 8-16k" if r["seq_len"] <= 16384 else "s >= 32k")
        )
    ),
    "attention": lambda r: "flash" if r["flash"] else "unfused (softmax in HBM)",
}


def mape(rows: Iterable[dict[str, Any]]) -> tuple[float, float, int]:
    """(MAPE %, median signed error %, n)."""
    errors = [float(r["error_pct"]) for r in rows]
    if not errors:
        return math.nan, math.nan, 0
    return statistics.fmean(abs(e) for e in errors), statistics.median(errors), len(errors)


def tables(results: list[dict[str, Any]], header: str) -> str:
    done = [r for r in results if r["status"] == "compared"]
    lines = [header, ""]
    lines += _per_file(results, done)
    lines += _by_source(done)
    lines += _by_slice(done)
    lines += _worst(done)
    lines += _sweeps(done)
    lines += _not_simulated(results)
    return "\n".join(lines) + "\n"


def _given(rows: list[dict[str, Any]]) -> str:
    mf, _, nf = mape(r for r in rows if not r["assumed"])
    return f"{mf:.1f} ({nf})" if nf else "-"


def _per_file(results: list[dict[str, Any]], done: list[dict[str, Any]]) -> list[str]:
    lines = [
        "### MAPE per file (error = (predicted - measured) / measured step time)",
        "",
        "| file | rows in file | mapped | simulated | MAPE % | median error % "
        "| MAPE %, config given in full (n) |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, file in FILES.items():
        mine = [r for r in results if r["file"] == file]
        sims = [r for r in done if r["file"] == file]
        mapped = [r for r in mine if r["status"] != "skipped"]
        m, med, n = mape(sims)
        lines.append(
            f"| {key} | {len(mine)} | {len(mapped)} | {n} | {m:.1f} | {med:+.1f} | {_given(sims)} |"
        )
    m, med, n = mape(done)
    lines.append(
        f"| **all** | {len(results)} | | {n} | **{m:.1f}** | {med:+.1f} | {_given(done)} |"
    )
    return lines


def _by_source(done: list[dict[str, Any]]) -> list[str]:
    lines = [
        "",
        "### By source",
        "",
        "| source | n | MAPE % | median error % |",
        "|---|---|---|---|",
    ]
    for source in sorted({r["source_id"] for r in done}):
        m, med, n = mape(r for r in done if r["source_id"] == source)
        lines.append(f"| {source} | {n} | {m:.1f} | {med:+.1f} |")
    return lines


def _by_slice(done: list[dict[str, Any]]) -> list[str]:
    lines = ["", "### Error by slice (file: n, median error %)", ""]
    keys = list(FILES.values())
    lines += ["| slice | " + " | ".join(FILES) + " |", "|---|" + "---|" * len(FILES)]
    for name, key in SLICES.items():
        for value in sorted({key(r) for r in done}):
            cells = []
            for file in keys:
                errs = [
                    float(r["error_pct"]) for r in done if r["file"] == file and key(r) == value
                ]
                cells.append(f"{len(errs)}: {statistics.median(errs):+.1f}" if errs else "")
            lines.append(f"| {name}: {value} | " + " | ".join(cells) + " |")
    return lines


def _worst(done: list[dict[str, Any]]) -> list[str]:
    lines = [
        "",
        "### Worst rows",
        "",
        "| row | scenario | measured s | predicted s | error % | compute / exposed comm / idle "
        "| assumed (not in the source) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in sorted(done, key=lambda r: -abs(float(r["error_pct"])))[:12]:
        split = f"{r['compute_frac']:.2f} / {r['exposed_comm_frac']:.2f} / {r['idle_frac']:.2f}"
        lines.append(
            f"| {r['row_id']} | {r['scenario']} | {r['measured_step_s']} | "
            f"{r['predicted_step_s']} | {r['error_pct']:+.1f} | {split} | {r['assumed']} |"
        )
    return lines


def sweep_groups(done: list[dict[str, Any]]) -> dict[tuple[str, ...], list[dict[str, Any]]]:
    """Rows of one source that ran one model on one cluster at one global batch in several
    layouts (at least 3 rows, 2 layouts), by (source, model, cluster, global batch)."""
    groups: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for r in done:
        model, layout, cluster = (part.strip() for part in str(r["scenario"]).split(";"))
        m = re.search(r"\bmb(\d+) ga(\d+)", layout)
        batch = int(r["dp"]) * int(m.group(1)) * int(m.group(2)) if m else 0
        groups.setdefault((r["source_id"], model, cluster, str(batch)), []).append(r)
    return {
        key: rows
        for key, rows in sorted(groups.items())
        if len(rows) >= 3 and len({(r["tp"], r["pp"], r["dp"], r["micro_batch"]) for r in rows}) > 1
    }


def _sweeps(done: list[dict[str, Any]]) -> list[str]:
    """Whether zsim orders each sweep (`sweep_groups`) as measured, and what picking its
    fastest cost in measured step time over the measured fastest (the planner's question),
    at the modelled links and with every link at 1 / SLOWER_LINKS of its bandwidth."""
    lines = [
        "",
        "### Layout sweeps: does zsim order them as measured?",
        "",
        "| source | model; cluster; global batch | rows | layouts | Spearman | zsim's fastest, "
        f"measured over the measured fastest | the same, links at 1/{SLOWER_LINKS:g} |",
        "|---|---|---|---|---|---|---|",
    ]
    for (source, model, cluster, batch), rows in sweep_groups(done).items():
        layouts = {(r["tp"], r["pp"], r["dp"], r["micro_batch"]) for r in rows}
        measured = [float(r["measured_step_s"]) for r in rows]
        rho = spearman(measured, [float(r["predicted_step_s"]) for r in rows])
        regrets = []
        for column in ("predicted_step_s", "predicted_slower_links_s"):
            if not all(r.get(column) for r in rows):
                regrets.append("-")
                continue
            pick = min(range(len(rows)), key=lambda i: float(rows[i][column]))
            regrets.append(f"{measured[pick] / min(measured) - 1:+.1%}")
        lines.append(
            f"| {source} | {model}; {cluster.split()[0]}; {batch} | {len(rows)} | "
            f"{len(layouts)} | {rho:+.2f} | {regrets[0]} | {regrets[1]} |"
        )
    return lines


def _not_simulated(results: list[dict[str, Any]]) -> list[str]:
    reasons: dict[str, int] = {}
    for r in results:
        if r["status"] != "compared":
            reasons[r["reason"]] = reasons.get(r["reason"], 0) + 1
    lines = ["", "### Rows not simulated", "", "| reason | rows |", "|---|---|"]
    for reason, count in sorted(reasons.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {reason} | {count} |")
    return lines


def write_md(block: str) -> None:
    write_block(MD_OUT, block)


def load_results(path: Path) -> list[dict[str, Any]]:
    """A previous run's CSV, typed as `run_case` returns it (to re-render the tables)."""
    ints = ("tp", "pp", "dp", "micro_batch", "seq_len")
    floats = ("measured_step_s", "predicted_step_s", "error_pct", "compute_frac")
    floats += ("exposed_comm_frac", "idle_frac", "predicted_mfu_pct", "predicted_slower_links_s")
    with path.open(newline="", encoding="utf-8") as f:
        rows: list[dict[str, Any]] = list(csv.DictReader(f))
    for row in rows:
        for key in ints + floats:
            if row.get(key):
                row[key] = int(row[key]) if key in ints else float(row[key])
        row["flash"] = row.get("flash") == "True"
    return rows
