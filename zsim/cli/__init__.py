"""The `zsim` command: one parser, each command registered by its module (`run`, `network`,
`calibrate`, `validate`); an `InputError` anywhere is one line and exit code 2."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from zsim.cli import calibrate, network, plan, run, sweep, validate
from zsim.cli.output import (
    EXIT_BAD_INPUT,
    EXIT_INTERRUPTED,
    catch_swallowed_interrupts,
    check_interrupted,
)
from zsim.errors import InputError


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"zsim: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="zsim",
        description="Plan large-model training: simulate DeepSpeed ZeRO / 3D-parallel steps, "
        "calibrate on local devices, validate against real runs.",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    calibrate.add_commands(sub)
    network.add_commands(sub)
    validate.add_commands(sub)
    run.add_commands(sub)
    plan.add_commands(sub)
    sweep.add_commands(sub)
    return parser


_NEGATIVE = re.compile(r"^-(\d|\.\d)")


def _attach_negative_values(argv: Sequence[str]) -> list[str]:
    """`--params -7e9` -> `--params=-7e9`: argparse takes a negative number in scientific
    notation for an option, so the value would reach no validation at all."""
    out: list[str] = []
    for token in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and _NEGATIVE.match(token):
            out[-1] = f"{out[-1]}={token}"
        else:
            out.append(token)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(_attach_negative_values(sys.argv[1:] if argv is None else argv))
    func: Callable[[argparse.Namespace], int] = args.func
    previous_hook = catch_swallowed_interrupts()
    try:
        code = func(args)
        check_interrupted()
        return code
    except InputError as exc:
        print(f"zsim: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("zsim: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        sys.unraisablehook = previous_hook
