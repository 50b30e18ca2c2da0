"""Handing a step over from its fixed-time prefix (`zsim.step.prefix`) to the event loop.

The tasks the prefix ran are recorded and booked as the event loop would have done it (their
spans, fused passes, pipeline traffic and the network's booked bytes; repeated bookings summed
once per kind); those still running at the cut end in the event loop: compute after the time it
has left, a send as the lone transfer it was, so a flow that later comes onto its links finds it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Generator
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
    sends: Counter[tuple[int, float, int, str]] = Counter()  # sends of each kind: how many
    kinds: dict[tuple[int, float, int, str], Task] = {}
    passes: Counter[tuple[int, int]] = Counter()
    templates: dict[tuple[int, int], tuple[Part, ...]] = {}
    alone: Counter[tuple[int, float]] = Counter()
    cut = prefix.cut_s
    for rank in engine.ranks:
        tasks = engine.programs[engine.coords(rank)[1]].tasks
        starts, ends = prefix.start.get(rank, ()), prefix.end.get(rank, ())
        for index in prefix.ran_indices(rank):
            task, start, end = tasks[index], starts[index], ends[index]
            finished, key = end < cut, (rank, index)
            if task.receives:
                if finished:
                    engine.record(rank, task, prefix.sent_at[key], end)
                continue
            if task.parts:
                passes[(rank, id(task.parts))] += 1
                templates[(rank, id(task.parts))] = task.parts
                engine.passes.append(_fused(rank, task, start))
            elif task.comm is not None:
                send = prefix.sends[key]
                kind = (rank, task.comm.nbytes, task.comm.peer, str(task.category))
                sends[kind] += 1
                kinds[kind] = task
                if not finished:
                    running[key] = continue_send(engine, rank, task, send)
                    continue
                for flow_set in send.terms.flow_sets:
                    alone[(flow_set, send.nbytes)] += 1
            if finished and not task.parts:
                engine.record(rank, task, start, end)
            elif not finished:
                running[key] = engine.env.timeout(end - engine.env.now)
    for (rank, template), times in passes.items():
        engine.traffic.book_pass(rank, templates[(rank, template)], engine.pass_calls, times)
    for kind, times in sends.items():
        engine.book_send(kind[0], kinds[kind], times)
    for (flow_set, nbytes), times in alone.items():
        engine.comms.network.booked.book(flow_set, nbytes, times)
    return running


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
