"""Simulator speed: wall-clock seconds and peak memory to simulate one training step.

    python benchmarks/bench_step_speed.py [--quick] [--no-write]

Two layouts of gpt-175b on Nx8-dgx-h100, GPUs from 8 to about 100,000:
- 3D: tp 8, pp = min(16, GPUs / 8), dp the rest, 32 micro-batches of 1 (1F1B), full
  recompute, ZeRO-1;
- ZeRO-3: dp = GPUs, micro-batch 1, full recompute;
then the cases of issue 13's table and a cluster beyond the limit (refused, exit 2).

Each case runs `zsim run ... --json` in a fresh process that reports the wall time of the run
(topology, simulation, report; not the interpreter's start) and its peak resident memory.
Before each case the parent times a fixed reference operation (Python sorting a list of a
million floats; numpy sorting 2 million before 2026-12-06): this machine is shared and its
speed varies, so compare `wall / reference` ratios between runs, not seconds. Writes the tables
into benchmarks/results/step_speed.md (between its markers), the rows into step_speed.csv
and the two curves into step_speed.png (log-log).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from results_md import write_block

RESULTS = Path(__file__).resolve().parent / "results"
MD_OUT, CSV_OUT, PNG_OUT = (RESULTS / f"step_speed.{ext}" for ext in ("md", "csv", "png"))
COMMON = ["--model", "gpt-175b", "--micro-batch", "1", "--recompute", "full"]
LAYER_530B = ["--layers", "105", "--hidden", "20480", "--heads", "128"]
LAYER_1T = ["--layers", "128", "--hidden", "25600", "--heads", "160"]
MEGATRON = ["--pipeline-engine", "megatron"]
TIMEOUT_S = 600


def three_d(gpus: int) -> list[str]:
    pp = min(16, gpus // 8)
    layout = ["--tp", "8", "--pp", str(pp), "--grad-accum", "32", "--stage", "1"]
    return [f"--topology={gpus // 8}x8-dgx-h100", *COMMON, *layout]


def zero3(gpus: int) -> list[str]:
    return [f"--topology={gpus // 8}x8-dgx-h100", *COMMON, "--stage", "3"]


CURVES = {
    "3D (tp 8, pp <= 16, 32 micro-batches)": (three_d, [8, 64, 512, 4096, 16384, 102400]),
    "ZeRO-3 (dp = GPUs)": (zero3, [8, 64, 512, 4096, 16384, 100000]),
}
ISSUE_CASES = {
    "gpt-175b, tp 8, pp 16, dp 8, 1F1B, 192 micro-batches (1,024 GPUs)": [
        "--topology=128x8-dgx-a100",
        *COMMON,
        *("--tp", "8", "--pp", "16", "--global-batch", "1536", "--stage", "1"),
    ],
    "530B, tp 8, pp 35, interleaved v 3, Megatron engine (2,520 GPUs)": [
        "--topology=315x8-dgx-a100",
        *COMMON,
        *LAYER_530B,
        *MEGATRON,
        *("--tp", "8", "--pp", "35", "--pp-schedule", "interleaved", "--virtual-stages", "3"),
        *("--grad-accum", "105", "--stage", "1"),
    ],
    "1T, tp 8, pp 64, Megatron engine, 512 micro-batches (3,072 GPUs)": [
        "--topology=384x8-dgx-a100",
        *COMMON,
        *LAYER_1T,
        *MEGATRON,
        *("--tp", "8", "--pp", "64", "--grad-accum", "512", "--stage", "1"),
    ],
    "175B ZeRO-3, dp 768 (768 GPUs)": ["--topology=96x8-dgx-a100", *COMMON, "--stage", "3"],
    "530B ZeRO-3, dp 2,240 (2,240 GPUs)": [
        "--topology=280x8-dgx-a100",
        *COMMON,
        *LAYER_530B,
        "--stage",
        "3",
    ],
    "175B, tp 8, pp 16, interleaved v 3, dp 128 (16,384 GPUs)": [
        "--topology=2048x8-dgx-h100",
        *COMMON,
        *MEGATRON,
        *("--tp", "8", "--pp", "16", "--pp-schedule", "interleaved", "--virtual-stages", "3"),
        *("--grad-accum", "32", "--stage", "1"),
    ],
}
REFUSED = ["--topology=100000x8-dgx-h100"]


def reference_s() -> float:
    """Python sorting a list of a million floats, median of 5: the simulator is Python-bound,
    and numpy's sort (the reference before 2026-12-06) became 8x faster on this VM between
    two runs while the simulator's Python became 2-3x faster."""
    values = np.random.default_rng(0).random(1_000_000).tolist()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        sorted(values)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def child(zsim_args: list[str]) -> int:
    """In the fresh process: run zsim, print wall time, peak memory and the step time."""
    from zsim.cli import main

    out = io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(out):
        code = main(["run", *zsim_args, "--json"])
    wall = time.perf_counter() - start
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    step = json.loads(out.getvalue())["step_time_s"] if code == 0 else None
    print(json.dumps({"code": code, "wall_s": wall, "peak_mb": peak_mb, "step_time_s": step}))
    return 0


