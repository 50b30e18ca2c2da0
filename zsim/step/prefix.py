"""The prefix of a step up to its first collective, timed without a process per task.

Until the first collective starts, a step's compute takes times known in advance (its tasks'
durations) and only its sends depend on the network. The event loop would start each task
when its stream is free and its dependencies are done: a longest path through the task graph.
This pass computes it directly, with no simpy process or event per task: each stream's
compute runs ahead until it waits for a task not yet timed or reaches a send or a collective,
where it pauses; the paused ones resume in the order of those tasks' starts (every task not
yet timed starts no earlier than the earliest of them), and the sends are issued on the
engine's own network (`Communicator.send`) at their starts, between its events, in time order.
So sends that share a capacity share it as the event loop would share it: the same network,
the same calls at the same times. The pass stops at the first collective (the cut); the
engine simulates what starts from then on, with the sends still in flight where they are.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import simpy

from zsim.network.collective import CollectiveCall, CollectiveOp
from zsim.network.communicator import Communicator
from zsim.step.program import Comm, Program, Stream, Task

Key = tuple[int, int]  # (rank, task index)
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
class _Stream:
    rank: int
    tasks: list[Task]
    factor: float  # the rank's slowdown of this stream's kernels
    starts: list[float]  # the rank's task starts and ends, by task index (the prefix's)
    ends: list[float]
    pos: int = 0
    free_s: float = 0.0


@dataclass
class Prefix:
    """Task times up to the cut: the `start` and `end` of every task of each rank, by task
    index (NaN where the pass did not time it; those from the cut on are simulated again; a
    receive starts when its send did), and the arrivals of the sends still moving at the
    cut."""

    cut_s: float = 0.0
    start: dict[int, list[float]] = field(default_factory=dict)  # rank -> by task index
    end: dict[int, list[float]] = field(default_factory=dict)
    arrivals: dict[Key, simpy.Event] = field(default_factory=dict)  # a send moving at the cut

    def ran(self, rank: int, index: int) -> bool:
        """Whether the pass started the task by the cut: it is the prefix's (a send issued at
        the cut's instant is on the network already; a stream's timed tasks come first)."""
        starts = self.start.get(rank)
        return starts is not None and starts[index] <= self.cut_s  # NaN: False

    def finished_mask(self, rank: int, tasks: int) -> list[bool]:
        """By task index, whether each of the rank's `tasks` ended before the cut."""
        ends = self.end.get(rank)
        if ends is None:
            return [False] * tasks
        ended: list[bool] = (np.asarray(ends) < self.cut_s).tolist()
        return ended

    def ran_indices(self, rank: int) -> list[int]:
        """The rank's tasks that are the prefix's (`ran`), in index order."""
        starts = self.start.get(rank)
        if starts is None:
            return []
        return np.flatnonzero(np.asarray(starts) <= self.cut_s).tolist()


def time_prefix(engine: Engine) -> Prefix:
    """Time every task that starts before the step's first collective."""
    prefix = Prefix()
    receives: dict[tuple[int, str], int] = {}  # (rank, tag) -> the receive's index
    timing = _Pass(engine, prefix, receives)
    for rank in engine.ranks:
        program = engine.programs[engine.coords(rank)[1]]
        starts = prefix.start[rank] = [_UNTIMED] * len(program.tasks)
        ends = prefix.end[rank] = [_UNTIMED] * len(program.tasks)
        for task in program.tasks:
            if task.receives:
                assert task.comm is not None
                receives[(rank, task.comm.tag)] = task.index
        timing.ready += [
            _Stream(rank, tasks, engine.kernel_factor(rank, stream), starts, ends)
            for stream, tasks in program.streams().items()
        ]
    prefix.cut_s = timing.until_cut()
    return prefix


