"""The fixed-time prefix of a step, timed as a longest path through its task graph.

Until the first collective starts (or two sends would meet on a capacity), every task of a step
takes a time known in advance: compute and fused passes their durations, a pipeline send alone
on its links its call latency, its route's latency and its bytes at the lone rate
(`zsim.network.alone`). The event loop would then start each task when its stream is free and
its dependencies are done, which is the longest path through the same DAG: this pass computes
those times directly, with no simpy event per task. The engine simulates only what starts from
the cut on (the earliest start of a task that is not fixed-time, or of a send that would share
a capacity with one still moving), taking over the sends still in flight, so the answer is the
event loop's. The pass issues sends in time order and stops at the cut: what it would time
beyond it the loop times again. A pipeline's warm-up and steady state are all prefix unless
its sends crowd a link; its cool-down, gradient reductions and optimizer step are simulated.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from zsim.cluster.build import FloatArray
from zsim.network.alone import AloneTerms
from zsim.network.collective import CollectiveCall, CollectiveOp
from zsim.network.communicator import Communicator
from zsim.step.program import Comm, Program, Stream, Task

Key = tuple[int, int]  # (rank, task index)
_FIT = 1e-9  # relative: sends filling a capacity to within this still fit
_UNTIMED = math.nan  # a task's start and end until the pass times it (compares false)


class Engine(Protocol):
    """What the prefix reads of the engine (`zsim.step.engine.Engine`)."""

    programs: Sequence[Program]
    ranks: tuple[int, ...]
    comms: Communicator

    def coords(self, rank: int) -> tuple[int, int, int]: ...
    def peer(self, rank: int, offset: int) -> int: ...
    def kernel_factor(self, rank: int, stream: Stream) -> float: ...
    def send_calls(self, rank: int, comm: Comm) -> tuple[CollectiveCall, list[CollectiveCall]]: ...


@dataclass(slots=True)
class LoneSend:
    """A send of the prefix, timed alone: issued at `start`, its data from `data_at`, its last
    byte at `ends` (the capacities are held from issue to end, as `LoneTransfers` holds them)."""

    terms: AloneTerms
    nbytes: float
    start: float
    data_at: float
    ends: float


@dataclass(slots=True)
class _Stream:
    rank: int
    tasks: list[Task]
    factor: float  # the rank's slowdown of this stream's kernels
    pos: int = 0
    free_s: float = 0.0


@dataclass
class Prefix:
    """Task times up to the cut: the `start` and `end` of every task of each rank, by task
    index (NaN where the pass could not time it; those from the cut on are simulated again),
    the sends among them, and the receives' send times."""

    cut_s: float = 0.0
    start: dict[int, list[float]] = field(default_factory=dict)  # rank -> by task index
    end: dict[int, list[float]] = field(default_factory=dict)
    sends: dict[Key, LoneSend] = field(default_factory=dict)
    sent_at: dict[Key, float] = field(default_factory=dict)  # receive -> its send's issue
    # (rank, bytes, peer) -> how such a send is timed alone (None: it cannot be)
    send_terms: dict[tuple[int, float, int], tuple[AloneTerms, float, float] | None] = field(
        default_factory=dict
    )

    def ran(self, rank: int, index: int) -> bool:
        """Whether the task started before the cut: it is the prefix's."""
        starts = self.start.get(rank)
        return starts is not None and starts[index] < self.cut_s  # NaN: False

    def finished_mask(self, rank: int, tasks: int) -> list[bool]:
        """By task index, whether each of the rank's `tasks` ended before the cut."""
        ends = self.end.get(rank)
        if ends is None:
            return [False] * tasks
        ended: list[bool] = (np.asarray(ends) < self.cut_s).tolist()
        return ended

    def ran_indices(self, rank: int) -> list[int]:
        """The rank's tasks that are the prefix's, in index order."""
        starts = self.start.get(rank)
        if starts is None:
            return []
        return np.flatnonzero(np.asarray(starts) < self.cut_s).tolist()


def time_prefix(engine: Engine) -> Prefix:
    """Time every task that does not depend on a collective's or a shared send's time.

    Compute runs ahead along each stream; a stream pauses at each send or collective, and the
    paused ones resume in the order of those tasks' starts (every task not yet timed starts
    no earlier than the earliest of them). So sends are issued in time order and the first
    that would crowd a capacity, or the first collective, is the cut: the pass stops there,
    leaving the rest to the event loop."""
    prefix = Prefix()
    receives: dict[tuple[int, str], int] = {}  # (rank, tag) -> the receive's index
    streams: list[_Stream] = []
    for rank in engine.ranks:
        program = engine.programs[engine.coords(rank)[1]]
        prefix.start[rank] = [_UNTIMED] * len(program.tasks)
        prefix.end[rank] = [_UNTIMED] * len(program.tasks)
        for task in program.tasks:
            if task.receives:
                assert task.comm is not None
                receives[(rank, task.comm.tag)] = task.index
        streams += [
            _Stream(rank, tasks, engine.kernel_factor(rank, stream))
            for stream, tasks in program.streams().items()
        ]
    waiting: dict[Key, list[_Stream]] = {}
    ready = deque(streams)
    paused: list[tuple[float, int, int, _Stream]] = []  # (start, rank, index of its comm)
    holdings = Holdings(engine.comms.topology.bandwidth_bytes_per_s)
    while True:
        while ready:
            stream = ready.popleft()
            for index in _advance(stream, prefix, waiting, paused):
                ready.extend(waiting.pop((stream.rank, index), ()))
        if not paused:  # all fixed-time: the event loop ends with the last task
            ends = [e for per_rank in prefix.end.values() for e in per_rank if e == e]
            prefix.cut_s = max(ends, default=0.0)
            return prefix
        start, _, _, stream = heapq.heappop(paused)
        task = stream.tasks[stream.pos]
        end = _send_end(engine, stream.rank, task, start, prefix)
        if end is None or holdings.crowds(prefix.sends[(stream.rank, task.index)]):
            prefix.cut_s = start  # the tasks from then on: the event loop's
            return prefix
        _timed(stream, task, start, end, prefix)
        ready.extend(waiting.pop((stream.rank, task.index), ()))
        found = _arrival(engine, (stream.rank, task.index), prefix, receives)
        if found is not None:
            ready.extend(waiting.pop(found, ()))
        ready.append(stream)


