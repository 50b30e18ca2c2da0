"""DeepSpeed ZeRO-3's host bookkeeping per data-parallel rank, measured on this host's CPU.

DeepSpeed 0.19 walks the ranks in Python for every coalesced parameter gather and every
gradient reduce-scatter (`docs/deepspeed-0.19-semantics.md`, "ZeRO-3's host walks"):
`_all_gather_dtype` makes one view of the flat buffer per rank before the all-gather;
`AllGatherCoalescedHandle.wait` then makes, for each parameter, a view of each rank's piece,
`torch.cat`s them and (on CUDA) records its stream on each; `reduce_scatter_coalesced` slices
every gradient per rank and `torch.cat`s the pieces into the interleaved buffer it
reduce-scatters. A gather of one parameter (`_all_gather_sequential`) walks no ranks. At
thousands of ranks this is milliseconds per call.

This runs DeepSpeed's own code, not a copy: the handle's `wait` on a finished gather, and
`reduce_scatter_coalesced` with its one collective replaced by nothing (the rank and world
queries answer for `world` ranks); the partition views are the one-line loop
`_all_gather_dtype` runs. CPU tensors, so `record_stream` (CUDA only) is not in it: a lower
bound of what a GPU host pays. Each cost is fitted as seconds per rank (per parameter where it
walks parameters) by least squares over `WORLDS` x `TENSORS`, in each of `ROUNDS` sweeps; the
cost is their median, the spread kept beside it.

    python -m zsim.calibrate.zero3_host [--out calibration/zero3-host]

writes `<out>.json` (the fitted costs, the rows, the host) and `<out>.csv` (the rows).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import numpy as np

from zsim.cluster.device import ZERO3_HOST_COSTS

WORLDS = (64, 256, 1024, 2048)
TENSORS = (1, 2, 4)
REPEATS = 15
ROUNDS = 5
PIECE = 8  # elements each rank holds of each parameter: the bookkeeping does not touch data
COSTS = ZERO3_HOST_COSTS


def _median_s(run: Callable[[Any], Any], prepare: Callable[[], Any]) -> float:
    times = []
    for _ in range(REPEATS):
        arg = prepare()
        start = time.perf_counter()
        run(arg)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _inflight_params(world: int, tensors: int) -> list[Any]:
    import torch
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    params: list[Any] = []
    for _ in range(tensors):
        p: Any = torch.nn.Parameter(torch.empty(0))
        p.ds_status, p.ds_numel, p.ds_shape = (
            ZeroParamStatus.INFLIGHT,
            world * PIECE,
            (world * PIECE,),
        )
        p.ds_tensor = torch.empty(PIECE)
        p.ds_tensor.ds_numel = PIECE
        p.ds_secondary_tensor = None
        params.append(p)
    return params


def _partitions(flat: Any, world: int, size: int) -> list[Any]:
    """The per-rank views `_all_gather_dtype` makes of a coalesced gather's flat buffer."""
    return [flat.narrow(0, size * i, size) for i in range(world)]


def gather_issue_s(world: int) -> float:
    import torch

    return _median_s(
        lambda flat: _partitions(flat, world, PIECE), lambda: torch.empty(world * PIECE)
    )


def gather_wait_s(world: int, tensors: int) -> float:
    import torch
    from deepspeed.runtime.zero.partition_parameters import AllGatherCoalescedHandle

    def handle() -> Any:
        flat = torch.empty(world * PIECE * tensors)
        done = SimpleNamespace(wait=lambda: None)  # the all-gather itself has finished
        return AllGatherCoalescedHandle(
            allgather_handle=done,
            params=_inflight_params(world, tensors),
            partitions=_partitions(flat, world, PIECE * tensors),
            world_size=world,
        )

    return _median_s(lambda h: h.wait(), handle)


def _no_collective(*args: Any, **kwargs: Any) -> None:
    """The reduce-scatter itself: left out (the walk is what is timed)."""


