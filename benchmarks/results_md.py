"""The generated part of a results page: between its table markers, replaced on every run; the
hand-written method and diagnosis around them are kept."""

from __future__ import annotations

from pathlib import Path

BEGIN, END = "<!-- tables:begin -->", "<!-- tables:end -->"


def write_block(path: Path, block: str) -> None:
    old = path.read_text(encoding="utf-8") if path.exists() else f"{BEGIN}\n{END}\n"
    head, _, rest = old.partition(BEGIN)
    _, _, tail = rest.partition(END)
    path.write_text(f"{head}{BEGIN}\n{block}{END}{tail}", encoding="utf-8")
