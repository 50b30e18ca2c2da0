"""Writing what a command produces: through a temporary name, so nothing half-written stays."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from zsim.errors import InputError

# exit codes, as the README lists them
EXIT_OK = 0
EXIT_BAD_INPUT = 2  # one line on stderr names the field, the value and what is allowed
EXIT_DOES_NOT_FIT = 3  # the layout's memory exceeds the GPU's (results still printed)
EXIT_INTERRUPTED = 130  # Ctrl-C; no output file is left half-written


class _Interrupt:
    """A Ctrl-C that Python swallowed: one that arrived while a finalizer ran (a simpy
    process's generator being collected) is reported as "Exception ignored" and dropped.
    `hook` records it instead, and `check` raises it at the next output or at the end."""

    seen = False

    @classmethod
    def hook(cls, unraisable: Any) -> None:
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            cls.seen = True
        else:
            sys.__unraisablehook__(unraisable)

    @classmethod
    def check(cls) -> None:
        if cls.seen:
            raise KeyboardInterrupt


def catch_swallowed_interrupts() -> Any:
    """Keep a Ctrl-C that arrives inside a finalizer (see `_Interrupt`); returns the hook it
    replaced, to put back."""
    _Interrupt.seen = False
    previous = sys.unraisablehook
    sys.unraisablehook = _Interrupt.hook
    return previous


def check_interrupted() -> None:
    """Raise KeyboardInterrupt if a Ctrl-C was swallowed on the way here."""
    _Interrupt.check()


def write_output(path: Path, content: Any) -> None:
    """Write a file through a temporary name, so a failure leaves no half-written file."""
    check_interrupted()
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        if isinstance(content, str):
            tmp.write_text(content, encoding="utf-8")
        else:
            content.savefig(tmp, dpi=120, format=path.suffix.lstrip(".") or "png")
        tmp.replace(path)
    except BaseException as exc:  # Ctrl-C included: no temporary file left behind
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise InputError("output", str(path), f"a writable path ({exc.strerror})") from None
        raise
