"""The `zsim` command: one parser, each command registered by its module (`run`, `network`,
`calibrate`, `validate`); an `InputError` anywhere is one line and exit code 2."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from zsim.cli import calibrate, network, run, validate
from zsim.cli.output import EXIT_BAD_INPUT, EXIT_INTERRUPTED
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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except InputError as exc:
        print(f"zsim: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("zsim: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