def measure(zsim_args: list[str]) -> dict[str, float | int | None]:
    ref = reference_s()
    command = [sys.executable, __file__, "--child", "--", *zsim_args]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"code": None, "wall_s": None, "peak_mb": None, "step_time_s": None, "ref_s": ref}
    row = json.loads(done.stdout.strip().splitlines()[-1])
    return {**row, "ref_s": ref}


def refused() -> tuple[int, str, float]:
    start = time.perf_counter()
    command = [sys.executable, "-m", "zsim", "run", *REFUSED]
    done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S)
    return done.returncode, done.stderr.strip(), time.perf_counter() - start


def _cells(row: dict[str, float | int | None]) -> str:
    if row["wall_s"] is None:
        return f"did not finish in {TIMEOUT_S} s | | | "
    wall, ref = float(row["wall_s"]), float(row["ref_s"])  # type: ignore[arg-type]
    step = row["step_time_s"]
    return (
        f"{wall:.2f} | {wall / ref:.1f} | {float(row['peak_mb']):.0f} | "  # type: ignore[arg-type]
        f"{'' if step is None else f'{float(step):.2f}'}"
    )


def run_curves(quick: bool) -> tuple[list[str], list[dict[str, object]]]:
    lines, rows = [], []
    header = "| GPUs | wall s | wall / reference | peak MB | simulated step s |"
    for label, (build, sizes) in CURVES.items():
        lines += [f"### {label}", "", header, "|---|---|---|---|---|"]
        for gpus in sizes[:3] if quick else sizes:
            row = measure(build(gpus))
            rows.append({"layout": label, "gpus": gpus, **row})
            lines.append(f"| {gpus:,} | {_cells(row)} |")
            print(f"{label} {gpus}: {row}", file=sys.stderr, flush=True)
        lines.append("")
    return lines, rows


def run_issue_cases(quick: bool) -> tuple[list[str], list[dict[str, object]]]:
    lines = ["### The cases of issue 13", ""]
    lines += ["| case | wall s | wall / reference | peak MB | simulated step s |"]
    lines += ["|---|---|---|---|---|"]
    rows = []
    for label, zsim_args in list(ISSUE_CASES.items())[: 1 if quick else None]:
        row = measure(zsim_args)
        rows.append({"layout": label, "gpus": None, **row})
        lines.append(f"| {label} | {_cells(row)} |")
        print(f"{label}: {row}", file=sys.stderr, flush=True)
    code, message, wall = refused()
    lines += ["", f"`zsim run {' '.join(REFUSED)}`: exit {code} after {wall:.2f} s: `{message}`"]
    return lines, rows


def plot(rows: list[dict[str, object]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (wall_ax, mem_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label in CURVES:
        mine = [r for r in rows if r["layout"] == label and r["wall_s"] is not None]
        gpus = [r["gpus"] for r in mine]
        wall_ax.plot(gpus, [r["wall_s"] for r in mine], "o-", label=label)
        mem_ax.plot(gpus, [r["peak_mb"] for r in mine], "o-", label=label)
    for ax, what in ((wall_ax, "wall time (s)"), (mem_ax, "peak memory (MB)")):
        ax.set(xscale="log", yscale="log", xlabel="GPUs", ylabel=what)
        ax.grid(True, which="both", alpha=0.3)
    wall_ax.set_title("one step of gpt-175b, simulated")
    mem_ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(PNG_OUT, dpi=120)


def write_csv(rows: list[dict[str, object]]) -> None:
    fields = ["layout", "gpus", "code", "wall_s", "ref_s", "peak_mb", "step_time_s"]
    with CSV_OUT.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["--child", "--"]:
        return child(argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the smallest points only")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    curve_lines, curve_rows = run_curves(args.quick)
    case_lines, case_rows = run_issue_cases(args.quick)
    lines = [
        *curve_lines,
        *case_lines,
        "",
        f"Whole benchmark: {time.perf_counter() - start:.0f} s.",
    ]
    block = "\n".join(lines) + "\n"
    print(block)
    if not args.no_write:
        write_block(MD_OUT, block)
        write_csv(curve_rows + case_rows)
        plot(curve_rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
