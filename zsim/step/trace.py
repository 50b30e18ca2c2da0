"""Spans -> the metrics a planner reads, and a Chrome/Perfetto trace with one track per stream.

Time on a rank splits into compute (any compute span on the compute stream), exposed
communication (communication running while no compute runs) and idle time (nothing runs: the
pipeline bubble, waiting on another stage).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from zsim.step.engine import Span
from zsim.step.program import Category, Stream

COMPUTE_CATEGORIES = {Category.FORWARD, Category.BACKWARD, Category.RECOMPUTE, Category.OPTIMIZER}


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by a set of intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _merge(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def uncovered(
    intervals: Iterable[tuple[float, float]], cover: Iterable[tuple[float, float]]
) -> float:
    """Length of `intervals`' union not covered by `cover`'s union (one sweep, both sorted)."""
    blocks = _merge(cover)
    outside, j = 0.0, 0
    for a, b in _merge(intervals):
        while j < len(blocks) and blocks[j][1] <= a:
            j += 1
        inside, k = 0.0, j
        while k < len(blocks) and blocks[k][0] < b:
            inside += max(0.0, min(b, blocks[k][1]) - max(a, blocks[k][0]))
            k += 1
        outside += (b - a) - inside
    return outside


@dataclass(frozen=True)
class RankTimes:
    """Where one rank's step time went."""

    rank: int
    compute_s: float
    exposed_comm_s: float
    idle_s: float
    comm_total_s: float


_COMPUTE_NAMES = frozenset(str(c) for c in COMPUTE_CATEGORIES)  # spans carry category names


def rank_times(spans: Sequence[Span], rank: int, step_s: float) -> RankTimes:
    """Where `rank`'s step went; `spans` may be all ranks' or (faster) only this rank's."""
    mine = [s for s in spans if s.rank == rank]
    compute = [
        (s.start_s, s.end_s)
        for s in mine
        if s.stream is not Stream.HOST and s.category in _COMPUTE_NAMES
    ]
    comm = [(s.start_s, s.end_s) for s in mine if s.category not in _COMPUTE_NAMES]
    compute_s = union_length(compute)
    exposed = uncovered(comm, compute)
    return RankTimes(
        rank, compute_s, exposed, max(0.0, step_s - compute_s - exposed), union_length(comm)
    )


def chrome_trace(spans: Sequence[Span]) -> dict[str, Any]:
    """Chrome trace-event JSON (opens in Perfetto): a process per rank, a thread per stream."""
    streams = list(Stream)
    events: list[dict[str, Any]] = []
    for rank in sorted({s.rank for s in spans}):
        events.append(
            {"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}}
        )
        for tid, stream in enumerate(streams):
            events.append(
                {
                    "name": "thread_name",
                    "ph": "M",
                    "pid": rank,
                    "tid": tid,
                    "args": {"name": str(stream)},
                }
            )
    for s in spans:
        args: dict[str, Any] = {"category": s.category}
        if s.nbytes:
            args["bytes"] = s.nbytes
        events.append(
            {
                "name": s.name,
                "cat": s.category,
                "ph": "X",
                "pid": s.rank,
                "tid": streams.index(s.stream),
                "ts": s.start_s * 1e6,
                "dur": (s.end_s - s.start_s) * 1e6,
                "args": args,
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms"}
