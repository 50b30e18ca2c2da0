"""How close DeepSpeed's CPU Adam comes to the host's memory bandwidth (a microbenchmark).

    python benchmarks/bench_cpu_adam.py [--no-write]      (needs the calibrate extra)

DeepSpeedCPUAdam's step (csrc/includes/cpu_adam.h, `Step_AVX`) reads the fp32 parameters,
gradients and both moments and writes the parameters and moments back: 7 fp32 streams, 28
bytes per parameter. It is memory-bound, so its rate is a fraction of what a plain copy
moves (2 streams). This measures both in one process, on tensors far larger than the caches,
and writes that fraction to benchmarks/results/cpu_adam.md: the GPU presets' host Adam rate
(`zsim.cluster.gpu_spec`) applies it to their host's DRAM bandwidth.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from results_md import write_block

from zsim.cluster.device import ADAM_STEP_BYTES_PER_PARAM

MD_OUT = Path(__file__).resolve().parent / "results" / "cpu_adam.md"
SIZES = (25_000_000, 50_000_000, 100_000_000)
REPEATS = 9


def measure(numel: int) -> tuple[float, float]:
    """(CPU Adam parameters/s, copy bytes/s counting read + write) for one size: the two
    timed in turns, REPEATS times each after a warm-up, medians (the host is shared)."""
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    param = torch.nn.Parameter(torch.zeros(numel))
    param.grad = torch.full((numel,), 1e-3)
    optimizer = DeepSpeedCPUAdam([param], lr=1e-4)
    source, target = torch.empty(numel), torch.empty(numel)
    adam, copy = [], []
    for turn in range(REPEATS + 1):
        start = time.perf_counter()
        optimizer.step()
        middle = time.perf_counter()
        target.copy_(source)
        end = time.perf_counter()
        if turn:  # the first warms up
            adam.append(middle - start)
            copy.append(end - middle)
    return numel / statistics.median(adam), 2 * 4 * numel / statistics.median(copy)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch

    rows = ["| parameters | CPU Adam M params/s | its traffic GB/s | copy GB/s | fraction |"]
    rows.append("|---|---|---|---|---|")
    fractions = []
    for numel in SIZES:
        rate, copy = measure(numel)
        fraction = rate * ADAM_STEP_BYTES_PER_PARAM / copy
        fractions.append(fraction)
        rows.append(
            f"| {numel:,} | {rate / 1e6:,.0f} | {rate * ADAM_STEP_BYTES_PER_PARAM / 1e9:.1f} "
            f"| {copy / 1e9:.1f} | {fraction:.2f} |"
        )
        print(rows[-1], file=sys.stderr, flush=True)
    block = "\n".join(
        [
            f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs.",
            "",
            *rows,
            "",
            f"Median fraction of the copy bandwidth: **{statistics.median(fractions):.2f}**.",
            "",
        ]
    )
    print(block)
    if not args.no_write:
        write_block(MD_OUT, block)
    return 0


if __name__ == "__main__":
    sys.exit(main())
