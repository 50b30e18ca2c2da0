"""The one error type for bad input: it names the field, the value and what is allowed."""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any


class InputError(ValueError):
    """Bad user input (a flag, a file, a preset name). The CLI prints it as one line, exit 2."""

    def __init__(self, field: str, value: Any, allowed: str) -> None:
        self.field = field
        self.value = value
        self.allowed = allowed
        super().__init__(field, value, allowed)  # args rebuild it (simpy re-raises copies)

    def __str__(self) -> str:
        return f"{self.field}={self.value!r} is not valid: {self.allowed}"


def require(condition: bool, field: str, value: Any, allowed: str) -> None:
    """Raise InputError unless `condition` holds (validation at the boundary, not `assert`)."""
    if not condition:
        raise InputError(field, value, allowed)


def is_whole(value: Any, least: int = 0) -> bool:
    """An int (not a bool) of at least `least`: the strict check for values a program or a
    file gives as integers (a float, even 3.0, is refused; `count` accepts JSON's 1e9)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def positive_int(field: str, value: Any) -> int:
    """Validate a strictly positive integer (bools and non-integral floats are refused)."""
    if isinstance(value, float) and value.is_integer() and value > 0:
        return int(value)
    require(is_whole(value, 1), field, value, "a positive integer")
    return int(value)


def count(field: str, value: Any) -> int:
    """Validate a non-negative integer (a knob where 0 turns something off); whole floats
    such as JSON's 1e9 are accepted."""
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    require(is_whole(value), field, value, "a non-negative integer")
    return int(value)


def positive_number(field: str, value: Any) -> float:
    """Validate a strictly positive finite number."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and 0 < value < float("inf")
    require(ok, field, value, "a positive number")
    return float(value)


def choose(field: str, name: str, choices: Sequence[str]) -> str:
    """`name` among `choices`: itself, the same ignoring case, or the one choice it begins up
    to a `-` (`h100` for `h100-sxm`, not `dgx-a10` for `dgx-a100`: the A10 is another GPU);
    else an InputError that lists the choices and the closest."""
    if name in choices:
        return name
    lowered = {c.lower(): c for c in choices}
    if name.lower() in lowered:
        return lowered[name.lower()]
    starting = [c for c in choices if c.lower().startswith(name.lower() + "-")]
    if len(starting) == 1:
        return starting[0]
    close = starting or difflib.get_close_matches(name.lower(), list(lowered), n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(lowered.get(c, c) for c in close)}?" if close else ""
    raise InputError(field, name, "one of " + ", ".join(choices) + hint)