def reduce_s(world: int, tensors: int, collective: Callable[..., Any] = _no_collective) -> float:
    import torch
    from deepspeed.runtime.comm import coalesced_collectives as cc

    ranks = mock.Mock(**{"get_rank.return_value": 0, "get_world_size.return_value": world})
    grads = [torch.empty(world * PIECE - 1) for _ in range(tensors)]  # the last rank padded
    with (
        mock.patch.object(cc, "dist", ranks),
        mock.patch.object(cc, "_torch_reduce_scatter_fn", collective),
    ):
        return _median_s(lambda g: cc.reduce_scatter_coalesced(g), lambda: grads)


def measure(progress: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Every row of `ROUNDS` sweeps: (round, cost, world, tensors, median seconds)."""
    rows = []
    for round_ in range(ROUNDS):
        progress(f"round {round_ + 1} of {ROUNDS}")
        for world in WORLDS:
            issue = gather_issue_s(world)
            rows.append(_row(round_, "gather_issue", world, 1, issue))
            for tensors in TENSORS:
                rows.append(
                    _row(round_, "gather_wait", world, tensors, gather_wait_s(world, tensors))
                )
                rows.append(_row(round_, "reduce", world, tensors, reduce_s(world, tensors)))
    return rows


def _row(round_: int, cost: str, world: int, tensors: int, s: float) -> dict[str, Any]:
    return {"round": round_, "cost": cost, "world": world, "tensors": tensors, "s": s}


def fit(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per cost, seconds = intercept + per_rank x world (x tensors where it walks parameters),
    least squares on relative residuals (rows span 64 to 2,048 ranks); the per-rank slope is
    what the simulator charges."""
    out = {}
    for cost in COSTS:
        mine = [r for r in rows if r["cost"] == cost]
        x = np.array([r["world"] * (1 if cost == "gather_issue" else r["tensors"]) for r in mine])
        y = np.array([r["s"] for r in mine])
        slope, intercept = np.polyfit(x, y, 1, w=1 / y)
        worst = max(abs(slope * xi + intercept - yi) / yi for xi, yi in zip(x, y, strict=True))
        out[cost] = {
            "per_rank_s": float(slope),
            "intercept_s": float(intercept),
            "worst_rel_err": worst,
        }
    return out


def fit_rounds(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each round fitted apart; the cost is the rounds' median slope, with their spread (this
    VM's speed drifts by up to 2x within minutes: `benchmarks/validation/README.md`)."""
    rounds = sorted({r["round"] for r in rows})
    each = [fit([r for r in rows if r["round"] == k]) for k in rounds]
    out: dict[str, dict[str, Any]] = {}
    for cost in COSTS:
        slopes = [f[cost]["per_rank_s"] for f in each]
        out[cost] = {
            "per_rank_s": float(np.median(slopes)),
            "rounds_per_rank_s": slopes,
            "worst_rel_err": max(f[cost]["worst_rel_err"] for f in each),
        }
    return out


def _cpu_model() -> str:
    for line in (
        Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    ):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="calibration/zero3-host", help="path without suffix")
    args = parser.parse_args(argv)
    import deepspeed
    import torch

    rows = measure(lambda msg: print(f"zero3-host: {msg}", file=sys.stderr, flush=True))
    fitted = fit_rounds(rows)
    result = {
        "fit": fitted,
        "rows": rows,
        "provenance": {
            "cpu": _cpu_model(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "deepspeed": deepspeed.__version__,
            "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "repeats": REPEATS,
        },
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    with out.with_suffix(".csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["round", "cost", "world", "tensors", "s"])
        writer.writeheader()
        writer.writerows(rows)
    for cost, f_ in fitted.items():
        low, high = min(f_["rounds_per_rank_s"]), max(f_["rounds_per_rank_s"])
        print(
            f"{cost}: {f_['per_rank_s'] * 1e6:.2f} us per rank ({low * 1e6:.2f}-{high * 1e6:.2f})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
