"""The calibration worker, one per rank, launched by torchrun: `python -m zsim.calibrate.worker
--plan PLAN.json --out RAW.json`.

Every rank runs every measurement at the same time as the others, so compute is timed under
the placement training has (ranks sharing cores slow each other). Each sample is the time of
one call (small ops: a loop of calls divided by their number), the maximum over ranks, after
warm-up. CPU samples use time.perf_counter; CUDA samples use CUDA events. Rank 0 prints
`@zsim-progress DONE TOTAL LABEL` lines for the launcher and writes the rows.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from zsim.calibrate import engine_host, fsdp_host, micro, pingpong, pipe_host
from zsim.calibrate.bench import Bench, last_level_cache_bytes
from zsim.calibrate.measurement import Measurement, merge
from zsim.calibrate.plan import PROGRESS, Plan, layer_kinds, layer_tp_degrees
from zsim.testbed import torchmodels
from zsim.workload.model import ModelKind

Task = tuple[str, Callable[[], list[Measurement]]]


def groups(world: int, local: int) -> list[tuple[str, list[list[int]]]]:
    """The process groups to measure: ranks on one node (intra), one rank per node (inter),
    everyone (full). On one node only intra exists (it is also the full group)."""
    nodes = world // local
    intra = [list(range(i * local, (i + 1) * local)) for i in range(nodes)]
    if nodes == 1:
        return [("intra", intra)] if local > 1 else []
    inter = [list(range(j, world, local)) for j in range(local)]
    out = [("intra", intra)] if local > 1 else []
    return [*out, ("inter", inter), ("full", [list(range(world))])]


def tasks(bench: Bench, plan: Plan, world: int, local: int) -> list[Task]:
    out: list[Task] = []
    out += [(f"gemm {s}", partial(micro.gemm, bench, s)) for s in plan.gemm_shapes]
    out += [(f"memory {s} B", partial(micro.memory, bench, s)) for s in plan.memory_sizes_bytes]
    for model in plan.models:
        if model.kind is ModelKind.TRANSFORMER:
            out.append((f"attention {model.name}", partial(micro.attention, bench, model)))
        for tp in layer_tp_degrees(model, plan.tp_degrees):
            for kind in layer_kinds(model):
                out += [
                    (
                        f"layer {model.name} {kind} mb{mb}" + (f" tp{tp}" if tp > 1 else ""),
                        partial(micro.layer, bench, model, kind, mb, tp),
                    )
                    for mb in plan.micro_batches
                ]
    out += [
        (f"host copy {s} B", partial(micro.host_copy, bench, s)) for s in plan.host_copy_sizes_bytes
    ]
    out += [(f"adamw {p} params", partial(micro.optimizer, bench, p)) for p in plan.adam_params]
    me = dist.get_rank()
    for name, members in groups(world, local):
        handles = [dist.new_group(r) for r in members]  # every rank creates every group
        mine = next(i for i, r in enumerate(members) if me in r)
        out += [
            (
                f"{op} {name} {size} B",
                partial(micro.collective, bench, op, size, name, handles[mine], members[mine]),
            )
            for op in plan.collectives
            for size in plan.collective_sizes_bytes
        ]
        if plan.device == "cpu" and name != "full":  # the link's own latency (gloo's sockets)
            link = bench.plan.link_classes.get(name, "")
            play = partial(pingpong.pingpong, name, members[0], link, plan.dtype)
            out.append((f"ping-pong {name}", play))
    if plan.engine_host:
        out.append(("DeepSpeed host work", partial(engine_host.engine_host, plan.dtype)))
        out.append(("PipelineEngine host work", partial(pipe_host.pipe_host, plan.dtype)))
        out.append(("FSDP2 host work", partial(fsdp_host.fsdp_host, plan.dtype)))
    return out


def provenance(device: torch.device, world: int, local: int) -> dict[str, Any]:
    """What this worker can tell about the software and the device (rank 0's view)."""

    def version(pkg: str) -> str:
        try:
            return importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    info: dict[str, Any] = {
        "torch": torch.__version__,
        "deepspeed": version("deepspeed"),
        "backend": dist.get_backend(),
        "world_size": world,
        "local_world_size": local,
        "torch_num_threads": torch.get_num_threads(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "rank_rss_bytes": _rss_bytes(),
        "cache_bytes": last_level_cache_bytes(),
    }
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        info |= {
            "device_name": torch.cuda.get_device_name(device),
            "cuda": torch.version.cuda,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())),  # type: ignore[no-untyped-call]
            "device_memory_bytes": total,
            "device_reserved_bytes": total - free,
            "cache_bytes": torch.cuda.get_device_properties(device).L2_cache_size,
            "sm_count": torch.cuda.get_device_properties(device).multi_processor_count,
        }
    return info


def _rss_bytes() -> int:
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zsim.calibrate.worker")
    parser.add_argument("--plan", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    plan = Plan.from_dict(json.loads(args.plan.read_text()))
    warnings.filterwarnings("ignore", category=FutureWarning)  # gloo's *_tensor deprecations
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if plan.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    torchmodels.flush_subnormals(device.type)
    dist.init_process_group(
        "nccl" if plan.device == "cuda" else "gloo", timeout=timedelta(minutes=10)
    )
    world = dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    torch.manual_seed(dist.get_rank())
    bench = Bench(plan, device)
    info = provenance(device, world, local)
    work = tasks(bench, plan, world, local)
    started = time.time()
    total = len(work) * plan.rounds
    results: list[list[Measurement]] = [[] for _ in work]
    for round_ in range(plan.rounds):
        bench.warmup = plan.warmup if round_ == 0 else min(1, plan.warmup)
        for i, (label, task) in enumerate(work):
            if dist.get_rank() == 0:
                done = round_ * len(work) + i
                print(f"{PROGRESS} {done} {total} round {round_ + 1}: {label}", flush=True)
            dist.barrier()
            results[i] = merge(results[i], task())
    rows = [row for task_rows in results for row in task_rows]
    if dist.get_rank() == 0:
        print(f"{PROGRESS} {total} {total} done", flush=True)
        info["measure_seconds"] = round(time.time() - started, 1)
        payload = {"provenance": info, "measurements": [r.to_dict() for r in rows]}
        args.out.write_text(json.dumps(payload))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
