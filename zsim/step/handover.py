"""Handing a step over from its prefix (`zsim.step.prefix`) to the event loop.

The tasks the prefix ran are recorded as the event loop would have done it (their spans and
fused passes; their pipeline traffic tallied, booked once per kind with the event loop's at
the end); those still running at the cut end in the event loop: compute after the time it
has left, a send when its transfer, already on the engine's network, arrives.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any, Protocol

import simpy

from zsim.network.collective import CollectiveCall
from zsim.step import prefix as fixed
from zsim.step.prefix import Key, Prefix
from zsim.step.program import Part, Task
from zsim.step.spans import FusedPass
from zsim.step.traffic import Traffic


class Engine(fixed.Engine, Protocol):
    """What the hand-over writes to in the engine (`zsim.step.engine.Engine`)."""

    env: simpy.Environment
    passes: list[FusedPass]
    traffic: Traffic
    tally: Tally

    def pass_calls(
        self, rank: int, parts: tuple[Part, ...]
    ) -> list[tuple[CollectiveCall, int]]: ...
    def record(self, rank: int, task: Task, start: float, end: float) -> None: ...
    def book_send(self, rank: int, task: Task, times: int = 1) -> None: ...
    def deliver(self, rank: int, tag: str, sent_at: float) -> None: ...
    def finish(self, rank: int, task: Task) -> None: ...


def replay(engine: Engine, prefix: Prefix) -> dict[Key, simpy.Event]:
    """Record every task the prefix ran, tallying what it books; the end events of those
    still running."""
    running: dict[Key, simpy.Event] = {}
    for rank in engine.ranks:
        _replay_rank(engine, prefix, rank, running, engine.tally)
    return running


@dataclass
class Tally:
    """What a step's fused passes and sends book, one entry per task, counted by kind and
    booked once at the end (`book`): a pipeline repeats a few kinds thousands of times."""

    passes: list[tuple[int, int]] = field(default_factory=list)  # (rank, id of its parts)
    templates: dict[int, tuple[Part, ...]] = field(default_factory=dict)
    sends: list[tuple[int, float, int, str]] = field(default_factory=list)
    kinds: dict[tuple[int, float, int, str], Task] = field(default_factory=dict)

    def add_pass(self, rank: int, parts: tuple[Part, ...]) -> None:
        self.passes.append((rank, id(parts)))
        self.templates[id(parts)] = parts

    def add_send(self, rank: int, task: Task) -> None:
        assert task.comm is not None
        kind = (rank, task.comm.nbytes, task.comm.peer, str(task.category))
        self.sends.append(kind)
        self.kinds[kind] = task

    def book(self, engine: Engine) -> None:
        """Book every entry: the passes' collectives and the sends to the engine's traffic."""
        for (rank, template), times in Counter(self.passes).items():
            engine.traffic.book_pass(rank, self.templates[template], engine.pass_calls, times)
        for kind, times in Counter(self.sends).items():
            engine.book_send(kind[0], self.kinds[kind], times)
        self.passes, self.sends = [], []


def _replay_rank(
    engine: Engine, prefix: Prefix, rank: int, running: dict[Key, simpy.Event], tally: Tally
) -> None:
    ran = prefix.ran_indices(rank)
    if not ran:
        return
    tasks = engine.programs[engine.coords(rank)[1]].tasks
    starts, ends, cut = prefix.start[rank], prefix.end[rank], prefix.cut_s
    passes, record = engine.passes, engine.record
    for index in ran:
        task, start, end = tasks[index], starts[index], ends[index]
        finished = end < cut
        if task.parts:
            tally.add_pass(rank, task.parts)
            passes.append(_fused(rank, task, start))
        elif task.receives:
            if finished:
                record(rank, task, prefix.sent_at[(rank, index)], end)
            continue
        elif task.comm is not None:
            tally.add_send(rank, task)
            if not finished:
                running[(rank, index)] = in_flight(engine, rank, task, prefix)
                continue
        if not finished:
            running[(rank, index)] = engine.env.timeout(end - engine.env.now)
        elif not task.parts:
            record(rank, task, start, end)


def _fused(rank: int, task: Task, start: float) -> FusedPass:
    return FusedPass(
        rank, task.name, str(task.category), task.stream, start, start + task.duration_s, task.parts
    )


def in_flight(engine: Engine, rank: int, task: Task, prefix: Prefix) -> simpy.Event:
    """A send still moving at the cut: its transfer goes on; its receive ends when it arrives
    (one that arrived at the cut itself, the end of a step without collectives, ends now)."""
    assert task.comm is not None
    transfer = prefix.arrivals.get((rank, task.index))
    if transfer is None:  # it arrived at the cut itself: it ends now
        transfer = engine.env.timeout(prefix.end[rank][task.index] - engine.env.now)
    peer, tag = engine.peer(rank, task.comm.peer), task.comm.tag
    sent_at = prefix.start[rank][task.index]
    transfer.callbacks.append(lambda _: engine.deliver(peer, tag, sent_at))
    return transfer


def resume(
    engine: Engine, rank: int, task: Task, start: float, end: simpy.Event
) -> Generator[simpy.Event, Any, None]:
    """The end of a task that was running at the cut."""
    yield end
    if not task.parts:
        engine.record(rank, task, start, engine.env.now)
    engine.finish(rank, task)
