"""Reading the files zsim takes (YAML, JSON, CSV) and finding its data folders.

All file I/O of inputs lives here, so the model modules stay pure. Every failure becomes an
`InputError` naming the file, what is wrong and what is expected.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import yaml

from zsim.errors import InputError

_PACKAGE_DATA = Path(__file__).parent.parent / "data"
_CHECKOUT = Path(__file__).parent.parent.parent


def data_dir(name: str) -> Path:
    """`topologies` or `calibration`: in the installed package, else in the checkout."""
    for base in (_PACKAGE_DATA, _CHECKOUT):
        path = base / name
        if path.is_dir():
            return path
    raise FileNotFoundError(f"zsim data folder {name!r} is missing from the installation")


def read_text(path: Path, field: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(field, str(path), "an existing file") from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as exc:
        raise InputError(
            field, str(path), f"a readable text file ({exc.__class__.__name__})"
        ) from None


def load_json(path: Path, field: str) -> Any:
    text = read_text(path, field)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(
            field, str(path), f"valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})"
        ) from None


def load_yaml(path: Path, field: str) -> Any:
    text = read_text(path, field)
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise InputError(
            field, str(path), f"valid YAML ({where}{getattr(exc, 'problem', exc)})"
        ) from None


def load_mapping(path: Path, field: str) -> dict[str, Any]:
    """A YAML or JSON file whose top level must be a mapping."""
    data = load_json(path, field) if path.suffix == ".json" else load_yaml(path, field)
    if not isinstance(data, dict):
        raise InputError(field, str(path), "a file whose top level is a mapping of keys to values")
    return data


def load_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))
