"""A flow-level network on simpy: transfers share links max-min fair.

A transfer is a flow of bytes along its route: it waits for the route's latency (its links'
latencies, paid once), then streams. Flows in their data phase share every link max-min fair
(progressive filling). Rates change only when the set of flows changes, so they are recomputed
then, once per instant (the settle step runs after every other event of that instant), and
between changes every rate is constant: the next event is the earliest finish.

Flows are held in cohorts: flows of one phase that started together and have had the same
rate all along, so they hold the same bytes; a cohort is advanced, finished and booked as one
(a ring over 131,072 GPUs is one cohort, not 131,072 flows). The rates depend only on which
flows are active (their routes and the capacities), never on bytes, so they are solved once per
set of active cohorts (`zsim.network.rates`) and reused whenever that set recurs, as it does at
every layer of a step; a cohort whose flows get different rates splits into cohorts of equal
rates. This gives exactly the rates and times of solving every flow at every change.

Links are shared through their capacities (`topology.resource`: the edge itself, except that
a half-duplex pair's two directions, a CPU rank's loopback TCP stack, fill one together).

A phase may stand for `repeat` identical consecutive steps, as a ring's n-1 steps are: its
flows carry `repeat` x bytes and pay `repeat` x latency in one go. That equals the step-by-step
result exactly while the rates stay constant (no other flow starts or ends on a shared link
meanwhile, and the phase's own flows end together, as on a uniform network). When they do
not, the coalesced phase behaves like a pipelined ring with no barrier between steps, which is
what NCCL and gloo run. Every finished flow is booked (`zsim.network.booked`).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import simpy
from simpy.events import EventPriority

from zsim.cluster.build import IntArray
from zsim.cluster.fabric import LinkClass
from zsim.cluster.topology import Topology
from zsim.errors import require
from zsim.network.active import ActiveCohorts as _ActiveCohorts
from zsim.network.alone import AloneTerms, Lone, LoneTransfers, solve_alone
from zsim.network.booked import Booked
from zsim.network.rates import FlowSets, max_min_rates

__all__ = ["Flow", "FlowGroup", "FlowNetwork", "max_min_rates"]

Pairs = tuple[tuple[int, int], ...]  # (source, destination) GPUs
_LAST = EventPriority(2)  # after simpy's URGENT (0) and NORMAL (1): the end of an instant
_TIME_TOL_REL = 1e-9  # flows finishing within this relative time of each other end together
_TIME_TOL_ABS_S = 1e-15


class Flow(NamedTuple):
    """`nbytes` from GPU `src` to GPU `dst`."""

    src: int
    dst: int
    nbytes: float


class FlowGroup(NamedTuple):
    """Flows src[i] -> dst[i] of `nbytes` each, started together: `repeat` identical steps
    coalesced (see the module doc), paying `repeat` x `latency_s` (one step's latency for the
    whole group: a pipelined ring's mean hop, a chain's or tree's fill) or, when None, each
    flow its own route latency, before data moves. `waited`: whether the caller waits for
    these flows (the others only load the links)."""

    src: IntArray
    dst: IntArray
    nbytes: float
    repeat: int = 1
    latency_s: float | None = None
    waited: bool = True


@dataclass
class _Batch:
    """Flows started together; `event` (if any) fires when the last of them ends."""

    left: int
    event: simpy.Event | None


@dataclass
class _Cohort:
    """Flows of one flow set with the same bytes left and the same rate: `left_at` bytes each
    at time `since`, draining at `rate` (0 until first rated)."""

    flow_set: int
    count: int
    total: float  # bytes each flow carries in all
    left_at: float
    since: float
    rate: float
    batch: int

    def left(self, now: float) -> float:
        return self.left_at - self.rate * (now - self.since)

    @property
    def ends(self) -> float:
        return self.since + self.left_at / self.rate


class FlowNetwork:
    """The links of one topology, shared by every flow started on it in one simpy run."""

    def __init__(self, env: simpy.Environment, topology: Topology) -> None:
        self.env = env
        self.topology = topology
        self.sets = FlowSets(topology)
        self._batches: dict[int, _Batch] = {}
        self._next_batch = 0
        self._index: _ActiveCohorts[_Cohort] = _ActiveCohorts(self.sets)
        self._new: list[int] = []  # cohorts added since the last rating
        self._touched: set[int] = set()  # cohorts that shared a capacity with ended flows
        self._ends: list[tuple[float, int]] = []  # (end time, cohort) heap
        self._wake_at: float | None = None
        self._settle_pending = False
        self._lone = LoneTransfers()
        # (src, dst, id of the copies) -> (how it is timed alone, the copies, kept alive)
        self._alone_terms: dict[tuple[int, int, int], tuple[AloneTerms | None, Pairs]] = {}
        self.booked = Booked(topology, self.sets)
        self.recomputations = 0

    # ---- public ---------------------------------------------------------------------

    def transfer(self, src: int, dst: int, nbytes: float) -> simpy.Event:
        """One flow; the event fires when its last byte arrives."""
        return self.start([Flow(src, dst, nbytes)])

    def start(
        self, flows: Sequence[Flow], *, repeat: int = 1, latency_s: float | None = None
    ) -> simpy.Event:
        """Start these flows now (any sizes); see `launch`."""
        sizes = sorted({f.nbytes for f in flows})
        groups = [
            FlowGroup(
                np.array([f.src for f in flows if f.nbytes == size], dtype=np.int64),
                np.array([f.dst for f in flows if f.nbytes == size], dtype=np.int64),
                size,
                repeat,
                latency_s,
            )
            for size in sizes
        ]
        return self.launch(groups)

    def launch(self, groups: Sequence[FlowGroup]) -> simpy.Event:
        """Start groups of flows now; the event fires when every flow of the waited groups has
        ended (the others only load the links: the same call in symmetric ranks' groups)."""
        event = self.env.event()
        waited = [g for g in groups if g.waited]
        self._start(waited, event)
        for group in groups:
            if not group.waited:
                self._start([group], None)
        return event

    def alone_terms(self, src: int, dst: int, alongside: Pairs = ()) -> AloneTerms | None:
        """How a send src -> dst (with copies `alongside` that only load the links) is timed
        alone, memoised; None when it cannot be (`zsim.network.alone.solve_alone`)."""
        key = (src, dst, id(alongside))  # a pipeline repeats a send with the same copies
        found = self._alone_terms.get(key)
        if found is None or found[1] is not alongside:
            terms = solve_alone(self.sets, self._index, src, dst, alongside)
            found = self._alone_terms[key] = (terms, alongside)  # holding it keeps its id
        return found[0]

    def transfer_alone(
        self, src: int, dst: int, nbytes: float, delay_s: float, alongside: Pairs = ()
    ) -> simpy.Event:
        """One flow whose data starts after `delay_s` (the call's latency) plus its route's
        latency, timed alone while nothing shares its capacities (`zsim.network.alone`); the
        event fires when its last byte arrives. Wait on it (or add callbacks) at once: if
        another flow comes onto its links, the callbacks it has then move to its end as a
        flow. `alongside`: its copies, which only load the links (started as flows with it
        when it cannot be timed alone)."""
        env = self.env
        terms = self.alone_terms(src, dst, alongside)
        if (
            terms is None
            or nbytes <= 0
            or any(self._index.shares(f) for f in terms.flow_sets)
            or self._lone.holds_any(terms.resources)
        ):
            for other in self._lone.on(terms.resources if terms else ()):
                self._convert(other)  # two sends on one capacity: both are flows
            event = env.event()
            self._after(delay_s, lambda: self._start_flows(src, dst, nbytes, alongside, event))
            return event
        data_at = env.now + delay_s + terms.latency_s
        ends = data_at + nbytes / terms.rate
        arrival = env.timeout(max(ends - env.now, 0.0))  # the caller's callbacks follow ours
        lone = Lone(terms, nbytes, data_at, ends, arrival)
        arrival.callbacks.append(lambda _e: self._lone_ends(lone))
        self._lone.add(lone)
        return arrival

    def _start_flows(
        self, src: int, dst: int, nbytes: float, alongside: Pairs, event: simpy.Event
    ) -> None:
        copies = np.array(alongside, dtype=np.int64).reshape(-1, 2)
        self._start([FlowGroup(np.array([src]), np.array([dst]), nbytes)], event)
        self._start([FlowGroup(copies[:, 0], copies[:, 1], nbytes)], None)

    def _lone_ends(self, lone: Lone) -> None:
        if not lone.active:
            return  # converted: it ends as a flow
        self._lone.remove(lone)
        for flow_set in lone.terms.flow_sets:
            self.booked.book(flow_set, lone.nbytes)

    def _convert(self, lone: Lone) -> None:
        """A transfer timed alone joins the network as a flow, with the bytes it has left (its
        copies as flows nobody waits for); the callbacks its arrival had, but ours, move to
        the flow's end (its timeout fires at the old time with nothing left to do)."""
        self._lone.remove(lone)
        moved = self.env.event()
        moved.callbacks, lone.event.callbacks = lone.event.callbacks[1:], lone.event.callbacks[:1]
        for flow_set in lone.terms.flow_sets:
            self._rejoin(flow_set, lone, moved if flow_set == lone.terms.flow_set else None)

    def _rejoin(self, flow_set: int, lone: Lone, event: simpy.Event | None) -> None:
        now = self.env.now
        count = self.sets.flow_set(flow_set).count
        batch_id = self._next_batch
        self._next_batch += 1
        self._batches[batch_id] = _Batch(count, event)
        if now < lone.data_at:
            self._after(lone.data_at - now, self._adder(flow_set, 0, lone.nbytes, batch_id))
            return
        cohort = _Cohort(flow_set, count, lone.nbytes, lone.left(now), now, 0.0, batch_id)
        self._new.append(self._index.add(cohort))
        self._request_settle()

    def _start(self, groups: Sequence[FlowGroup], event: simpy.Event | None) -> None:
        count = sum(len(g.src) for g in groups)
        if not count:
            if event is not None:
                event.succeed()
            return
        batch_id = self._next_batch
        self._next_batch += 1
        self._batches[batch_id] = _Batch(count, event)
        for g in groups:
            require(g.repeat >= 1, "repeat", g.repeat, "a positive number of steps")
            require(g.nbytes >= 0, "flow bytes", float(g.nbytes), ">= 0")
            pattern = self.sets.pattern(g.src, g.dst)
            if g.latency_s is not None:
                entries = [(g.repeat * g.latency_s, pattern.moving_set, pattern.local_count)]
            else:
                entries = [(g.repeat * d, fs, n) for d, fs, n in pattern.by_latency]
            for delay, flow_set, local in entries:
                self._after(delay, self._adder(flow_set, local, g.nbytes * g.repeat, batch_id))

    def bytes_by_link_class(self) -> dict[LinkClass, float]:
        """Bytes carried so far, summed over the directed links of each class (`booked`)."""
        return self.booked.by_link_class()

    @property
    def flows_finished(self) -> int:
        return self.booked.flows

    @property
    def active_flows(self) -> int:
        return self._index.flows()

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
        count = self.sets.flow_set(flow_set).count if flow_set >= 0 else 0
        if nbytes <= 0:
            local, count = local + count, 0
        if local:
            self._finish_batch(batch, local)
        if count:
            for lone in self._lone_sharing(flow_set):
                self._convert(lone)  # a flow comes onto its capacities: it is a flow now
            cohort = _Cohort(flow_set, count, nbytes, nbytes, self.env.now, 0.0, batch)
            self._new.append(self._index.add(cohort))
            self._request_settle()

    def _lone_sharing(self, flow_set: int) -> list[Lone]:
        if not self._lone:
            return []
        resources = self._index.small_resources(flow_set)
        if resources is not None:
            return self._lone.on(resources)
        return [
            x
            for x in self._lone.all()
            if any(self.sets.overlap(flow_set, f) for f in x.terms.flow_sets)
        ]

    def _finish_batch(self, batch_id: int, count: int) -> None:
        batch = self._batches[batch_id]
        batch.left -= count
        if batch.left == 0:
            del self._batches[batch_id]
            if batch.event is not None:
                batch.event.succeed()

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
        if self._finish_done():
            self._request_settle()  # waiters resume at this instant and may start flows
            return
        if self._new or self._touched:
            self.recomputations += 1
            self._rerate()
        self._schedule_wake()

    def _rerate(self) -> None:
        """New rates for the cohorts whose links changed: those just added, and every cohort
        connected to them or to the flows that just ended through shared capacities (a
        connected component is solved alone; the others keep their rates)."""
        seeds = set(self._new) | (self._touched & self._index.ids())
        self._new, self._touched = [], set()
        component = self._index.component(seeds)
        if not component:
            return
        now = self.env.now
        cohorts = sorted((self._index.pop(i) for i in component), key=lambda c: c.flow_set)
        solved = self.sets.rates(tuple(c.flow_set for c in cohorts))
        for cohort, parts in zip(cohorts, solved, strict=True):
            left = cohort.left(now)
            for flow_set, rate in parts:
                count = self.sets.flow_set(flow_set).count
                part = _Cohort(flow_set, count, cohort.total, left, now, rate, cohort.batch)
                heapq.heappush(self._ends, (part.ends, self._index.add(part)))

    def _schedule_wake(self) -> None:
        """A wake-up at the earliest end, unless one is already due then."""
        while self._ends and self._ends[0][1] not in self._index.ids():
            heapq.heappop(self._ends)  # a cohort re-rated or ended since
        if not self._ends:
            return
        at = self._ends[0][0]
        if self._wake_at is not None and self._wake_at <= at:
            return
        self._wake_at = at
        delay = max(at - self.env.now, 0.0)
        self.env.timeout(delay).callbacks.append(lambda _e: self._wake(at))

    def _wake(self, at: float) -> None:
        if self._wake_at == at:
            self._wake_at = None
            self._request_settle()

    def _finish_done(self) -> bool:
        """End the flows with nothing left to send; True if there were any."""
        now = self.env.now
        tolerance_s = _TIME_TOL_ABS_S + _TIME_TOL_REL * now
        finished: dict[int, int] = {}
        while self._ends and self._ends[0][0] <= now + tolerance_s:
            _, key = heapq.heappop(self._ends)
            if key not in self._index.ids():
                continue  # re-rated since
            cohort = self._index.pop(key)
            self._touched |= self._index.neighbours(cohort.flow_set)
            self.booked.book(cohort.flow_set, cohort.total)
            finished[cohort.batch] = finished.get(cohort.batch, 0) + cohort.count
        for batch_id in sorted(finished):
            self._finish_batch(batch_id, finished[batch_id])
        return bool(finished)
