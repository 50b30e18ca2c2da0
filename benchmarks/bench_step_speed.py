"""Simulator speed: wall-clock seconds to simulate one training step, and where they go.

    python benchmarks/bench_step_speed.py [--quick] [--no-write]

(a) one step of gpt-175b on 128x8-dgx-a100 (tp 8, pp 16, dp 8, 1F1B, micro-batch 1, global
    batch 1536 = 192 micro-batches, full recompute): wall seconds, best of a few runs, then
    one more run under cProfile (top functions by own time and by cumulative time);
(b) a fixed per-pipeline shape (gpt-175b, tp 8, pp 16, micro-batch 1, 32 micro-batches)
    scaled by data parallelism, dp = 1 ... 128 on Nx8-dgx-a100 with N = 16 dp (128 to
    16,384 GPUs): the simulated ranks stay 16, the GPUs and replica groups grow;
(c) distinct ranks grow instead: gpt-175b, tp 8, dp 1, pp = 1 ... 96 (32 micro-batches).

Every time is also given as a ratio to a reference operation timed in the same run (numpy
sorting 2 million floats, as benchmarks/bench_network.py), because this machine is shared
and its speed varies; compare ratios between runs, not seconds. Topology building is timed
apart from the simulation. Writes the tables into benchmarks/results/step_speed.md between
its table markers (the hand-written analysis around them is kept).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from results_md import write_block

from zsim.cluster.topology import Topology
from zsim.inputs import presets
from zsim.simulation import simulate
from zsim.workload.model_presets import preset
from zsim.workload.parallel import ParallelConfig

MD_OUT = Path(__file__).resolve().parent / "results" / "step_speed.md"
MODEL = preset("gpt-175b")
DEVICE = presets.gpu("a100-80gb")


def timed(action: Callable[[], object], repeats: int) -> tuple[float, Any]:
    """(best wall-clock seconds of `repeats` runs, the last result)."""
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = action()
        best = min(best, time.perf_counter() - start)
    return best, result


def reference_s() -> float:
    values = np.random.default_rng(0).random(2_000_000)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        np.sort(values)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def config(dp: int, pp: int, micro_batches: int) -> ParallelConfig:
    return ParallelConfig(
        dp=dp,
        tp=8,
        pp=pp,
        micro_batch=1,
        grad_accum=micro_batches,
        recompute="full",
        pp_schedule="1f1b",
    )


def case_a(repeats: int) -> tuple[list[str], float]:
    topo = presets.topology("128x8-dgx-a100")
    cfg = config(dp=8, pp=16, micro_batches=192)
    ref = reference_s()
    wall, report = timed(lambda: simulate(MODEL, cfg, topo, DEVICE), repeats)
    spans = len(report.engine.spans)
    lines = [
        "| case | simulated step | spans | wall s (best of "
        f"{repeats}) | wall / reference | reference s |",
        "|---|---|---|---|---|---|",
        f"| (a) gpt-175b, 128x8-dgx-a100, tp8 pp16 dp8, 192 micro-batches, full recompute "
        f"| {report.step_time_s:.2f} s | {spans:,} | {wall:.2f} | {wall / ref:.0f} "
        f"| {ref * 1e3:.1f} ms |",
    ]
    return lines, wall


def profile_a(top: int) -> list[str]:
    topo = presets.topology("128x8-dgx-a100")
    cfg = config(dp=8, pp=16, micro_batches=192)
    profiler = cProfile.Profile()
    profiler.enable()
    simulate(MODEL, cfg, topo, DEVICE)
    profiler.disable()
    stats = pstats.Stats(profiler, stream=io.StringIO())
    total = stats.total_tt  # type: ignore[attr-defined]
    lines = [f"Total under cProfile: {total:.2f} s (profiling adds overhead).", ""]
    for key, title in (("tottime", "own time"), ("cumulative", "cumulative time")):
        lines += [
            f"Top {top} by {title}:",
            "",
            "| function | calls | own s | cumulative s | own % |",
            "|---|---|---|---|---|",
        ]
        stats.sort_stats(key)
        for func in stats.fcn_list[:top]:  # type: ignore[attr-defined]
            calls, _, own, cum, _ = stats.stats[func]  # type: ignore[attr-defined]
            lines.append(
                f"| `{_name(func)}` | {calls:,} | {own:.2f} | {cum:.2f} | {100 * own / total:.1f} |"
            )
        lines.append("")
    return lines


def _name(func: tuple[str, int, str]) -> str:
    path, line, name = func
    if path == "~":
        return name
    parts = Path(path).parts
    short = "/".join(parts[parts.index("zsim") :]) if "zsim" in parts else Path(path).name
    if "site-packages" in parts:
        short = "/".join(parts[parts.index("site-packages") + 1 :])
    return f"{short}:{line} {name}"


def scaling(
    label: str, points: list[tuple[int, int]], micro_batches: int, repeats: int
) -> list[str]:
    """Rows of (dp, pp) points: GPUs, topology build s, simulate s, ratios."""
    lines = [
        f"| {label} | GPUs | simulated ranks | topology build s | simulate s | simulate / "
        "reference | simulated step s |",
        "|---|---|---|---|---|---|---|",
    ]
    for dp, pp in points:
        ref = reference_s()
        gpus = dp * pp * 8
        start = time.perf_counter()
        topo: Topology = presets.topology(f"{gpus // 8}x8-dgx-a100")
        build = time.perf_counter() - start
        cfg = config(dp=dp, pp=pp, micro_batches=micro_batches)
        wall, report = timed(lambda cfg=cfg, topo=topo: simulate(MODEL, cfg, topo, DEVICE), repeats)
        lines.append(
            f"| dp {dp}, pp {pp} | {gpus:,} | {pp} | {build:.2f} | {wall:.2f} | "
            f"{wall / ref:.0f} | {report.step_time_s:.2f} |"
        )
        print(lines[-1], file=sys.stderr, flush=True)
    return lines


def write_md(block: str) -> None:
    write_block(MD_OUT, block)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer points, one repeat")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    repeats = 1 if args.quick else 3
    dps = [1, 4, 16] if args.quick else [1, 2, 4, 8, 16, 32, 64, 128]
    pps = [1, 4, 16] if args.quick else [1, 2, 4, 8, 16, 32, 48, 96]
    start = time.perf_counter()
    lines = ["### (a) one step of gpt-175b on 1,024 A100s", ""]
    rows_a, _ = case_a(repeats)
    lines += rows_a
    lines += ["", "### (a) under cProfile", "", *profile_a(top=25)]
    lines += ["### (b) GPUs grow by data parallelism (tp 8, pp 16, 32 micro-batches)", ""]
    lines += scaling("dp x pp", [(dp, 16) for dp in dps], 32, 1)
    lines += ["", "### (c) distinct ranks grow by pipeline stages (tp 8, dp 1, 32 micro-batches)"]
    lines += ["", *scaling("dp x pp", [(1, pp) for pp in pps], 32, 1)]
    lines += ["", f"Whole benchmark: {time.perf_counter() - start:.0f} s."]
    block = "\n".join(lines) + "\n"
    print(block)
    if not args.no_write:
        write_md(block)
    return 0


if __name__ == "__main__":
    sys.exit(main())
