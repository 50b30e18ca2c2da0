"""Spans -> the metrics a planner reads, and a Chrome/Perfetto trace with one track per stream.

Time on a rank splits into compute (any compute span on the compute stream), exposed
communication (communication running while no compute runs) and idle time (nothing runs: the
pipeline bubble, waiting on another stage).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from zsim.cluster.build import FloatArray, IntArray
from zsim.step.program import Category, Part, Stream
from zsim.step.spans import FusedPass, Span, TaskBlock

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
    """Where one rank's step time went: compute + exposed communication + idle = the step."""

    rank: int
    compute_s: float
    exposed_comm_s: float
    idle_s: float
    comm_total_s: float
    end_s: float = 0.0  # when the rank's last work ended
    exposed_by_category: dict[str, float] = field(default_factory=dict)  # may overlap


_COMPUTE_NAMES = frozenset(str(c) for c in COMPUTE_CATEGORIES)  # spans carry category names
Template = tuple[tuple[FloatArray, FloatArray], dict[str, tuple[FloatArray, FloatArray]]]


def rank_times(
    spans: Sequence[Span],
    passes: Sequence[FusedPass],
    rank: int,
    step_s: float,
    block: TaskBlock | None = None,
) -> RankTimes:
    """Where `rank`'s step went; `spans` and `passes` may be all ranks' or (faster) only its;
    `block`: its tasks the prefix ran, when `spans` and `passes` are the event loop's."""
    measured = _measure(*_gather(spans, passes, rank, block))
    return _times(measured, _last_end(spans, passes, rank, block), rank, step_s)


def _times(measured: Measures, end_s: float, rank: int, step_s: float) -> RankTimes:
    compute_s, exposed = measured.compute_s, measured.exposed_comm_s
    return RankTimes(
        rank,
        compute_s,
        exposed,
        max(0.0, step_s - compute_s - exposed),
        measured.comm_total_s,
        end_s,
        measured.exposed_by_category,
    )


def _last_end(
    spans: Sequence[Span], passes: Sequence[FusedPass], rank: int, block: TaskBlock | None
) -> float:
    ends = [s.end_s for s in spans if s.rank == rank] + [p.end_s for p in passes if p.rank == rank]
    if block is not None:
        ends += [float(np.max(e, initial=0.0)) for e in (block.span_end, block.pass_end)]
    return max(ends, default=0.0)


class Measures(NamedTuple):
    """A rank's compute, exposed and total communication over some time (`RankTimes`)."""

    compute_s: float
    exposed_comm_s: float
    comm_total_s: float
    exposed_by_category: dict[str, float]


def rank_times_and_window(
    spans: Sequence[Span],
    passes: Sequence[FusedPass],
    rank: int,
    step_s: float,
    window: tuple[float, float],
    block: TaskBlock | None = None,
) -> tuple[RankTimes, Measures]:
    """`rank_times`, and the rank's measures over the window [lo, hi) alone (its work
    clipped to it), from one gathering of its work."""
    compute, comm = _gather(spans, passes, rank, block)
    lo, hi = window
    clipped = _measure(compute.clip(lo, hi), {k: iv.clip(lo, hi) for k, iv in comm.items()})
    end = _last_end(spans, passes, rank, block)
    return _times(_measure(compute, comm), end, rank, step_s), clipped


def _measure(compute: _Intervals, comm: dict[str, _Intervals]) -> Measures:
    every_comm = _Intervals()
    for intervals in comm.values():
        every_comm.extend(intervals)
    segments, computing, communicating = _boundaries(*compute.arrays(), *every_comm.arrays())
    return Measures(
        float(segments[computing].sum()),
        float(segments[communicating & ~computing].sum()),
        float(segments[communicating].sum()),
        {category: _exposed(iv, compute) for category, iv in sorted(comm.items())},
    )


