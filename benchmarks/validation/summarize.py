"""Markdown tables of the committed validation runs (each folder here holds one
`zsim validate` output): step time predicted vs measured per case, the MAPE, and the memory
ledger's error per category against the tensors the engine held.

    python benchmarks/validation/summarize.py [--write]

--write replaces the tables between the markers of README.md here (the text around them is
written by hand).
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

HERE = Path(__file__).parent
CATEGORIES = ("parameters", "gradients", "optimizer_states", "comm_buffers", "activations")


def _pct(text: str) -> str:
    return "n/a" if text in ("", None) else f"{float(text):+.1f}%"


def _ms(text: str) -> str:
    return "n/a" if text in ("", None) else f"{1e3 * float(text):.1f}"


def table(folder: Path) -> list[str]:
    rows = list(csv.DictReader((folder / "predicted_vs_measured.csv").open()))
    summary = json.loads((folder / "summary.json").read_text())
    emulation = summary.get("emulation") or {}
    lines = [
        f"### {folder.name}",
        "",
        f"topology `{rows[0]['topology']}`, {rows[0]['world']} ranks, model "
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
    return lines + phase_table(rows)


PHASES = ("forward", "backward", "step")


def phase_table(rows: list[dict[str, str]]) -> list[str]:
    """Rank 0's phases, measured / predicted ms, and inside each the time in collectives
    (`zsim.validate.phase_split`); nothing where the run recorded no phases."""
    if not any(r.get("measured_forward_s") for r in rows):
        return []
    head = "".join(f" {p} | {p} comm |" for p in PHASES)
    lines = [
        "Phases of rank 0 (measured / predicted ms; comm: inside collectives):",
        "",
        f"| case |{head}",
        "|---|" + "---|---|" * len(PHASES),
    ]
    for r in rows:
        cells = "".join(
            f" {_ms(r[f'measured_{k}_s'])} / {_ms(r[f'predicted_{k}_s'])} |"
            for p in PHASES
            for k in (p, f"{p}_comm")
        )
        lines.append(f"| {r['case']} |{cells}")
    return [*lines, ""]


def overall(folders: list[Path]) -> str:
    """The MAPE over every case of every folder."""
    errors = [
        abs(float(r["step_error_pct"]))
        for f in folders
        for r in csv.DictReader((f / "predicted_vs_measured.csv").open())
        if r["step_error_pct"]
    ]
    return f"All {len(errors)} cases: MAPE {sum(errors) / len(errors):.1f}%\n"


BEGIN, END = "<!-- tables:begin -->", "<!-- tables:end -->"


def main(argv: list[str]) -> int:
    folders = sorted(p for p in HERE.iterdir() if (p / "summary.json").exists())
    tables = "\n".join(line for folder in folders for line in table(folder))
    tables += "\n" + overall(folders)
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
