"""Handing a step over from its fixed-time prefix (`zsim.step.prefix`) to the event loop.

The tasks the prefix ran are recorded and booked as the event loop would have done it (their
spans, fused passes, pipeline traffic and the network's booked bytes; repeated bookings summed
once per kind); those still running at the cut end in the event loop: compute after the time it
has left, a send as the lone transfer it was, so a flow that later comes onto its links finds it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any, Protocol

import simpy

from zsim.network.collective import CollectiveCall
from zsim.step import prefix as fixed
from zsim.step.prefix import Key, LoneSend, Prefix
from zsim.step.program import Part, Task
from zsim.step.spans import FusedPass
from zsim.step.traffic import Traffic


class Engine(fixed.Engine, Protocol):
    """What the hand-over writes to in the engine (`zsim.step.engine.Engine`)."""

    env: simpy.Environment
    passes: list[FusedPass]
    traffic: Traffic

    def pass_calls(
        self, rank: int, parts: tuple[Part, ...]
    ) -> list[tuple[CollectiveCall, int]]: ...
    def record(self, rank: int, task: Task, start: float, end: float) -> None: ...
    def book_send(self, rank: int, task: Task, times: int = 1) -> None: ...
    def arrival(self, rank: int, tag: str) -> simpy.Event: ...
    def finish(self, rank: int, task: Task) -> None: ...


def replay(engine: Engine, prefix: Prefix) -> dict[Key, simpy.Event]:
    """Record and book every task the prefix ran; the end events of those still running."""
    running: dict[Key, simpy.Event] = {}
    tally = _Tally()
    for rank in engine.ranks:
        _replay_rank(engine, prefix, rank, running, tally)
    for (rank, template), times in Counter(tally.passes).items():
        engine.traffic.book_pass(rank, tally.templates[template], engine.pass_calls, times)
    for kind, times in Counter(tally.sends).items():
        engine.book_send(kind[0], tally.kinds[kind], times)
    for (flow_set, nbytes), times in Counter(tally.alone).items():
        engine.comms.network.booked.book(flow_set, nbytes, times)
    return running


@dataclass
class _Tally:
    """What the prefix's tasks book, one entry per task, counted by kind once at the end."""

    passes: list[tuple[int, int]] = field(default_factory=list)  # (rank, id of its parts)
    templates: dict[int, tuple[Part, ...]] = field(default_factory=dict)
    sends: list[tuple[int, float, int, str]] = field(default_factory=list)
    kinds: dict[tuple[int, float, int, str], Task] = field(default_factory=dict)
    alone: list[tuple[int, float]] = field(default_factory=list)  # (flow set, bytes) arrived


def _replay_rank(
    engine: Engine, prefix: Prefix, rank: int, running: dict[Key, simpy.Event], tally: _Tally
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
            tally.passes.append((rank, id(task.parts)))
            tally.templates[id(task.parts)] = task.parts
            passes.append(_fused(rank, task, start))
        elif task.receives:
            if finished:
                record(rank, task, prefix.sent_at[(rank, index)], end)
            continue
        elif task.comm is not None:
            send = prefix.sends[(rank, index)]
            kind = (rank, task.comm.nbytes, task.comm.peer, str(task.category))
            tally.sends.append(kind)
            tally.kinds[kind] = task
            if not finished:
                running[(rank, index)] = continue_send(engine, rank, task, send)
                continue
            tally.alone += [(flow_set, send.nbytes) for flow_set in send.terms.flow_sets]
        if not finished:
            running[(rank, index)] = engine.env.timeout(end - engine.env.now)
        elif not task.parts:
            record(rank, task, start, end)


def _fused(rank: int, task: Task, start: float) -> FusedPass:
    return FusedPass(
        rank, task.name, str(task.category), task.stream, start, start + task.duration_s, task.parts
    )


def continue_send(engine: Engine, rank: int, task: Task, send: LoneSend) -> simpy.Event:
    """A send in flight at the cut: on the network again as the lone transfer it was."""
    assert task.comm is not None
    event = engine.env.event()
    engine.comms.network.resume_alone(send.terms, send.nbytes, send.data_at, send.ends, event)
    arrival = engine.arrival(engine.peer(rank, task.comm.peer), task.comm.tag)
    event.callbacks.append(lambda _: _arrived(arrival, send.start))
    return event


def _arrived(arrival: simpy.Event, sent_at: float) -> None:
    arrival.succeed(sent_at)  # the receiver learns when the data left


def resume(
    engine: Engine, rank: int, task: Task, start: float, end: simpy.Event
) -> Generator[simpy.Event, Any, None]:
    """The end of a task that was running at the cut."""
    yield end
    if not task.parts:
        engine.record(rank, task, start, engine.env.now)
    engine.finish(rank, task)
