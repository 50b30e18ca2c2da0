"""The generated part of a results page: between its table markers, replaced on every run; the
hand-written method and diagnosis around them are kept."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path
from typing import Any

BEGIN, END = "<!-- tables:begin -->", "<!-- tables:end -->"


def write_block(path: Path, block: str, begin: str = BEGIN, end: str = END) -> None:
    """`block` between the page's `begin` and `end` markers (appended where it has none)."""
    old = path.read_text(encoding="utf-8") if path.exists() else ""
    if begin not in old:
        old += f"\n{begin}\n{end}\n"
    head, _, rest = old.partition(begin)
    _, _, tail = rest.partition(end)
    path.write_text(f"{head}{begin}\n{block}{end}{tail}", encoding="utf-8")


def write_csv(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    """The rows of a results table, their keys (those of the first) as the header."""
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
