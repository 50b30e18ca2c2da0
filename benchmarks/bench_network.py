"""Network benchmarks: simulation speed at 1,024 GPUs, and busbw against published numbers.

    python benchmarks/bench_network.py            # prints the markdown recorded in
                                                  # benchmarks/results/network.md

Speed: wall-clock seconds of one all-reduce on all 1,024 GPUs of 128x8-dgx-a100 (plan plus
simulation; the topology is built once beforehand and timed apart), the median of a few runs,
and the same as a ratio to a reference operation timed in the same run (sorting 2 million
floats with numpy), because this machine is shared and its speed varies.

Accuracy: zsim's simulated busbw of all_reduce on 8 GPUs of a DGX H100 (1x8-dgx-h100, spec
numbers, no calibration) against rows of calibration/reference/collectives_bandwidth.csv at
large sizes. Those rows were measured with NCCL's default algorithm, which on H100 is NVLS
(NVLink SHARP, in-switch reduction, busbw above the 450 GB/s per-direction link rate); zsim
models rings and trees only, so part of the error is that missing algorithm, and part is
NCCL's protocol efficiency (a calibrated profile absorbs it).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np
import simpy

from zsim.calibrate.speed import median_s
from zsim.cluster.topology import Topology
from zsim.inputs import presets
from zsim.inputs.files import data_dir, load_csv
from zsim.network.collective import Algorithm, CollectiveCall, CollectiveOp, Plan, bandwidths
from zsim.network.communicator import run_plan, simulate_s
from zsim.network.flows import FlowNetwork
from zsim.network.plans import plan

REPEATS = 5


def reference_s() -> float:
    values = np.random.default_rng(0).random(2_000_000)
    return median_s(lambda: np.sort(values), REPEATS)


def _simulate_plan(topo: Topology, chosen: Plan) -> float:
    env = simpy.Environment()
    process = env.process(run_plan(FlowNetwork(env, topo), chosen))
    env.run()
    return float(process.value)


def speed_rows() -> list[str]:
    start = time.perf_counter()
    topo = presets.topology("128x8-dgx-a100")
    build_s = time.perf_counter() - start
    ref = reference_s()
    rows = [
        "| all_reduce, 1,024 GPUs | algorithm | flows | simulated time | plan s | simulate s "
        "| total s | total / reference |",
        "|---|---|---|---|---|---|---|---|",
    ]
    group = tuple(range(1024))
    for algorithm in (Algorithm.AUTO, Algorithm.RING, Algorithm.TREE):
        for size in (2**20, 2**30):
            call = CollectiveCall(CollectiveOp.ALL_REDUCE, size, group, algorithm)
            chosen = plan(topo, call)
            flows = sum(len(p.flows) for p in chosen.phases)
            plan_s = median_s(lambda c=call: plan(topo, c), REPEATS)
            sim_s = median_s(lambda p=chosen: _simulate_plan(topo, p), REPEATS)
            total = plan_s + sim_s
            rows.append(
                f"| {size // 2**20} MiB, --algorithm {algorithm} | {chosen.algorithm} | {flows} "
                f"| {_simulate_plan(topo, chosen) * 1e3:.3f} ms | {plan_s:.3f} | {sim_s:.3f} "
                f"| {total:.3f} | {total / ref:.2f} |"
            )
    rows.append(
        f"\nReference operation (numpy sort of 2e6 floats), same run: {ref:.4f} s. "
        f"Building the 128x8-dgx-a100 graph once: {build_s:.3f} s (not in the rows). "
        f"Medians of {REPEATS} runs; a `Communicator` caches plans, so repeated calls pay only "
        "the simulate column."
    )
    return rows


def accuracy_rows() -> list[str]:
    reference = load_csv(data_dir("calibration") / "reference" / "collectives_bandwidth.csv")
    topo = presets.topology("1x8-dgx-h100")
    chosen = [
        r
        for r in reference
        if r["collective"] == "all_reduce"
        and r["num_gpus"] == "8"
        and "H100" in r["gpu_type"]
        and r["message_size_bytes"]
        and int(r["message_size_bytes"]) >= 2**26
        and (r["busbw_GBps"] or r["busbw_inplace_GBps"])
    ]
    rows = [
        "| row | source | size | measured busbw GB/s | zsim busbw GB/s | zsim / measured - 1 |",
        "|---|---|---|---|---|---|",
    ]
    errors = []
    for r in chosen:
        size = int(r["message_size_bytes"])
        measured = float(r["busbw_GBps"] or r["busbw_inplace_GBps"])
        call = CollectiveCall(CollectiveOp.ALL_REDUCE, size, tuple(range(8)))
        [t] = simulate_s(topo, [call])
        busbw = bandwidths(CollectiveOp.ALL_REDUCE, 8, size, t)[1] / 1e9
        errors.append(busbw / measured - 1)
        rows.append(
            f"| {r['row_id'][-3:]} | {r['source_id']} | {size // 2**20} MiB | {measured:.1f} "
            f"| {busbw:.1f} | {busbw / measured - 1:+.1%} |"
        )
    rows.append(
        f"\nMean error {statistics.mean(errors):+.1%}, "
        f"mean absolute error {statistics.mean(abs(e) for e in errors):.1%} "
        f"over {len(errors)} rows."
    )
    return rows


PEAK_CASES = (  # row id, zsim topology, note on what NCCL ran
    ("140", "1x8-dgx-h100", "NCCL_ALGO=RING (maintainer: effective NVLink 370 of 450 GB/s)"),
    ("119", "1x8-dgx-h100", "NVLink4, default algorithm"),
    ("118", "1x8-dgx-a100", "NVLink3, default algorithm"),
    ("124", "4x8-dgx-a100", "32 GPUs, NVLink3 + 8x 200 Gb RDMA"),
    ("125", "4x8-dgx-h100", "32 GPUs, NVLink4 + 8x 400 Gb RDMA"),
    ("112", "4x8-ib", "200 Gb RDMA per node (GPU count not on the slide)"),
)


def peak_rows() -> list[str]:
    """Peak (large-message) all_reduce busbw: slide and maintainer figures without a size;
    zsim is run at 8 GiB."""
    reference = {
        r["row_id"][-3:]: r
        for r in load_csv(data_dir("calibration") / "reference" / "collectives_bandwidth.csv")
    }
    rows = [
        "| row | measured on | measured busbw GB/s | zsim topology | zsim busbw GB/s "
        "| zsim / measured - 1 |",
        "|---|---|---|---|---|---|",
    ]
    size = 8 * 2**30
    for row_id, name, note in PEAK_CASES:
        measured = float(reference[row_id]["busbw_GBps"].lstrip("~"))
        topo = presets.topology(name)
        n = topo.world_size
        [t] = simulate_s(topo, [CollectiveCall(CollectiveOp.ALL_REDUCE, size, tuple(range(n)))])
        busbw = bandwidths(CollectiveOp.ALL_REDUCE, n, size, t)[1] / 1e9
        rows.append(
            f"| {row_id} | {note} | {measured:g} | {name} | {busbw:.1f} "
            f"| {busbw / measured - 1:+.1%} |"
        )
    return rows


def main() -> int:
    print("## Speed: all_reduce on 1,024 GPUs (128x8-dgx-a100)\n")
    print("\n".join(speed_rows()))
    print("\n## Accuracy: all_reduce busbw, 8 x H100 (1x8-dgx-h100), sizes >= 64 MiB\n")
    print("\n".join(accuracy_rows()))
    print("\n## Accuracy: peak all_reduce busbw (large messages), zsim at 8 GiB\n")
    print("\n".join(peak_rows()))
    print(f"\n(run on {sys.platform}, python {sys.version.split()[0]}, {Path.cwd().name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
