"""ZeRO-3 against tensor + pipeline parallelism at scale: GPT 175B, global batch 1,536 (2,048 on
2,048 GPUs, where 1,536 sequences cannot be split), sequence 2,048, full recompute, on DGX A100
nodes (8 x 200 Gb/s HDR each, `dgx-a100`).

    python benchmarks/bench_zero3_scale.py [--sizes 64,128,...]

For each size: zsim's model TFLOP/s per GPU and where the critical rank's step goes, and the
same with each recent network mechanism switched off in turn (NCCL's protocol model: the ideal
alpha-beta network; ZeRO-3's one process group: gathers and reduce-scatters on two
communicators), so that each mechanism's share is visible, and with every link at half its
modelled bandwidth (`zsim plan`'s what-if: which verdict holds if the network delivers less
than modelled). Writes
benchmarks/results/zero3_scale.csv and the table block of zero3_scale.md. Spec-sheet presets;
nothing here is fitted to a published run.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

from results_md import write_block, write_csv

from zsim.cluster.topology import Topology, with_slower_links
from zsim.inputs import presets
from zsim.plan.robustness import SLOWER_LINKS
from zsim.simulation import Report, simulate
from zsim.workload.mechanisms import Mechanism
from zsim.workload.model_presets import preset
from zsim.workload.parallel import DpEngine, ParallelConfig, PipelineEngine, Recompute

RESULTS = Path(__file__).parent / "results"
ZERO3_SIZES = (64, 128, 256, 512, 768, 1536, 2048)
THREE_D_SIZES = (96, 192, 384, 768, 1536)


def _batch(gpus: int) -> int:
    return 1536 if 1536 % gpus == 0 else 2048


def layouts(sizes: tuple[int, ...] | None) -> list[tuple[str, int, ParallelConfig]]:
    out = []
    for n in sizes or ZERO3_SIZES:
        if n % 8 or _batch(n) % n:
            continue
        cfg = ParallelConfig(
            dp=n, zero_stage=3, grad_accum=_batch(n) // n, recompute=Recompute.FULL, mpu=True
        )
        out.append(("zero3", n, cfg))
    for n in sizes or THREE_D_SIZES:
        if n % 96 or 1536 % (n // 96):
            continue
        cfg = ParallelConfig(
            dp=n // 96,
            tp=8,
            pp=12,
            zero_stage=1,
            grad_accum=1536 // (n // 96),
            recompute=Recompute.FULL,
            pipeline_engine=PipelineEngine.MEGATRON,
        )
        out.append(("tp8-pp12", n, cfg))
        # the same with Megatron-Core's DDP: distributed optimizer, both overlaps
        mcore = dataclasses.replace(
            cfg,
            dp_engine=DpEngine.MEGATRON,
            overlap_param_gather=cfg.dp > 1,
            knobs=dataclasses.replace(cfg.knobs, overlap_comm=True),
        )
        out.append(("tp8-pp12 Megatron-Core DP", n, mcore))
    return out


def ideal(topo: Topology) -> Topology:
    return dataclasses.replace(topo, fabric=dataclasses.replace(topo.fabric, protocol="ideal"))


def row(name: str, n: int, cfg: ParallelConfig) -> dict[str, Any]:
    model, gpu = preset("gpt-175b"), presets.gpu("a100-80gb")
    topo = presets.topology(f"{n // 8}x8-dgx-a100")
    start = time.perf_counter()
    report = simulate(model, cfg, topo, gpu)
    wall = time.perf_counter() - start
    no_tuner = simulate(model, cfg, ideal(topo), gpu).model_tflops_per_gpu
    zero3 = cfg.zero_stage == 3
    two_groups = (
        simulate(model, dataclasses.replace(cfg, mpu=False), topo, gpu).model_tflops_per_gpu
        if zero3
        else None
    )
    walkless = dataclasses.replace(cfg, without=frozenset({Mechanism.ZERO3_HOST}))
    no_walks = simulate(model, walkless, topo, gpu).model_tflops_per_gpu if zero3 else None
    slower = simulate(model, cfg, with_slower_links(topo, SLOWER_LINKS), gpu)
    return {
        "layout": name,
        "gpus": n,
        "global_batch": cfg.dp * cfg.grad_accum * cfg.micro_batch,
        "tflops_per_gpu": round(report.model_tflops_per_gpu, 1),
        "step_s": round(report.step_time_s, 3),
        **breakdown(report),
        "tflops_without_nccl_protocols": round(no_tuner, 1),
        "tflops_with_two_zero3_groups": None if two_groups is None else round(two_groups, 1),
        "tflops_without_host_walks": None if no_walks is None else round(no_walks, 1),
        "tflops_links_half": round(slower.model_tflops_per_gpu, 1),
        "fits": report.fits,
        "sim_wall_s": round(wall, 2),
    }


def breakdown(report: Report) -> dict[str, Any]:
    crit = report.critical
    exposed = sorted(crit.exposed_by_category.items(), key=lambda kv: -kv[1])
    return {
        "compute_s": round(report.compute_s, 3),
        "exposed_comm_s": round(report.exposed_comm_s, 3),
        "idle_s": round(report.bubble_s, 3),
        "top_exposed": "; ".join(f"{k} {v:.2f} s" for k, v in exposed[:2] if v > 0.005),
    }


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| layout | GPUs | batch | TFLOP/s per GPU | step s | compute s | exposed comm s | "
        "idle s | most exposed | without NCCL protocols | with two ZeRO-3 groups | "
        f"without host walks | links at 1/{SLOWER_LINKS:g} | fits |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---|\n"
    )
    lines = [
        f"| {r['layout']} | {r['gpus']} | {r['global_batch']} | {r['tflops_per_gpu']} | "
        f"{r['step_s']} | {r['compute_s']} | {r['exposed_comm_s']} | {r['idle_s']} | "
        f"{r['top_exposed']} | {r['tflops_without_nccl_protocols']} | "
        f"{r['tflops_with_two_zero3_groups'] if r['tflops_with_two_zero3_groups'] else '-'} | "
        f"{r['tflops_without_host_walks'] if r['tflops_without_host_walks'] else '-'} | "
        f"{r['tflops_links_half']} | {'yes' if r['fits'] else 'no'} |"
        for r in rows
    ]
    return head + "\n".join(lines) + "\n"


HOST_MODELS = ("gpt-1.3b", "gpt-6.7b", "gpt-13b")
HOST_SIZES = (64, 256, 1024, 2048)


def host_walks() -> str:
    """ZeRO-3's host walks by model size: model TFLOP/s per GPU with and without them, global
    batch 2,048 sequences of 2,048, micro-batch 1, full recompute, an mpu, `dgx-a100` nodes."""
    gpu = presets.gpu("a100-80gb")
    lines = [
        "| model | GPUs | with walks | without | step s | host exposed s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name in HOST_MODELS:
        for n in HOST_SIZES:
            cfg = ParallelConfig(
                dp=n, zero_stage=3, grad_accum=2048 // n, recompute=Recompute.FULL, mpu=True
            )
            topo = presets.topology(f"{n // 8}x8-dgx-a100")
            report = simulate(preset(name), cfg, topo, gpu)
            walkless = dataclasses.replace(cfg, without=frozenset({Mechanism.ZERO3_HOST}))
            bare = simulate(preset(name), walkless, topo, gpu)
            host = report.critical.exposed_by_category.get("host", 0.0)
            lines.append(
                f"| {name} | {n} | {report.model_tflops_per_gpu:.1f} | "
                f"{bare.model_tflops_per_gpu:.1f} | {report.step_time_s:.3f} | {host:.3f} |"
            )
            print(lines[-1], flush=True)
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", help="GPU counts, comma-separated (default: all)")
    parser.add_argument(
        "--host-walks", action="store_true", help="print ZeRO-3's host walks by model size"
    )
    args = parser.parse_args()
    if args.host_walks:
        print(host_walks())
        return 0
    sizes = tuple(int(s) for s in args.sizes.split(",")) if args.sizes else None
    rows = []
    todo = layouts(sizes)
    for i, (name, n, cfg) in enumerate(todo, 1):
        rows.append(row(name, n, cfg))
        r = rows[-1]
        print(f"[{i}/{len(todo)}] {name} {n:>5} GPUs: {r['tflops_per_gpu']} TFLOP/s", flush=True)
    if sizes is not None:
        print(table(rows))
        return 0
    write_csv(RESULTS / "zero3_scale.csv", rows)
    write_block(RESULTS / "zero3_scale.md", table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
