"""Diagnosis: is an FSDP2 unit's all-gather inside training slower than the same all-gather
timed alone (the calibration's microbenchmark)?

    PYTHONPATH=. python benchmarks/validation/diagnosis/fsdp_gathers.py

The emulated 2x2 FSDP2 steps are 4-6 % faster in zsim than measured, with the bytes between
nodes right (-0.8 %). Per gather, the committed runs' phases say the forward's all-gathers
took 33.2 ms each under FULL_SHARD (the microbenchmark: 30.2 ms mean, zsim 29.8) and 5.95 ms
under HYBRID_SHARD's intra-node shard groups (4.0 ms mean, zsim 4.7). This asks where the
difference is, on one host (no network: HYBRID_SHARD's gathers are intra-node there too).

Four gloo ranks (one thread each and glibc as a caching allocator, as the validation runs
them), the validation's MLP
(`toy-mlp:hidden=1024`: 8 x Linear(1024, 1024) with bias, fp32, micro-batch 4), FSDP2
HYBRID_SHARD with shard groups of 2 (`zsim.testbed.fsdp_engine`). Timed, 30 repeats each after
10 warm-up steps, every rank at once (the median of each rank's, then the slowest rank's):
  - `forward`: FSDP2's forward (8 unit all-gathers, each unit's compute, the root's);
  - `compute`: the same forward of an unsharded copy (no communication);
  - `gathers`: 8 `all_gather_into_tensor` of one unit's bytes on the shard group, back to back,
    a fresh output each, the input a slice of it (as FSDP2 calls it);
  - `gathers + copies`: the same with FSDP2's copy-in (`torch._foreach_copy_` of the unit's
    two shards into the input) and copy-out (`split_with_sizes_copy` to the two parameters).
Writes fsdp_gathers.json beside itself.
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from zsim.testbed.procs import CPU_ALLOCATOR_ENV

OUT = Path(__file__).with_name("fsdp_gathers.json")
HIDDEN, UNITS, BATCH, WARMUP, REPEATS = 1024, 8, 4, 10, 30


def _timed(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _worker(rank: int, world: int, port: int, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from zsim.testbed.fsdp_engine import FsdpEngine

    torch.manual_seed(0)
    plain = torch.nn.Sequential(*[torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(UNITS)])
    model = torch.nn.Module()
    model.net = copy.deepcopy(plain)
    model.forward = lambda x: model.net(x)  # type: ignore[method-assign]
    engine = FsdpEngine(model, {"sharding": "hybrid", "shard_size": 2}, 1, torch.float32)
    x = torch.randn(BATCH, HIDDEN)
    for _ in range(WARMUP):
        engine.backward(engine(x).square().mean())
        engine.step()
    shard_group = engine.module.net[0].weight.device_mesh.get_group("shard")  # type: ignore
    numel = HIDDEN * HIDDEN + HIDDEN
    shards = [torch.randn(HIDDEN * HIDDEN // 2), torch.randn(HIDDEN // 2)]
    weight, bias = torch.empty(HIDDEN, HIDDEN), torch.empty(HIDDEN)

    def gathers(copies: bool) -> None:
        """As `foreach_all_gather` and `foreach_all_gather_copy_out` do it: the input is this
        rank's slice of the output, the copy-out one strided copy per parameter."""
        mine = dist.get_rank(shard_group)
        for _ in range(UNITS):
            out = torch.empty(numel)
            inp = out.narrow(0, mine * (numel // 2), numel // 2)
            if copies:
                torch._foreach_copy_(list(inp.split([s.numel() for s in shards])), shards)
            dist.all_gather_into_tensor(out, inp, group=shard_group)
            if copies:
                split = [HIDDEN * HIDDEN // 2, HIDDEN // 2]
                outs = [weight.view(2, -1), bias.view(2, -1)]
                torch.split_with_sizes_copy(out.view(2, -1), split, dim=1, out=outs)

    with torch.no_grad():
        found = {
            "forward": _timed(lambda: engine(x), REPEATS),
            "compute": _timed(lambda: plain(x), REPEATS),
            "gathers": _timed(lambda: gathers(False), REPEATS),
            "gathers + copies": _timed(lambda: gathers(True), REPEATS),
        }
    queue.put((rank, found))
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    world, port = 4, 29617
    os.environ.update(CPU_ALLOCATOR_ENV)  # glibc as a caching allocator, as the testbed runs
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    procs = [context.Process(target=_worker, args=(r, world, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(queue.get() for _ in range(world))
    for p in procs:
        p.join()
    keys = list(results[0])
    slowest = {k: max(results[r][k] for r in results) for k in keys}
    report = {
        "setup": {"ranks": world, "shard_group": 2, "hidden": HIDDEN, "units": UNITS,
                  "micro_batch": BATCH, "repeats": REPEATS, "torch": torch.__version__},
        "per_rank_ms": {r: {k: round(v * 1e3, 3) for k, v in results[r].items()} for r in results},
        "slowest_rank_ms": {k: round(v * 1e3, 3) for k, v in slowest.items()},
    }  # fmt: skip
    OUT.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report["slowest_rank_ms"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
