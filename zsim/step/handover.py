"""Handing a step over from its prefix (`zsim.step.prefix`) to the event loop.

The tasks the prefix ran are recorded per rank as columns (`TaskBlock`: the spans and fused
passes the event loop would have recorded, made into them only when asked); their passes'
and sends' traffic tallied by kind, booked once with the event loop's at the end. Those still
running at the cut end in the event loop: compute after the time it has left, a send when
its transfer, already on the engine's network, arrives.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import simpy

from zsim.cluster.build import IntArray
from zsim.network.collective import CollectiveCall
from zsim.step import prefix as fixed
from zsim.step.prefix import Key, Prefix
from zsim.step.program import Part, Task
from zsim.step.spans import TaskBlock
from zsim.step.traffic import Traffic


class Engine(fixed.Engine, Protocol):
    """What the hand-over writes to in the engine (`zsim.step.engine.Engine`)."""

    env: simpy.Environment
    blocks: list[TaskBlock]
    traffic: Traffic
    tally: Tally

    def pass_calls(
        self, rank: int, parts: tuple[Part, ...]
    ) -> list[tuple[CollectiveCall, int]]: ...
    def record(self, rank: int, task: Task, start: float, end: float) -> None: ...
    def book_send(self, rank: int, task: Task, times: int = 1) -> None: ...
    def deliver(self, rank: int, tag: str, sent_at: float) -> None: ...
    def finish(self, rank: int, task: Task) -> None: ...
    def run_compute(
        self, rank: int, sm_share: float, seconds: float
    ) -> Generator[simpy.Event, Any, None]: ...


def replay(engine: Engine, prefix: Prefix) -> dict[Key, simpy.Event]:
    """Record every task the prefix ran, tallying what it books; the end events of those
    still running."""
    running: dict[Key, simpy.Event] = {}
    for rank in engine.ranks:
        block = _replay_rank(engine, prefix, rank, running)
        if block is not None:
            engine.blocks.append(block)
    return running


@dataclass
class Tally:
    """What a step's fused passes and sends book, counted by kind and booked once at the end
    (`book`): a pipeline repeats a few kinds thousands of times."""

    passes: dict[tuple[int, int], int] = field(default_factory=dict)  # (rank, id of parts)
    templates: dict[int, tuple[Part, ...]] = field(default_factory=dict)
    sends: dict[tuple[int, float, int, str], int] = field(default_factory=dict)
    kinds: dict[tuple[int, float, int, str], Task] = field(default_factory=dict)

    def add_pass(self, rank: int, parts: tuple[Part, ...], times: int = 1) -> None:
        key = (rank, id(parts))
        self.passes[key] = self.passes.get(key, 0) + times
        self.templates[id(parts)] = parts

    def add_send(self, rank: int, task: Task, times: int = 1) -> None:
        assert task.comm is not None
        kind = (rank, task.comm.nbytes, task.comm.peer, str(task.category))
        self.sends[kind] = self.sends.get(kind, 0) + times
        self.kinds.setdefault(kind, task)

    def book(self, engine: Engine) -> None:
        """Book every entry: the passes' collectives and the sends to the engine's traffic."""
        for (rank, template), times in self.passes.items():
            engine.traffic.book_pass(rank, self.templates[template], engine.pass_calls, times)
        for kind, times in self.sends.items():
            engine.book_send(kind[0], self.kinds[kind], times)
        self.passes, self.sends = {}, {}


def _replay_rank(
    engine: Engine, prefix: Prefix, rank: int, running: dict[Key, simpy.Event]
) -> TaskBlock | None:
    ran = np.asarray(prefix.ran_indices(rank), dtype=np.int64)
    if not ran.size:
        return None
    program = engine.programs[engine.coords(rank)[1]]
    columns, tasks = program.columns(), program.tasks
    # a receive starts when its send did (`Prefix`): waiting for the sender is idle time
    starts, ends = np.asarray(prefix.start[rank]), np.asarray(prefix.end[rank])
    finished = ends[ran] < prefix.cut_s
    fused = columns.kind[ran] >= 0
    passes, spans = ran[fused], ran[~fused & finished]
    for kind, times in _in_order(columns.kind[passes]):
        engine.tally.add_pass(rank, columns.kinds[kind], times)
    sends = columns.sends
    for kind, times in _in_order(columns.send_kind[ran[sends[ran]]]):
        engine.tally.add_send(rank, columns.send_kinds[kind], times)
    for index in ran[~finished].tolist():  # running at the cut
        task = tasks[index]
        if sends[index]:
            running[(rank, index)] = in_flight(engine, rank, task, prefix)
        elif not task.receives:  # a receive still waiting is the event loop's (`receive`)
            left = ends[index] - engine.env.now  # re-timed if collectives take SMs from now
            running[(rank, index)] = engine.env.process(
                engine.run_compute(rank, task.sm_share, left)
            )
    return TaskBlock(
        rank, tasks, columns, spans, starts[spans], ends[spans], passes, starts[passes]
    )


def _in_order(kinds: IntArray) -> list[tuple[int, int]]:
    """Each distinct kind and how often it occurs, in the order each first occurs."""
    found, first, counts = np.unique(kinds, return_index=True, return_counts=True)
    order = np.argsort(first)
    return list(zip(found[order].tolist(), counts[order].tolist(), strict=True))


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
