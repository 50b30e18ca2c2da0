"""`zsim sweep SPEC.yaml`: every point of a grid (`zsim.plan.sweep`) simulated on every core,
or on a Dask cluster (`--cluster ADDRESS`, the `sweep` extra), one CSV row per point written
as it arrives. A rerun skips the points already in the CSV; Ctrl-C keeps every finished row
(exit 130). `--plot` draws throughput per GPU against cluster size and the winner per cluster.
"""

from __future__ import annotations

import argparse
import csv
import os
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from zsim.cli.output import EXIT_INTERRUPTED, EXIT_OK, write_output
from zsim.errors import InputError, require
from zsim.inputs.files import load_mapping
from zsim.plan.sweep import Point, points, run_point

FIRST = ("key", "model", "topology", "gpu", "mode")
RESULTS = (
    "status", "gpus", "dp", "step_s", "tokens_per_s", "tokens_per_s_per_gpu",
    "model_tflops_per_gpu", "mfu", "memory_gb", "exposed_comm_s", "layout", "reason",
)  # fmt: skip


def cmd_sweep(args: argparse.Namespace) -> int:
    require(args.workers is None or args.workers >= 1, "workers", args.workers, "at least 1")
    spec = load_mapping(args.spec, "sweep spec")
    todo = points(spec, args.spec.name)
    out: Path = args.out or args.spec.with_suffix(".csv")
    columns = [*FIRST, *sorted({k for p in todo for k, _ in p.settings}), *RESULTS]
    done = _finished(out, columns)
    pending = [p for p in todo if p.key not in done]
    print(f"sweep: {len(todo)} points, {len(todo) - len(pending)} already in {out}, "
          f"{len(pending)} to run", file=sys.stderr)  # fmt: skip
    kept, started = 0, time.monotonic()
    try:
        with _appender(out, columns) as write:
            for i, row in enumerate(_run(pending, args.cluster, args.workers), 1):
                write(row)
                kept += 1
                _progress(i, len(pending), row, started)
    except KeyboardInterrupt:
        end = "\n" if sys.stderr.isatty() else ""  # below the progress bar
        print(f"{end}zsim: interrupted; {kept} new results kept in {out}", file=sys.stderr)
        return EXIT_INTERRUPTED
    if args.plot:
        from zsim.outputs.sweep_plot import sweep_figure

        write_output(args.plot, sweep_figure(_read(out)))
    print(f"sweep: {out} ({len(done) + kept} rows)", file=sys.stderr)
    return EXIT_OK


def _finished(out: Path, columns: list[str]) -> set[str]:
    """The keys already in `out` (the resume); its header must be this spec's."""
    if not out.exists():
        return set()
    with out.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        header, rows = list(reader.fieldnames or ()), list(reader)
    require(
        header == columns,
        "--out",
        str(out),
        "the CSV of this same spec to resume (its columns differ), or a new path",
    )
    return {r["key"] for r in rows}


def _read(path: Path) -> list[dict[str, str]]:
    with path.open(newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


class _appender:
    """Appends rows to the CSV and flushes each, so a crash or Ctrl-C loses none."""

    def __init__(self, path: Path, columns: list[str]) -> None:
        self.path, self.columns = path, columns

    def __enter__(self) -> Any:
        fresh = not self.path.exists()
        try:
            self.file = self.path.open("a", newline="", encoding="utf-8")
        except OSError as exc:
            raise InputError("--out", str(self.path), f"a writable path ({exc.strerror})") from None
        self.writer = csv.DictWriter(self.file, self.columns, extrasaction="ignore")
        if fresh:
            self.writer.writeheader()

        def write(row: dict[str, Any]) -> None:
            self.writer.writerow(row)
            self.file.flush()

        return write

    def __exit__(self, *exc: object) -> None:
        self.file.close()


Row = dict[str, Any]


def _run(pending: Sequence[Point], cluster: str | None, workers: int | None) -> Iterator[Row]:
    if not pending:
        return iter(())
    if cluster:
        return _on_dask(pending, cluster)
    return _on_pool(pending, workers or os.cpu_count() or 1)


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C


def _on_pool(pending: Sequence[Point], workers: int) -> Iterator[Row]:
    pool = ProcessPoolExecutor(max_workers=workers, initializer=_ignore_sigint)
    try:
        for future in as_completed([pool.submit(run_point, p) for p in pending]):
            yield future.result()
    finally:  # on Ctrl-C, stop the workers now rather than after their current points
        for process in list(getattr(pool, "_processes", {}).values()):
            process.terminate()
        pool.shutdown(wait=True, cancel_futures=True)


def _on_dask(pending: Sequence[Point], address: str) -> Iterator[Row]:
    try:
        import distributed
    except ImportError:
        raise InputError(
            "--cluster", address, "the sweep extra installed (pip install 'zsim[sweep]')"
        ) from None
    try:
        make_client: Any = distributed.Client  # untyped
        client = make_client(address, timeout=10)
    except OSError as exc:
        raise InputError("--cluster", address, f"a reachable Dask scheduler ({exc})") from None
    futures = client.map(run_point, pending, pure=False)
    completed: Any = distributed.as_completed
    try:
        for future in completed(futures):
            yield future.result()
    finally:
        client.cancel(futures)
        client.close()


def _progress(i: int, n: int, row: dict[str, Any], started: float) -> None:
    """A redrawn bar with the time left on a terminal; one line per point in a log."""
    what = row.get("status", "")
    rate = row.get("tokens_per_s")
    tail = f"{rate:,.0f} tokens/s" if isinstance(rate, float) else row.get("reason", "")
    point = f"{row['model']} on {row['topology']}: {what} {tail}"
    if not sys.stderr.isatty():
        print(f"[{i}/{n}] {point}", file=sys.stderr)
        return
    done = int(30 * i / n)
    left = (time.monotonic() - started) / i * (n - i)
    bar = f"\r[{'#' * done}{'.' * (30 - done)}] {i}/{n}, {left:,.0f} s left; last: {point}"
    print(bar[:160].ljust(160), end="\n" if i == n else "", file=sys.stderr, flush=True)


def add_commands(sub: Any) -> None:
    p = sub.add_parser("sweep", help="simulate a grid of models x clusters x layouts to a CSV")
    p.add_argument("spec", type=Path, help="the sweep spec, YAML or JSON (see docs/cli.md)")
    p.add_argument("--out", type=Path, help="the CSV (default: SPEC with .csv); rerun resumes")
    p.add_argument("--workers", type=int, help="local processes (default: every core)")
    p.add_argument("--cluster", metavar="ADDRESS", help="a Dask scheduler, e.g. tcp://host:8786")
    p.add_argument("--plot", type=Path, metavar="FILE.png", help="throughput against GPUs")
    p.set_defaults(func=cmd_sweep)
