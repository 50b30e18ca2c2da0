"""A flow-level network on simpy: transfers share links max-min fair.

A transfer is a flow of bytes along its route. It first waits for the route's latency (the
sum of its links' latencies, paid once before any data moves), then streams. All flows in
their data phase share every link max-min fair (progressive filling: raise every unfrozen
flow's rate equally until a link fills, freeze the flows crossing it, repeat). Rates change
only when the set of flows changes, so they are recomputed then, and only then:

- flows that start or end at the same simulated instant are settled in one recomputation
  (the settle step defers itself while other events are still queued for that instant);
- between changes every rate is constant, so the next event is simply the earliest finish;
- the filling is vectorised over (flow, link) pairs with numpy.

Links are shared through their capacities: `topology.resource` maps an edge to the capacity it
draws on, the edge itself except for half-duplex pairs (a CPU rank's loopback TCP stack), whose
two directions fill one capacity together.

A phase (`start`) may stand for `repeat` identical consecutive steps, as a ring's n-1 steps
are: its flows carry `repeat` x bytes and pay `repeat` x latency in one go. That equals the
step-by-step result exactly while the rates stay constant (no other flow starts or ends on a
shared link meanwhile, and the phase's own flows end together, as on a uniform network).
When they do not, the coalesced phase behaves like a pipelined ring with no barrier between
steps, which is what NCCL and gloo run.

Bytes of every finished flow are booked to its source and destination GPU and to each link it
crossed, so traffic reports come from the simulated flows themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import numpy.typing as npt
import simpy

from zsim.cluster.build import FloatArray, IntArray
from zsim.cluster.fabric import LinkClass
from zsim.cluster.topology import Topology
from zsim.errors import require

BoolArray = npt.NDArray[np.bool_]

_DEFER_LIMIT = 64  # settle waits behind at most this many same-instant event batches
_TIME_TOL_REL = 1e-9  # flows finishing within this relative time of each other end together
_TIME_TOL_ABS_S = 1e-15


class Flow(NamedTuple):
    """`nbytes` from GPU `src` to GPU `dst`. A NamedTuple, not a dataclass: collectives on
    a thousand GPUs create tens of thousands of them, and tuples are several times cheaper."""

    src: int
    dst: int
    nbytes: float


def max_min_rates(
    pair_flow: IntArray, pair_link: IntArray, capacity: FloatArray, n_flows: int
) -> FloatArray:
    """Max-min fair rates of `n_flows` flows; flow f crosses link l for each pair (f, l).

    Progressive filling (Bertsekas & Gallager, Data Networks, 2nd ed., section 6.5.2): every
    flow not yet frozen gets the same increment until some link is full; flows through full
    links freeze. Each round freezes at least one link, so rounds <= distinct bottlenecks.
    """
    links, local = np.unique(pair_link, return_inverse=True)
    full = capacity[links].astype(np.float64)
    left = full.copy()
    rate = np.zeros(n_flows, dtype=np.float64)
    frozen = np.zeros(n_flows, dtype=bool)
    active = np.ones(pair_flow.shape[0], dtype=bool)
    while active.any():
        count = np.bincount(local[active], minlength=links.shape[0]).astype(np.float64)
        used = count > 0
        share = np.full(links.shape[0], np.inf)
        share[used] = left[used] / count[used]
        tightest = int(np.argmin(share))
        increment = share[tightest]
        rate[~frozen] += increment
        left -= increment * count
        saturated = used & (left <= 1e-9 * full)
        saturated[tightest] = True
        frozen[pair_flow[active & saturated[local]]] = True
        active &= ~frozen[pair_flow]
    return rate


@dataclass
class _Batch:
    """Flows started together; `event` fires when the last of them ends."""

    left: int
    event: simpy.Event


class FlowNetwork:
    """The links of one topology, shared by every flow started on it in one simpy run."""

    def __init__(self, env: simpy.Environment, topology: Topology) -> None:
        self.env = env
        self.topology = topology
        self._capacity = topology.bandwidth_bytes_per_s
        self._resource = topology.resource
        self._batches: dict[int, _Batch] = {}
        self._next_batch = 0
        self._state = _ActiveFlows.empty()
        self._last_update = env.now
        self._version = 0
        self._settle_pending = False
        self.sent_bytes = np.zeros(topology.world_size)
        self.received_bytes = np.zeros(topology.world_size)
        self.link_bytes = np.zeros(len(topology.edges))
        self.recomputations = 0
        self.flows_finished = 0

    # ---- public ---------------------------------------------------------------------

    def transfer(self, src: int, dst: int, nbytes: float) -> simpy.Event:
        """One flow; the event fires when its last byte arrives."""
        return self.start([Flow(src, dst, nbytes)])

    def start(
        self, flows: Sequence[Flow], *, repeat: int = 1, latency_s: float | None = None
    ) -> simpy.Event:
        """Start a phase of flows now; the event fires when all of them have ended.

        `repeat` coalesces that many identical consecutive steps (see the module doc).
        `latency_s`, when given, is the latency of one step for the whole phase, in place of
        each flow's route latency (a pipelined ring's mean hop, a chain's or tree's fill);
        the phase pays `repeat` x it before its data moves.
        """
        require(repeat >= 1, "repeat", repeat, "a positive number of steps")
        event = self.env.event()
        if not flows:
            event.succeed()
            return event
        batch_id = self._next_batch
        self._next_batch += 1
        self._batches[batch_id] = _Batch(len(flows), event)
        routes = self.topology.routes((f.src, f.dst) for f in flows)
        table = np.array(flows, dtype=np.float64).reshape(-1, 3)  # src, dst, bytes per flow
        require(bool((table[:, 2] >= 0).all()), "flow bytes", float(table[:, 2].min()), ">= 0")
        links = [r.links for r in routes]
        if latency_s is not None:
            self._after(repeat * latency_s, self._adder(table, links, repeat, batch_id))
            return event
        delays, group = np.unique([r.latency_s for r in routes], return_inverse=True)
        for k, delay in enumerate(delays.tolist()):
            members = np.flatnonzero(group == k)
            chosen = [links[i] for i in members.tolist()]
            self._after(repeat * delay, self._adder(table[members], chosen, repeat, batch_id))
        return event

    def bytes_by_link_class(self) -> dict[LinkClass, float]:
        """Bytes carried so far, summed over the directed links of each class."""
        out: dict[LinkClass, float] = {}
        for cls, carried in zip(self.topology.link_class, self.link_bytes, strict=True):
            out[cls] = out.get(cls, 0.0) + float(carried)
        return out

    @property
    def active_flows(self) -> int:
        return self._state.size

    # ---- adding and finishing flows -------------------------------------------------

    def _after(self, delay: float, action: Callable[[], None]) -> None:
        if delay <= 0:
            action()
            return
        self.env.timeout(delay).callbacks.append(lambda _event: action())

    def _adder(
        self, table: FloatArray, links: list[IntArray], repeat: int, batch_id: int
    ) -> Callable[[], None]:
        return lambda: self._add(table, links, repeat, batch_id)

    def _add(self, table: FloatArray, links: list[IntArray], repeat: int, batch_id: int) -> None:
        """Flows whose latency has passed enter their data phase (at the next settle)."""
        self._advance()
        moving = (table[:, 0] != table[:, 1]) & (table[:, 2] > 0)
        if not moving.all():
            # local copies and empty messages cross no link: they end now
            self._finish_batch(batch_id, int((~moving).sum()))
            links = [route for route, keep in zip(links, moving.tolist(), strict=True) if keep]
            table = table[moving]
        if links:
            self._state = self._state.extend(table, links, repeat, batch_id)
            self._request_settle()

    def _finish_batch(self, batch_id: int, count: int) -> None:
        batch = self._batches[batch_id]
        batch.left -= count
        if batch.left == 0:
            del self._batches[batch_id]
            batch.event.succeed()

    def _advance(self) -> None:
        elapsed = self.env.now - self._last_update
        if elapsed > 0 and self._state.size:
            self._state.remaining -= self._state.rate * elapsed
        self._last_update = self.env.now

    # ---- settling: one recomputation per instant ------------------------------------

    def _request_settle(self) -> None:
        if not self._settle_pending:
            self._settle_pending = True
            self._schedule_settle(0)

    def _schedule_settle(self, deferrals: int) -> None:
        event = self.env.event()
        event.callbacks.append(lambda _event: self._settle(deferrals))
        event.succeed()

    def _settle(self, deferrals: int) -> None:
        if self.env.peek() == self.env.now and deferrals < _DEFER_LIMIT:
            self._schedule_settle(deferrals + 1)  # let same-instant starts and ends join
            return
        self._settle_pending = False
        self._advance()
        self._version += 1
        if self._finish_done():
            self._request_settle()  # waiters resume at this instant and may start flows
            return
        if not self._state.size:
            return
        self.recomputations += 1
        state = self._state
        resources = self._resource[state.pair_link]
        state.rate = max_min_rates(state.pair_flow, resources, self._capacity, state.size)
        wait = float(np.min(state.remaining / state.rate))
        version = self._version
        self.env.timeout(max(wait, 0.0)).callbacks.append(lambda _e: self._wake(version))

    def _wake(self, version: int) -> None:
        if version == self._version:
            self._request_settle()

    def _finish_done(self) -> bool:
        """End the flows with nothing left to send; True if there were any."""
        state = self._state
        if not state.size:
            return False
        tolerance_s = _TIME_TOL_ABS_S + _TIME_TOL_REL * self.env.now
        done = state.remaining <= state.rate * tolerance_s
        if not done.any():
            return False
        self._book(done)
        self._state = state.without(done)
        batches, counts = np.unique(state.batch[done], return_counts=True)
        self.flows_finished += int(done.sum())
        for batch_id, count in zip(batches.tolist(), counts.tolist(), strict=True):
            self._finish_batch(batch_id, count)
        return True

    def _book(self, done: BoolArray) -> None:
        state = self._state
        np.add.at(self.sent_bytes, state.src[done], state.nbytes[done])
        np.add.at(self.received_bytes, state.dst[done], state.nbytes[done])
        pairs = done[state.pair_flow]
        np.add.at(self.link_bytes, state.pair_link[pairs], state.nbytes[state.pair_flow[pairs]])


@dataclass
class _ActiveFlows:
    """Flows in their data phase, as parallel arrays plus (flow, link) incidence pairs."""

    src: IntArray
    dst: IntArray
    nbytes: FloatArray
    remaining: FloatArray
    rate: FloatArray
    batch: IntArray
    pair_flow: IntArray
    pair_link: IntArray

    @classmethod
    def empty(cls) -> _ActiveFlows:
        ints, floats = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float64)
        return cls(ints, ints, floats, floats, floats, ints, ints, ints)

    @property
    def size(self) -> int:
        return int(self.src.shape[0])

    def extend(
        self, table: FloatArray, links: list[IntArray], repeat: int, batch_id: int
    ) -> _ActiveFlows:
        """Append flows given as rows (src, dst, bytes) with their routes' links."""
        n = table.shape[0]
        nbytes = table[:, 2] * repeat
        lengths = np.fromiter((r.shape[0] for r in links), dtype=np.int64, count=n)
        new_pair_flow = np.repeat(np.arange(self.size, self.size + n, dtype=np.int64), lengths)
        return _ActiveFlows(
            np.concatenate([self.src, table[:, 0].astype(np.int64)]),
            np.concatenate([self.dst, table[:, 1].astype(np.int64)]),
            np.concatenate([self.nbytes, nbytes]),
            np.concatenate([self.remaining, nbytes]),
            np.concatenate([self.rate, np.zeros(n)]),
            np.concatenate([self.batch, np.full(n, batch_id, dtype=np.int64)]),
            np.concatenate([self.pair_flow, new_pair_flow]),
            np.concatenate([self.pair_link, *links]),
        )

    def without(self, gone: BoolArray) -> _ActiveFlows:
        keep = ~gone
        new_index = np.cumsum(keep) - 1
        pairs = keep[self.pair_flow]
        return _ActiveFlows(
            self.src[keep],
            self.dst[keep],
            self.nbytes[keep],
            self.remaining[keep],
            self.rate[keep],
            self.batch[keep],
            new_index[self.pair_flow[pairs]],
            self.pair_link[pairs],
        )
