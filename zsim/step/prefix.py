"""The fixed-time prefix of a step, timed as a longest path through its task graph.

Until the first collective starts (or two sends would meet on a capacity), every task of a step
takes a time known in advance: compute and fused passes their durations, a pipeline send alone
on its links its call latency, its route's latency and its bytes at the lone rate
(`zsim.network.alone`). The event loop would then start each task when its stream is free and
its dependencies are done, which is the longest path through the same DAG: this pass computes
those times directly, with no simpy event per task. The engine simulates only what starts from
the cut on (the earliest start of a task that is not fixed-time, or of a send that would share
a capacity with one still moving), taking over the sends still in flight, so the answer is the
event loop's. A pipeline's warm-up and steady state are all prefix; its cool-down, gradient
reductions and optimizer step are simulated.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt

from zsim.cluster.build import FloatArray
from zsim.network.alone import AloneTerms
from zsim.network.collective import CollectiveCall, CollectiveOp
from zsim.network.communicator import Communicator
from zsim.step.program import Comm, Program, Stream, Task

Key = tuple[int, int]  # (rank, task index)
_FIT = 1e-9  # relative: sends filling a capacity to within this still fit


class Engine(Protocol):
    """What the prefix reads of the engine (`zsim.step.engine.Engine`)."""

    programs: Sequence[Program]
    ranks: tuple[int, ...]
    comms: Communicator

    def coords(self, rank: int) -> tuple[int, int, int]: ...
    def peer(self, rank: int, offset: int) -> int: ...
    def kernel_factor(self, rank: int, task: Task) -> float: ...
    def send_calls(self, rank: int, comm: Comm) -> tuple[CollectiveCall, list[CollectiveCall]]: ...


@dataclass
class LoneSend:
    """A send of the prefix, timed alone: issued at `start`, its data from `data_at`, its last
    byte at `ends` (the capacities are held from issue to end, as `LoneTransfers` holds them)."""

    terms: AloneTerms
    nbytes: float
    start: float
    data_at: float
    ends: float


@dataclass
class _Stream:
    rank: int
    tasks: list[Task]
    pos: int = 0
    free_s: float = 0.0


@dataclass
class Prefix:
    """Task times up to the cut: `start` and `end` of every task the pass could time (those
    from the cut on are simulated again), the sends among them, and the receives' send times."""

    cut_s: float = 0.0
    start: dict[Key, float] = field(default_factory=dict)
    end: dict[Key, float] = field(default_factory=dict)
    sends: dict[Key, LoneSend] = field(default_factory=dict)
    sent_at: dict[Key, float] = field(default_factory=dict)  # receive -> its send's issue
    # (rank, bytes, peer) -> how such a send is timed alone (None: it cannot be)
    send_terms: dict[tuple[int, float, int], tuple[AloneTerms, float, float] | None] = field(
        default_factory=dict
    )

    ran: frozenset[Key] = frozenset()  # the tasks that started before the cut: the prefix's
    finished: frozenset[Key] = frozenset()  # those of them that ended before it

    def cut(self, cut_s: float) -> None:
        """Keep the times up to `cut_s`: the tasks from then on are the event loop's."""
        self.cut_s = cut_s
        self.ran = frozenset(k for k, start in self.start.items() if start < cut_s)
        self.finished = frozenset(k for k in self.ran if self.end[k] < cut_s)


def time_prefix(engine: Engine) -> Prefix:
    """Time every task that does not depend on a collective's or a shared send's time."""
    prefix = Prefix()
    receives: dict[tuple[int, str], Key] = {}
    streams: list[_Stream] = []
    for rank in engine.ranks:
        by_stream: dict[Stream, list[Task]] = {}
        for task in engine.programs[engine.coords(rank)[1]].tasks:
            if task.receives:
                assert task.comm is not None
                receives[(rank, task.comm.tag)] = (rank, task.index)
            else:
                by_stream.setdefault(task.stream, []).append(task)
        streams += [_Stream(rank, tasks) for tasks in by_stream.values()]
    waiting: dict[Key, list[_Stream]] = {}
    ready = deque(streams)
    starts_left: list[float] = []  # when the first task that is not fixed-time would start
    while ready:
        stream = ready.popleft()
        for task in _advance(engine, stream, prefix, waiting, starts_left):
            key = (stream.rank, task.index)
            ready.extend(waiting.pop(key, ()))
            found = _arrival(engine, key, task, prefix, receives)
            if found is not None:
                ready.extend(waiting.pop(found, ()))
    last = max(prefix.end.values(), default=0.0)  # all fixed-time: the event loop ends there
    crowded = _first_crowding(prefix.sends.values(), engine.comms.topology.bandwidth_bytes_per_s)
    prefix.cut(min([*starts_left, crowded, last]))
    return prefix


