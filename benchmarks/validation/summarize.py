"""Markdown tables of the committed validation runs (each folder here holds one
`zsim validate` output): step time predicted vs measured per case, the MAPE, and the memory
ledger's error per category against the tensors the engine held.

    python benchmarks/validation/summarize.py [--repredict] [--write]

--write replaces the tables between the markers of README.md here (the text around them is
written by hand). --repredict first predicts every committed case again with this zsim and
the committed profiles (`zsim.validate.committed`): the measurements stay as measured.
"""

from __future__ import annotations

import csv
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).parent
CATEGORIES = ("parameters", "gradients", "optimizer_states", "comm_buffers", "activations")


def _pct(text: str) -> str:
    return "n/a" if text in ("", None) else f"{float(text):+.1f}%"


def _ms(text: str) -> str:
    return "n/a" if text in ("", None) else f"{1e3 * float(text):.1f}"


def _layout(row: dict[str, str]) -> str:
    """ " (tp 2)" or " (pp 2)" beyond pure data parallelism (older rows have no such column)."""
    split = [f"{k} {row[k]}" for k in ("tp", "pp") if int(row.get(k) or 1) > 1]
    return f" ({', '.join(split)})" if split else ""


def table(folder: Path) -> list[str]:
    rows = list(csv.DictReader((folder / "predicted_vs_measured.csv").open()))
    summary = json.loads((folder / "summary.json").read_text())
    emulation = summary.get("emulation") or {}
    lines = [
        f"### {folder.name}",
        "",
        f"topology `{rows[0]['topology']}`, {rows[0]['world']} ranks{_layout(rows[0])}, model "
        f"`{summary['context']['model_spec']}`, profile `{summary['context']['profile']}`"
        + (f", emulated: {json.dumps(emulation)}" if emulation else ""),
        "",
        "| case | status | measured ms | predicted ms | band ms | error |"
        + "".join(f" {c} |" for c in CATEGORIES),
        "|---|---|---|---|---|---|" + "---|" * len(CATEGORIES),
    ]
    for r in rows:
        band = f"{_ms(r['predicted_low_s'])}-{_ms(r['predicted_high_s'])}"
        memory = "".join(f" {_pct(r[f'{c}_error_pct'])} |" for c in CATEGORIES)
        lines.append(
            f"| {r['case']} | {r['status']} | {_ms(r['measured_step_s'])} | "
            f"{_ms(r['predicted_step_s'])} | {band} | {_pct(r['step_error_pct'])} |{memory}"
        )
    mape = summary.get("mape_pct")
    lines += ["", f"MAPE: {'n/a' if mape is None else f'{mape:.1f}%'}", ""]
    return lines + phase_table(rows) + traffic_table(rows)


def traffic_table(rows: list[dict[str, str]]) -> list[str]:
    """Bytes per step on the links between nodes: what every node's interface counted (sent +
    received, headers and acknowledgements included) against the simulated bytes on the
    nodes' links; nothing where nothing was counted (one node, runs from before the count)."""
    counted = [r for r in rows if r.get("measured_nic_bytes_per_step")]
    if not counted:
        return []
    lines = [
        "Bytes between nodes per step (every node's veth, sent + received, MB):",
        "",
        "| case | counted MB | simulated MB | error |",
        "|---|---|---|---|",
    ]
    for r in counted:
        got, want = (float(r[f"{k}_nic_bytes_per_step"]) / 1e6 for k in ("measured", "predicted"))
        lines.append(f"| {r['case']} | {got:.1f} | {want:.1f} | {_pct(r['nic_error_pct'])} |")
    return [*lines, ""]


PHASES = ("forward", "backward", "step")


def phase_table(rows: list[dict[str, str]]) -> list[str]:
    """Rank 0's phases, measured / predicted ms, and inside each the time in collectives
    (`zsim.validate.phase_split`); nothing where the run recorded no phases."""
    if not any(r.get("measured_phase_forward_s") for r in rows):
        return []
    head = "".join(f" {p} | {p} comm |" for p in PHASES)
    lines = [
        "Phases of rank 0 (measured / predicted ms; comm: inside collectives, waiting for the",
        "other ranks included; rest: the step, slowest rank per step, beyond rank 0's phases):",
        "",
        f"| case |{head} rest |",
        "|---|" + "---|---|" * len(PHASES) + "---|",
    ]
    for r in rows:
        cells = "".join(
            f" {_ms(r[f'measured_phase_{k}_s'])} / {_ms(r[f'predicted_phase_{k}_s'])} |"
            for p in PHASES
            for k in (p, f"{p}_comm")
        )
        rest = [
            float(r[f"{side}_step_s"]) - sum(float(r[f"{side}_phase_{p}_s"]) for p in PHASES)
            for side in ("measured", "predicted")
        ]
        lines.append(f"| {r['case']} |{cells} {rest[0] * 1e3:.1f} / {rest[1] * 1e3:.1f} |")
    return [*lines, ""]


