"""Spans -> the metrics a planner reads, and a Chrome/Perfetto trace with one track per stream.

Time on a rank splits into compute (any compute span on the compute stream), exposed
communication (communication running while no compute runs) and idle time (nothing runs: the
pipeline bubble, waiting on another stage).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from zsim.cluster.build import FloatArray
from zsim.step.program import Category, Part, Stream
from zsim.step.spans import FusedPass, Span

BoolArray = npt.NDArray[np.bool_]

COMPUTE_CATEGORIES = {Category.FORWARD, Category.BACKWARD, Category.RECOMPUTE, Category.OPTIMIZER}


def _boundaries(
    starts: FloatArray, ends: FloatArray, cover_starts: FloatArray, cover_ends: FloatArray
) -> tuple[FloatArray, BoolArray, BoolArray]:
    """The elementary segments between every boundary of both sets, and whether each lies
    inside the first set's union and inside the cover's (one sort, no pairwise work)."""
    times = np.concatenate([starts, ends, cover_starts, cover_ends])
    n, m = len(starts), len(cover_starts)
    inside = np.concatenate([np.ones(n), -np.ones(n), np.zeros(2 * m)])
    covered = np.concatenate([np.zeros(2 * n), np.ones(m), -np.ones(m)])
    order = np.argsort(times, kind="stable")
    segments = np.diff(times[order])
    return segments, np.cumsum(inside[order])[:-1] > 0, np.cumsum(covered[order])[:-1] > 0


def _arrays(intervals: Iterable[tuple[float, float]]) -> tuple[FloatArray, FloatArray]:
    pairs = np.asarray(list(intervals), dtype=float).reshape(-1, 2)
    return pairs[:, 0], pairs[:, 1]


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by a set of intervals."""
    none = np.zeros(0)
    segments, inside, _ = _boundaries(*_arrays(intervals), none, none)
    return float(segments[inside].sum())


def uncovered(
    intervals: Iterable[tuple[float, float]], cover: Iterable[tuple[float, float]]
) -> float:
    """Length of `intervals`' union not covered by `cover`'s union."""
    segments, inside, covered = _boundaries(*_arrays(intervals), *_arrays(cover))
    return float(segments[inside & ~covered].sum())


@dataclass(frozen=True)
class RankTimes:
    """Where one rank's step time went."""

    rank: int
    compute_s: float
    exposed_comm_s: float
    idle_s: float
    comm_total_s: float


_COMPUTE_NAMES = frozenset(str(c) for c in COMPUTE_CATEGORIES)  # spans carry category names


def rank_times(
    spans: Sequence[Span], passes: Sequence[FusedPass], rank: int, step_s: float
) -> RankTimes:
    """Where `rank`'s step went; `spans` and `passes` may be all ranks' or (faster) only its."""
    mine = [s for s in spans if s.rank == rank]
    on_device = [s for s in mine if s.stream is not Stream.HOST]
    compute, comm = _Intervals(), _Intervals()
    compute.add(np.zeros(1), *_arrays((s.start_s, s.end_s) for s in on_device if _computes(s)))
    comm.add(np.zeros(1), *_arrays((s.start_s, s.end_s) for s in mine if not _computes(s)))
    templates: dict[int, tuple[FloatArray, FloatArray, FloatArray, FloatArray]] = {}
    by_kind: dict[int, list[float]] = {}
    for p in passes:
        if p.rank == rank:
            by_kind.setdefault(id(p.parts), []).append(p.start_s)
            if id(p.parts) not in templates:
                templates[id(p.parts)] = _template(p)
    for kind, starts in by_kind.items():
        at = np.asarray(starts)
        c_start, c_end, m_start, m_end = templates[kind]
        compute.add(at, c_start, c_end)
        comm.add(at, m_start, m_end)
    busy = _boundaries(*compute.arrays(), *comm.arrays())
    segments, computing, communicating = busy
    compute_s = float(segments[computing].sum())
    exposed = float(segments[communicating & ~computing].sum())
    return RankTimes(
        rank,
        compute_s,
        exposed,
        max(0.0, step_s - compute_s - exposed),
        float(segments[communicating].sum()),
    )


class _Intervals:
    """Intervals gathered as (offsets x template) blocks, flattened once."""

    def __init__(self) -> None:
        self.starts: list[FloatArray] = []
        self.ends: list[FloatArray] = []

    def add(self, offsets: FloatArray, starts: FloatArray, ends: FloatArray) -> None:
        self.starts.append((offsets[:, None] + starts[None, :]).ravel())
        self.ends.append((offsets[:, None] + ends[None, :]).ravel())

    def arrays(self) -> tuple[FloatArray, FloatArray]:
        if not self.starts:
            return np.zeros(0), np.zeros(0)
        return np.concatenate(self.starts), np.concatenate(self.ends)


def _template(p: FusedPass) -> tuple[FloatArray, FloatArray, FloatArray, FloatArray]:
    """A pass's compute and communication parts, relative to its start."""
    on_device = p.stream is not Stream.HOST
    compute = [(q.start_s, q.start_s + q.duration_s) for q in p.parts if on_device and _computes(q)]
    comm = [(q.start_s, q.start_s + q.duration_s) for q in p.parts if not _computes(q)]
    return (*_arrays(compute), *_arrays(comm))


def _computes(work: Span | Part) -> bool:
    return work.category in _COMPUTE_NAMES  # Category is a StrEnum: parts match by name too


def chrome_trace(spans: Sequence[Span], passes: Sequence[FusedPass] = ()) -> dict[str, Any]:
    """Chrome trace-event JSON (opens in Perfetto): a process per rank, a thread per stream.

    Every task is an event, except inside fused passes (`FusedPass`, a pass of fixed-time work
    run as one task): each pass is one event, and only the first pass of each kind on each rank
    (the same chunk, forward or backward) also shows its kernels and tensor-parallel
    collectives, nested inside it; the others repeat it exactly, so their parts are left out
    (the pass event's args count them)."""
    streams = list(Stream)
    events: list[dict[str, Any]] = []
    for rank in sorted({s.rank for s in spans} | {p.rank for p in passes}):
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
    shown: set[tuple[int, int]] = set()
    parts: list[Span] = []
    for p in passes:
        detail = {"category": p.category, "parts": len(p.parts)}
        tid = streams.index(p.stream)
        events.append(_event(p.name, p.category, p.rank, tid, p.start_s, p.end_s, detail))
        if (p.rank, id(p.parts)) not in shown:  # the first of its kind on this rank
            shown.add((p.rank, id(p.parts)))
            parts.extend(p.spans())
    for s in [*spans, *parts]:
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