class _Pass:
    """The pass's state: streams ready to advance, those waiting for a task, those paused at a
    send or a collective (by its start), and the network's clock."""

    def __init__(self, engine: Engine, prefix: Prefix, receives: dict[tuple[int, str], int]):
        self.engine, self.prefix, self.receives = engine, prefix, receives
        self.env = engine.comms.env
        self.ready: deque[_Stream] = deque()
        self.waiting: dict[Key, list[_Stream]] = {}
        self.paused: list[tuple[float, int, int, _Stream]] = []  # (start, rank, index, stream)
        self.moving: set[Key] = set()  # sends issued, not yet arrived
        self.open = True  # once cut, the sends' arrivals are the event loop's

    def until_cut(self) -> float:
        """Advance everything up to the first collective; its start (the cut), or the end of
        the last task when there is none."""
        env, ready, paused, advance = self.env, self.ready, self.paused, self._advance
        peek, step = env.peek, env.step
        while True:
            while ready:
                advance(ready.popleft())
            issue_at = paused[0][0] if paused else math.inf
            if peek() < issue_at:  # the network's events before the next issue
                step()
                continue
            if not paused:  # every task timed (the network may have run on past the last)
                ends = [e for per_rank in self.prefix.end.values() for e in per_rank if e == e]
                return self._close(max([*ends, env.now]))
            start, _, _, stream = heapq.heappop(paused)
            task = stream.tasks[stream.pos]
            assert task.comm is not None
            if task.comm.op is not CollectiveOp.SEND_RECV:
                return self._close(start)
            assert start >= env.now  # what is timed later starts no earlier (see the module)
            if start > env.now:
                env._now = start  # nothing is due before: simpy's clock moves as run() would
            self._issue(stream, task, task.comm, start)

    def _advance(self, stream: _Stream) -> None:
        """Time the stream's compute in order until a task waits for one not yet timed (the
        stream waits for it) or communicates (the stream pauses at its start)."""
        rank, tasks, factor = stream.rank, stream.tasks, stream.factor
        starts, ends = stream.starts, stream.ends
        while stream.pos < len(tasks):
            task = tasks[stream.pos]
            start = stream.free_s
            for dep in task.deps:
                end = ends[dep.index]
                if end != end:  # NaN: not timed yet
                    self.waiting.setdefault((rank, dep.index), []).append(stream)
                    return
                if end > start:
                    start = end
            if task.comm is not None:
                heapq.heappush(self.paused, (start, rank, task.index, stream))
                return
            starts[task.index] = start
            ends[task.index] = stream.free_s = start + task.duration_s * factor
            stream.pos += 1
            self.ready.extend(self.waiting.pop((rank, task.index), ()))

    def _issue(self, stream: _Stream, task: Task, comm: Comm, start: float) -> None:
        """The send, on the network now, as the engine sends it; it ends when it arrives."""
        rank = stream.rank
        transfer = self.engine.comms.send(*self.engine.send_calls(rank, comm))
        stream.starts[task.index] = start
        self.moving.add((rank, task.index))
        transfer.callbacks.append(lambda _event: self._arrived(stream, task, comm, start))

    def _close(self, cut_s: float) -> float:
        """The cut: the network's clock moves to it, exactly (every event before it has run;
        `env.run(until=...)` would add the difference and may land an ulp past it), and the
        sends still moving arrive in the event loop (each `arrivals` event fires when its data
        has arrived)."""
        assert self.env.now <= cut_s <= self.env.peek()
        self.env._now = cut_s
        self.open = False
        self.prefix.arrivals = {key: self.env.event() for key in self.moving}
        return cut_s

    def _arrived(self, stream: _Stream, task: Task, comm: Comm, start: float) -> None:
        """A send's data has arrived: the send ends, so does its receive, and the sender's
        stream goes on."""
        rank = stream.rank
        self.moving.discard((rank, task.index))
        if not self.open:
            self.prefix.arrivals[(rank, task.index)].succeed()
            return
        now = self.env.now
        stream.ends[task.index] = stream.free_s = now
        stream.pos += 1
        self.ready.append(stream)
        self.ready.extend(self.waiting.pop((rank, task.index), ()))
        peer = self.engine.peer(rank, comm.peer)
        found = self.receives.get((peer, comm.tag))
        if found is not None:
            self.prefix.start[peer][found], self.prefix.end[peer][found] = start, now
            self.ready.extend(self.waiting.pop((peer, found), ()))
