"""Spans -> the metrics a planner reads, and a Chrome/Perfetto trace with one track per stream.

Time on a rank splits into compute (any compute span on the compute stream), exposed
communication (communication running while no compute runs) and idle time (nothing runs: the
pipeline bubble, waiting on another stage).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from zsim.step.engine import FusedPass, Span
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


def chrome_trace(spans: Sequence[Span], passes: Sequence[FusedPass] = ()) -> dict[str, Any]:
    """Chrome trace-event JSON (opens in Perfetto): a process per rank, a thread per stream.

    Every task is an event, except inside fused passes (`FusedPass`, a pass of fixed-time work
    run as one task): each pass is one event, and only the first pass of each kind on each rank
    (the same chunk, forward or backward) also shows its kernels and tensor-parallel
    collectives, nested inside it; the others repeat it exactly, so their parts are left out
    (the pass event's args count them)."""
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
    hidden = _repeated_parts(passes)
    compute = streams.index(Stream.COMPUTE)
    for p in passes:
        detail = {"category": p.category, "parts": p.parts}
        events.append(_event(p.name, p.category, p.rank, compute, p.start_s, p.end_s, detail))
    for i, s in enumerate(spans):
        if i in hidden:
            continue
        args: dict[str, Any] = {"category": s.category}
        if s.nbytes:
            args["bytes"] = s.nbytes
        tid = streams.index(s.stream)
        events.append(_event(s.name, s.category, s.rank, tid, s.start_s, s.end_s, args))
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _event(
    name: str, cat: str, pid: int, tid: int, start: float, end: float, args: dict[str, Any]
) -> dict[str, Any]:
    return {
        "name": name,
        "cat": cat,
        "ph": "X",
        "pid": pid,
        "tid": tid,
        "ts": start * 1e6,
        "dur": (end - start) * 1e6,
        "args": args,
    }


def _repeated_parts(passes: Sequence[FusedPass]) -> set[int]:
    """Span indices of the parts of every fused pass after the first of its kind per rank."""
    seen: set[tuple[int, int]] = set()
    hidden: set[int] = set()
    for p in passes:
        if (p.rank, p.template) in seen:
            hidden.update(range(p.first_span, p.first_span + p.parts))
        seen.add((p.rank, p.template))
    return hidden