def _advance(
    engine: Engine,
    stream: _Stream,
    prefix: Prefix,
    waiting: dict[Key, list[_Stream]],
    starts_left: list[float],
) -> Iterator[Task]:
    """Time the stream's tasks in order until one waits for a task not yet timed (the stream
    waits for it) or is not fixed-time (the stream stops); yields each task timed."""
    rank = stream.rank
    while stream.pos < len(stream.tasks):
        task = stream.tasks[stream.pos]
        start = stream.free_s
        for dep in task.deps:
            end = prefix.end.get((rank, dep.index))
            if end is None:
                waiting.setdefault((rank, dep.index), []).append(stream)
                return
            start = max(start, end)
        end = _fixed_end(engine, rank, task, start, prefix)
        if end is None:
            starts_left.append(start)
            stream.pos = len(stream.tasks)
            return
        key = (rank, task.index)
        prefix.start[key], prefix.end[key] = start, end
        stream.free_s = end
        stream.pos += 1
        yield task


def _fixed_end(engine: Engine, rank: int, task: Task, start: float, prefix: Prefix) -> float | None:
    """When a task started at `start` ends, if its time is fixed; None for a collective or a
    send that cannot be timed alone. Each end is computed as the event loop computes it."""
    comm = task.comm
    if comm is None:
        return start + task.duration_s * engine.kernel_factor(rank, task)
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
    engine: Engine, key: Key, task: Task, prefix: Prefix, receives: dict[tuple[int, str], Key]
) -> Key | None:
    """A timed send completes its receive: the receive ends when the data has arrived."""
    if key not in prefix.sends:
        return None
    assert task.comm is not None
    found = receives.get((engine.peer(key[0], task.comm.peer), task.comm.tag))
    if found is None:
        return None
    prefix.sent_at[found] = prefix.start[key]
    prefix.start[found], prefix.end[found] = prefix.start[key], prefix.end[key]
    return found


def _first_crowding(sends: Iterable[LoneSend], capacity: FloatArray) -> float:
    """The first moment a send is issued onto a capacity that the sends holding it would then
    overfill. Until then every send moves at its lone rate even where sends share a capacity
    (the rates fit, so each keeps its own narrowest link: the max-min rates are the lone
    ones), and the event loop, which would make flows of them, gives the same times."""
    table = _holdings(sends)  # (capacity, issued, ended, load), by capacity and issue
    if len(table) < 2:
        return float("inf")
    # capacities some send reaches while another holds it (up to the first such meeting a
    # capacity's sends are disjoint: comparing each with the one before finds it)
    meets = (table[1:, 0] == table[:-1, 0]) & (table[1:, 1] <= table[:-1, 2])
    shared = table[np.isin(table[:, 0], table[1:, 0][meets])]
    if not len(shared):
        return float("inf")
    # (capacity, time, 0 issued / 1 ended, load change)
    issued = np.column_stack((shared[:, [0, 1]], np.zeros(len(shared)), shared[:, 3]))
    ended = np.column_stack((shared[:, [0, 2]], np.ones(len(shared)), -shared[:, 3]))
    changes = np.concatenate((issued, ended))
    changes = changes[np.lexsort((changes[:, 2], changes[:, 1], changes[:, 0]))]
    total = np.cumsum(changes[:, 3])
    first = np.flatnonzero(np.r_[True, changes[1:, 0] != changes[:-1, 0]])
    before = np.repeat(total[first] - changes[first, 3], np.diff(np.r_[first, len(changes)]))
    over = total - before > capacity[changes[:, 0].astype(np.int64)] * (1 + _FIT)
    return float(changes[over, 1].min()) if over.any() else float("inf")


def _holdings(sends: Iterable[LoneSend]) -> npt.NDArray[np.float64]:
    """A row per send and capacity it holds: (capacity, issued, ended, its load there)."""
    by_terms: dict[int, tuple[AloneTerms, list[tuple[float, float]]]] = {}
    for send in sends:  # few kinds of send, many of each
        by_terms.setdefault(id(send.terms), (send.terms, []))[1].append((send.start, send.ends))
    parts = [np.zeros((0, 4))]
    for terms, times in by_terms.values():
        k, spans = len(terms.resources), np.asarray(times)
        parts.append(
            np.column_stack(
                (
                    np.tile(np.asarray(terms.resources, dtype=np.float64), len(spans)),
                    np.repeat(spans, k, axis=0),
                    np.tile(np.asarray(terms.loads), len(spans)),
                )
            )
        )
    table = np.concatenate(parts)
    return table[np.lexsort((table[:, 1], table[:, 0]))]