def case_rows(folders: list[Path]) -> list[dict[str, str]]:
    """The CSV rows of every folder's cases that have both numbers."""
    return [
        r
        for f in folders
        for r in csv.DictReader((f / "predicted_vs_measured.csv").open())
        if r["step_error_pct"]
    ]


def mape_pct(rows: list[dict[str, str]]) -> float:
    return sum(abs(float(r["step_error_pct"])) for r in rows) / len(rows)


def overall(folders: list[Path]) -> str:
    """The MAPE, the median signed error and the band's coverage over every case."""
    rows = case_rows(folders)
    errors = sorted(float(r["step_error_pct"]) for r in rows)
    mape = mape_pct(rows)
    median = statistics.median(errors)
    inside = sum(
        float(r["predicted_low_s"]) <= float(r["measured_step_s"]) <= float(r["predicted_high_s"])
        for r in rows
    )
    return (
        f"All {len(errors)} cases: MAPE {mape:.1f}%, median signed error {median:+.1f}%, "
        f"worst {max(errors, key=abs):+.1f}%; the band holds the measurement in {inside} of "
        f"{len(rows)}\n"
    )


def fit_table(folders: list[Path]) -> list[str]:
    """Each profile's microbenchmark fit: per kind, the median error on the rows it was fitted
    to and on the same rows predicted without their fold (`zsim.calibrate.holdout`), and how
    many held-out rows miss by more than 10 % (in brackets: of them, rows whose launches
    disagree by as much among themselves)."""
    profiles = sorted({json.loads((f / "summary.json").read_text())["context"]["profile"]
                       for f in folders})  # fmt: skip
    lines = [
        "Microbenchmark fits (median error fitted / held out; held-out rows over 10 %):",
        "",
        "| profile | kind | rows | fitted | held out | over 10 % |",
        "|---|---|---|---|---|---|",
    ]
    for name in profiles:
        residuals = json.loads((HERE.parents[1] / name).read_text())["fit"]["residuals"]
        groups: dict[str, dict[bool, list[dict]]] = {}
        for r in residuals:
            if r["fitted"]:
                groups.setdefault(r["kind"], {}).setdefault(bool(r.get("held_out")), []).append(r)
        for kind, by in sorted(groups.items()):
            if True not in by:
                continue
            fitted, held = _pooled(by.get(False, [])), _pooled(by[True])
            over = sum(r["over"] or 0 for r in by[True])
            apart = sum(r.get("over_launches_disagree") or 0 for r in by[True])
            lines.append(
                f"| {Path(name).stem} | {kind} | {held[1]} | {fitted[0]:.1%} | {held[0]:.1%} | "
                f"{over} ({apart}) |"
            )
    return [*lines, ""]


def _pooled(groups: list[dict]) -> tuple[float, int]:
    """A row-weighted median over groups' medians, and their rows."""
    values = sorted(v for g in groups for v in [g["median_rel_err"]] * g["rows"])
    return (statistics.median(values) if values else float("nan")), len(values)


def drift_table() -> list[str]:
    """The speed probe's spread over each layout's last run (`zsim.calibrate.speed`, drift.json)."""
    path = HERE / "drift.json"
    if not path.exists():
        return []
    lines = [
        "The machine's speed over each layout's last run (`zsim.calibrate.speed`: slowest "
        "probe over fastest, less one; flagged past 10 %):",
        "",
        "| layout | run | GEMM | 64 MiB copy | 64 MiB add | flagged |",
        "|---|---|---|---|---|---|",
    ]
    for name, run in sorted(json.loads(path.read_text()).items()):
        keys = ("gemm_512x3072x768_s", "copy_64MiB_s", "add_64MiB_s")  # speed.probe's
        spread = " | ".join(f"{run['spread_pct'][k]:.1f}%" for k in keys)
        span = f"{run['started'][:16]} - {run['ended'][11:16]}"
        lines.append(f"| {name} | {span} | {spread} | {run['flagged']} |")
    return [*lines, ""]


BEGIN, END = "<!-- tables:begin -->", "<!-- tables:end -->"


def main(argv: list[str]) -> int:
    folders = sorted(p for p in HERE.iterdir() if (p / "summary.json").exists())
    if "--repredict" in argv:
        from zsim.validate.committed import repredict_folder

        for folder in folders:
            mape = repredict_folder(folder, HERE.parents[1])
            print(f"{folder.name}: repredicted, MAPE {mape:.1f}%", file=sys.stderr)
    tables = "\n".join(line for folder in folders for line in table(folder))
    tables += "\n" + overall(folders) + "\n" + "\n".join([*drift_table(), *fit_table(folders)])
    if "--write" not in argv:
        print(tables)
        return 0
    readme = HERE / "README.md"
    text = readme.read_text()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{BEGIN}\n{tables}\n{END}{tail}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
