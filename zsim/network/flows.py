"""A flow-level network on simpy: transfers share links max-min fair.

A transfer is a flow of bytes along its route. It first waits for the route's latency (the
sum of its links' latencies, paid once before any data moves), then streams. All flows in
their data phase share every link max-min fair (progressive filling: raise every unfrozen
flow's rate equally until a link fills, freeze the flows crossing it, repeat). Rates change
only when the set of flows changes, so they are recomputed then, and only then: flows that
start or end at the same simulated instant are settled in one recomputation (the settle step
defers itself while other events are still queued for that instant), and between changes
every rate is constant, so the next event is simply the earliest finish.

Flows are held in cohorts: flows of one phase that started together and have had the same
rate all along, so they hold the same bytes; a cohort is advanced, finished and booked as one
(a ring over 131,072 GPUs is one cohort, not 131,072 flows). The rates depend only on which
flows are active (their routes and the capacities), never on bytes, so they are solved once per
set of active cohorts (`zsim.network.rates`) and reused whenever that set recurs, as it does at
every layer of a step; a cohort whose flows get different rates splits into cohorts of equal
rates. This gives exactly the rates and times of solving every flow at every change.

Links are shared through their capacities: `topology.resource` maps an edge to the capacity it
draws on, the edge itself except for half-duplex pairs (a CPU rank's loopback TCP stack), whose
two directions fill one capacity together.

A phase may stand for `repeat` identical consecutive steps, as a ring's n-1 steps are: its
flows carry `repeat` x bytes and pay `repeat` x latency in one go. That equals the step-by-step
result exactly while the rates stay constant (no other flow starts or ends on a shared link
meanwhile, and the phase's own flows end together, as on a uniform network). When they do
not, the coalesced phase behaves like a pipelined ring with no barrier between steps, which is
what NCCL and gloo run.

Bytes of every finished flow are booked to its source and destination GPU and to each link it
crossed, so traffic reports come from the simulated flows themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import simpy
from simpy.events import EventPriority

from zsim.cluster.build import CLASSES, FloatArray
from zsim.cluster.fabric import LinkClass
from zsim.cluster.topology import Topology
from zsim.errors import require
from zsim.network.rates import FlowSets, max_min_rates

__all__ = ["Flow", "FlowNetwork", "max_min_rates"]

_LAST = EventPriority(2)  # after simpy's URGENT (0) and NORMAL (1): the end of an instant
_TIME_TOL_REL = 1e-9  # flows finishing within this relative time of each other end together
_TIME_TOL_ABS_S = 1e-15


class Flow(NamedTuple):
    """`nbytes` from GPU `src` to GPU `dst`."""

    src: int
    dst: int
    nbytes: float


@dataclass
class _Batch:
    """Flows started together; `event` fires when the last of them ends."""

    left: int
    event: simpy.Event


@dataclass
class _Cohort:
    """Flows of one flow set with the same bytes left and the same rate."""

    flow_set: int
    count: int
    total: float  # bytes each flow carries in all
    remaining: float
    rate: float
    batch: int


class FlowNetwork:
    """The links of one topology, shared by every flow started on it in one simpy run."""

    def __init__(self, env: simpy.Environment, topology: Topology) -> None:
        self.env = env
        self.topology = topology
        self.sets = FlowSets(topology)
        self._batches: dict[int, _Batch] = {}
        self._next_batch = 0
        self._cohorts: list[_Cohort] = []
        self._last_update = env.now
        self._version = 0
        self._settle_pending = False
        self._booked: list[tuple[int, float]] = []  # (flow set, bytes per flow) of ended flows
        self._freed: list[int] = []  # flow sets ended since rates were last solved
        self._class_bytes = np.zeros(len(CLASSES))
        self.recomputations = 0
        self.flows_finished = 0

    # ---- public ---------------------------------------------------------------------

    def transfer(self, src: int, dst: int, nbytes: float) -> simpy.Event:
        """One flow; the event fires when its last byte arrives."""
        return self.start([Flow(src, dst, nbytes)])

    def start(
        self, flows: Sequence[Flow], *, repeat: int = 1, latency_s: float | None = None
    ) -> simpy.Event:
        """Start these flows now (any sizes); see `start_arrays`."""
        sizes = sorted({f.nbytes for f in flows})
        groups = [
            (
                np.array([f.src for f in flows if f.nbytes == size], dtype=np.int64),
                np.array([f.dst for f in flows if f.nbytes == size], dtype=np.int64),
                size,
            )
            for size in sizes
        ]
        return self.start_arrays(groups, repeat=repeat, latency_s=latency_s)

    def start_arrays(
        self,
        groups: Sequence[tuple[np.ndarray, np.ndarray, float]],
        *,
        repeat: int = 1,
        latency_s: float | None = None,
    ) -> simpy.Event:
        """Start a phase now: flows src[i] -> dst[i] of `nbytes` each, for each (src, dst,
        nbytes) group; the event fires when all of them have ended.

        `repeat` coalesces that many identical consecutive steps (see the module doc).
        `latency_s`, when given, is the latency of one step for the whole phase, in place of
        each flow's route latency (a pipelined ring's mean hop, a chain's or tree's fill);
        the phase pays `repeat` x it before its data moves.
        """
        require(repeat >= 1, "repeat", repeat, "a positive number of steps")
        event = self.env.event()
        count = sum(len(src) for src, _, _ in groups)
        if not count:
            event.succeed()
            return event
        for _, _, nbytes in groups:
            require(nbytes >= 0, "flow bytes", float(nbytes), ">= 0")
        batch_id = self._next_batch
        self._next_batch += 1
        self._batches[batch_id] = _Batch(count, event)
        for src, dst, nbytes in groups:
            pattern = self.sets.pattern(src, dst)
            if latency_s is not None:
                entries = [(repeat * latency_s, pattern.moving_set, pattern.local_count)]
            else:
                entries = [(repeat * d, s, n) for d, s, n in pattern.by_latency]
            for delay, flow_set, local in entries:
                self._after(delay, self._adder(flow_set, local, nbytes * repeat, batch_id))
        return event

    def bytes_by_link_class(self) -> dict[LinkClass, float]:
        """Bytes carried so far, summed over the directed links of each class."""
        used = np.unique(self.topology.class_id)
        return {CLASSES[i]: float(self._class_bytes[i]) for i in used.tolist()}

    @property
    def sent_bytes(self) -> FloatArray:
        return self._per_gpu(source=True)

    @property
    def received_bytes(self) -> FloatArray:
        return self._per_gpu(source=False)

    @property
    def link_bytes(self) -> FloatArray:
        out = np.zeros(self.topology.edge_count)
        for flow_set, nbytes in self._booked:
            fs = self.sets.flow_set(flow_set)
            np.add.at(out, fs.pair_edge, nbytes)
        return out

    @property
    def active_flows(self) -> int:
        return sum(c.count for c in self._cohorts)

    def _per_gpu(self, source: bool) -> FloatArray:
        out = np.zeros(self.topology.world_size)
        for flow_set, nbytes in self._booked:
            fs = self.sets.flow_set(flow_set)
            np.add.at(out, fs.src if source else fs.dst, nbytes)
        return out

    # ---- adding and finishing flows -------------------------------------------------

    def _after(self, delay: float, action: Callable[[], None]) -> None:
        if delay <= 0:
            action()
            return
        self.env.timeout(delay).callbacks.append(lambda _event: action())

    def _adder(self, flow_set: int, local: int, nbytes: float, batch: int) -> Callable[[], None]:
        return lambda: self._add(flow_set, local, nbytes, batch)

    def _add(self, flow_set: int, local: int, nbytes: float, batch: int) -> None:
        """Flows whose latency has passed enter their data phase (at the next settle); local
        copies and empty messages cross no link: they end now."""
        self._advance()
        count = self.sets.flow_set(flow_set).count if flow_set >= 0 else 0
        if nbytes <= 0:
            local, count = local + count, 0
        if local:
            self._finish_batch(batch, local)
        if count:
            self._cohorts.append(_Cohort(flow_set, count, nbytes, nbytes, 0.0, batch))
            self._request_settle()

    def _finish_batch(self, batch_id: int, count: int) -> None:
        batch = self._batches[batch_id]
        batch.left -= count
        if batch.left == 0:
            del self._batches[batch_id]
            batch.event.succeed()

    def _advance(self) -> None:
        elapsed = self.env.now - self._last_update
        if elapsed > 0:
            for c in self._cohorts:
                c.remaining -= c.rate * elapsed
        self._last_update = self.env.now

    # ---- settling: one recomputation per instant ------------------------------------

    def _request_settle(self) -> None:
        if not self._settle_pending:
            self._settle_pending = True
            self._schedule_settle()

    def _schedule_settle(self) -> None:
        """The settle runs after every other event of this instant (simpy pops events of one
        time by priority): same-instant starts and ends join one recomputation."""
        event = self.env.event()
        event.callbacks.append(lambda _event: self._settle())
        event._ok, event._value = True, None  # succeed() at the lowest priority
        self.env.schedule(event, _LAST)

    def _settle(self) -> None:
        self._settle_pending = False
        self._advance()
        self._version += 1
        if self._finish_done():
            self._request_settle()  # waiters resume at this instant and may start flows
            return
        if not self._cohorts:
            return
        self.recomputations += 1
        self._rerate()
        wait = min(c.remaining / c.rate for c in self._cohorts)
        version = self._version
        self.env.timeout(max(wait, 0.0)).callbacks.append(lambda _e: self._wake(version))

    def _rerate(self) -> None:
        """New rates for the cohorts whose links changed: those just added, and every cohort
        connected to them or to the flows that just ended through shared capacities (a
        connected component is solved alone; the others keep their rates)."""
        seeds = [c for c in self._cohorts if c.rate == 0.0]
        freed, self._freed = self._freed, []
        seeds += [
            c
            for c in self._cohorts
            if c.rate > 0.0 and any(self.sets.overlap(c.flow_set, f) for f in freed)
        ]
        touched = self._component(seeds)
        kept = [c for c in self._cohorts if id(c) not in touched]
        self._cohorts = kept + self._rated([c for c in self._cohorts if id(c) in touched])

    def _component(self, seeds: list[_Cohort]) -> set[int]:
        """Ids of the cohorts connected to `seeds` through shared capacities."""
        reached = {id(c) for c in seeds}
        frontier = list(seeds)
        while frontier:
            cohort = frontier.pop()
            for other in self._cohorts:
                if id(other) not in reached and self.sets.overlap(cohort.flow_set, other.flow_set):
                    reached.add(id(other))
                    frontier.append(other)
        return reached

    def _rated(self, cohorts: list[_Cohort]) -> list[_Cohort]:
        """The cohorts with their max-min rates, split where their flows' rates differ."""
        if not cohorts:
            return []
        ordered = sorted(cohorts, key=lambda c: c.flow_set)
        solved = self.sets.rates(tuple(c.flow_set for c in ordered))
        out = []
        for cohort, parts in zip(ordered, solved, strict=True):
            for flow_set, rate in parts:
                count = self.sets.flow_set(flow_set).count
                out.append(
                    _Cohort(flow_set, count, cohort.total, cohort.remaining, rate, cohort.batch)
                )
        return out

    def _wake(self, version: int) -> None:
        if version == self._version:
            self._request_settle()

    def _finish_done(self) -> bool:
        """End the flows with nothing left to send; True if there were any."""
        if not self._cohorts:
            return False
        tolerance_s = _TIME_TOL_ABS_S + _TIME_TOL_REL * self.env.now
        done = [c for c in self._cohorts if c.remaining <= c.rate * tolerance_s]
        if not done:
            return False
        self._cohorts = [c for c in self._cohorts if c.remaining > c.rate * tolerance_s]
        finished: dict[int, int] = {}
        for c in done:
            self._book(c)
            finished[c.batch] = finished.get(c.batch, 0) + c.count
        for batch_id in sorted(finished):
            self._finish_batch(batch_id, finished[batch_id])
        return True

    def _book(self, cohort: _Cohort) -> None:
        self._freed.append(cohort.flow_set)
        self.flows_finished += cohort.count
        self._booked.append((cohort.flow_set, cohort.total))
        self._class_bytes += cohort.total * self.sets.flow_set(cohort.flow_set).class_pairs