def _advance(
    stream: _Stream,
    prefix: Prefix,
    waiting: dict[Key, list[_Stream]],
    paused: list[tuple[float, int, int, _Stream]],
) -> Iterator[int]:
    """Time the stream's compute in order until a task waits for one not yet timed (the
    stream waits for it) or communicates (the stream pauses at its start); yields the index
    of each task timed."""
    rank, tasks, factor = stream.rank, stream.tasks, stream.factor
    ends = prefix.end[rank]
    while stream.pos < len(tasks):
        task = tasks[stream.pos]
        start = stream.free_s
        for dep in task.deps:
            end = ends[dep.index]
            if end != end:  # NaN: not timed yet
                waiting.setdefault((rank, dep.index), []).append(stream)
                return
            if end > start:
                start = end
        if task.comm is not None:
            heapq.heappush(paused, (start, rank, task.index, stream))
            return
        _timed(stream, task, start, start + task.duration_s * factor, prefix)
        yield task.index


def _timed(stream: _Stream, task: Task, start: float, end: float, prefix: Prefix) -> None:
    prefix.start[stream.rank][task.index], prefix.end[stream.rank][task.index] = start, end
    stream.free_s = end
    stream.pos += 1


def _send_end(engine: Engine, rank: int, task: Task, start: float, prefix: Prefix) -> float | None:
    """When a send started at `start` ends, if it can be timed alone (None for a collective or
    a send that cannot be), as the event loop computes it."""
    comm = task.comm
    assert comm is not None
    if comm.op is not CollectiveOp.SEND_RECV:
        return None
    key = (rank, comm.nbytes, comm.peer)
    if key not in prefix.send_terms:
        alone = engine.comms.lone_send(*engine.send_calls(rank, comm))
        terms = engine.comms.network.alone_terms(alone[0], alone[1], alone[4]) if alone else None
        timed = None
        if alone is not None and terms is not None and alone[2] > 0:
            timed = (terms, alone[2], alone[3])
        prefix.send_terms[key] = timed
    found = prefix.send_terms[key]
    if found is None:
        return None
    terms, nbytes, delay_s = found
    data_at = start + delay_s + terms.latency_s  # as `FlowNetwork.transfer_alone` adds them
    ends = data_at + nbytes / terms.rate
    prefix.sends[(rank, task.index)] = LoneSend(terms, nbytes, start, data_at, ends)
    return start + max(ends - start, 0.0)  # a timeout of what is left, as the network waits


def _arrival(
    engine: Engine, key: Key, prefix: Prefix, receives: dict[tuple[int, str], int]
) -> Key | None:
    """A timed send completes its receive: the receive ends when the data has arrived."""
    rank, index = key
    comm = engine.programs[engine.coords(rank)[1]].tasks[index].comm
    assert comm is not None
    peer = engine.peer(rank, comm.peer)
    found = receives.get((peer, comm.tag))
    if found is None:
        return None
    prefix.sent_at[(peer, found)] = prefix.start[rank][index]
    prefix.start[peer][found] = prefix.start[rank][index]
    prefix.end[peer][found] = prefix.end[rank][index]
    return peer, found


class Holdings:
    """The sends holding each capacity, fed in the order they are issued: the first send
    issued onto a capacity that the sends holding it would then overfill crowds it. Until then
    every send moves at its lone rate even where sends share a capacity (the rates fit, so
    each keeps its own narrowest link: the max-min rates are the lone ones), and the event
    loop, which would make flows of them, gives the same times. A send holds its capacities
    from its issue to its last byte (at an instant, issues count before ends)."""

    def __init__(self, capacity: FloatArray) -> None:
        self.capacity = capacity
        # capacity -> [load of the sends holding it, heap of (their ends, their loads)]
        self.held: dict[int, list[Any]] = {}
        self._limits: dict[int, list[tuple[int, float, float]]] = {}  # by id of the terms

    def crowds(self, send: LoneSend) -> bool:
        """Whether `send` crowds a capacity; if not, it holds them from now on."""
        t, held = send.start, self.held
        terms = self._limits.get(id(send.terms))
        if terms is None:  # few kinds of send, many of each
            loads = zip(send.terms.resources, send.terms.loads, strict=True)
            fits = float(1 + _FIT)
            terms = [(r, x, float(self.capacity[r]) * fits) for r, x in loads]
            self._limits[id(send.terms)] = terms
        for resource, load, limit in terms:
            holding = held.get(resource)
            if holding is None:
                continue
            ends = holding[1]
            while ends and ends[0][0] < t:  # ended before now
                holding[0] -= heapq.heappop(ends)[1]
            if ends and holding[0] + load > limit:
                return True
        for resource, load, _ in terms:
            holding = held.setdefault(resource, [0.0, []])
            holding[0] += load
            heapq.heappush(holding[1], (send.ends, load))
        return False


def first_crowding(sends: Iterable[LoneSend], capacity: FloatArray) -> float:
    """The issue of the first send that crowds a capacity (`Holdings`), or infinity."""
    holdings = Holdings(capacity)
    for send in sorted(sends, key=lambda x: x.start):
        if holdings.crowds(send):
            return send.start
    return float("inf")