def _gather(
    spans: Sequence[Span], passes: Sequence[FusedPass], rank: int, block: TaskBlock | None
) -> tuple[_Intervals, dict[str, _Intervals]]:
    """A rank's compute intervals, and its communication intervals by category, in the order
    the engine recorded them (the prefix's first): `_measure`'s sums depend on it in their
    last bits."""
    compute, comm = _Intervals(), dict[str, _Intervals]()
    if block is not None:
        _block_spans(block, compute, comm)
    span_compute: list[tuple[float, float]] = []
    span_comm: dict[str, list[tuple[float, float]]] = {}
    for s in spans:
        if s.rank != rank:
            continue
        if not _computes(s):
            span_comm.setdefault(s.category, []).append((s.start_s, s.end_s))
        elif s.stream is not Stream.HOST:
            span_compute.append((s.start_s, s.end_s))
    zero = np.zeros(1)  # the spans as one block each way, in their order
    if span_compute:
        compute.add(zero, *_arrays(span_compute))
    for category, intervals in span_comm.items():
        comm.setdefault(category, _Intervals()).add(zero, *_arrays(intervals))
    starts: dict[int, list[float]] = {}
    templates: dict[int, Template] = {}
    if block is not None:
        _block_passes(block, starts, templates)
    for p in passes:
        if p.rank == rank:
            starts.setdefault(id(p.parts), []).append(p.start_s)
            if id(p.parts) not in templates:
                templates[id(p.parts)] = _template(p.stream, p.parts)
    for kind, at in starts.items():
        offsets = np.asarray(at)
        own_compute, own_comm = templates[kind]
        compute.add(offsets, *own_compute)
        for category, (begin, end) in own_comm.items():
            comm.setdefault(category, _Intervals()).add(offsets, begin, end)
    return compute, comm


def _exposed(intervals: _Intervals, compute: _Intervals) -> float:
    segments, inside, covered = _boundaries(*intervals.arrays(), *compute.arrays())
    return float(segments[inside & ~covered].sum())


class _Intervals:
    """Intervals gathered as (offsets x template) blocks, flattened once."""

    def __init__(self) -> None:
        self.starts: list[FloatArray] = []
        self.ends: list[FloatArray] = []

    def add(self, offsets: FloatArray, starts: FloatArray, ends: FloatArray) -> None:
        self.starts.append((offsets[:, None] + starts[None, :]).ravel())
        self.ends.append((offsets[:, None] + ends[None, :]).ravel())

    def extend(self, other: _Intervals) -> None:
        self.starts += other.starts
        self.ends += other.ends

    def arrays(self) -> tuple[FloatArray, FloatArray]:
        if not self.starts:
            return np.zeros(0), np.zeros(0)
        return np.concatenate(self.starts), np.concatenate(self.ends)

    def clip(self, lo: float, hi: float) -> _Intervals:
        """The parts of the intervals inside [lo, hi), as one block."""
        starts, ends = self.arrays()
        starts, ends = np.maximum(starts, lo), np.minimum(ends, hi)
        inside = ends > starts
        clipped = _Intervals()
        clipped.starts, clipped.ends = [starts[inside]], [ends[inside]]
        return clipped


def _block_spans(block: TaskBlock, compute: _Intervals, comm: dict[str, _Intervals]) -> None:
    """`_gather`'s spans of a `TaskBlock`, by column."""
    columns, zero = block.columns, np.zeros(1)
    category = columns.category[block.span_at]
    computes = np.array([c in _COMPUTE_NAMES for c in columns.categories], dtype=bool)[category]
    on_device = computes & ~columns.host[block.span_at]
    if on_device.any():
        compute.add(zero, block.span_start[on_device], block.span_end[on_device])
    for code in _first_seen(np.where(computes, -1, category)):
        mine = category == code
        comm[columns.categories[code]] = _Intervals()
        comm[columns.categories[code]].add(zero, block.span_start[mine], block.span_end[mine])


def _block_passes(
    block: TaskBlock, starts: dict[int, list[float]], templates: dict[int, Template]
) -> None:
    """`_gather`'s fused passes of a `TaskBlock`: their starts by kind, and each kind's
    template."""
    kinds = block.columns.kind[block.pass_at]
    for kind in _first_seen(kinds):
        mine = kinds == kind
        parts = block.columns.kinds[kind]
        starts[id(parts)] = block.pass_start[mine].tolist()
        stream = block.tasks[int(block.pass_at[mine][0])].stream
        templates[id(parts)] = _template(stream, parts)


def _first_seen(codes: IntArray) -> list[int]:
    """The distinct non-negative codes, in the order each first occurs."""
    found, first = np.unique(codes, return_index=True)
    return [c for c in found[np.argsort(first)].tolist() if c >= 0]


def _template(stream: Stream, parts: tuple[Part, ...]) -> Template:
    """A pass's compute parts, and its communication parts by category, relative to it."""
    on_device = stream is not Stream.HOST
    compute = [(q.start_s, q.start_s + q.duration_s) for q in parts if on_device and _computes(q)]
    comm: dict[str, list[tuple[float, float]]] = {}
    for q in parts:
        if not _computes(q):
            comm.setdefault(str(q.category), []).append((q.start_s, q.start_s + q.duration_s))
    return _arrays(compute), {category: _arrays(iv) for category, iv in comm.items()}


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
