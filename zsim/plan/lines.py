"""A collective's time in the planner's closed form: the line through two large sizes of its
plan (`network.plans`), or, where the same call on the groups beside it shares its links, of
their flows solved together (`simulate_s`), as the simulator's replica groups contend; and a
latency-bound call's own plan."""

from __future__ import annotations

import simpy

from zsim.cluster.topology import Topology
from zsim.network.collective import CollectiveCall, CollectiveOp
from zsim.network.communicator import Communicator, simulate_s

_SIZES = (2.0**27, 2.0**30)  # two large sizes: a collective's closed form is a + b x bytes


class CollectiveLines:
    """Every collective line one planner asks for, kept by operation and group."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self.comms = Communicator(simpy.Environment(), topology)
        self._lines: dict[tuple[object, ...], tuple[float, float]] = {}

    def call_s(
        self,
        op: CollectiveOp,
        nbytes: float,
        group: tuple[int, ...],
        beside: tuple[tuple[int, ...], ...] = (),
    ) -> float:
        """A collective's time as the line through two large sizes: its plan's closed form,
        or, when the same call on the groups `beside` it (the other TP ranks' data-parallel
        groups, which run it at the same moment) shares its links, their flows solved
        together (`simulate_s`), as the simulator's replica groups contend."""
        if len(group) == 1 or nbytes <= 0:
            return 0.0
        key = (op, id(group))  # groups are cached tuples (`_dp_group`, TP and pipeline pairs)
        if key not in self._lines:
            rivals = self._rivals(op, group, beside)
            times = []
            for size in _SIZES:
                call = CollectiveCall(op, size, group)
                if rivals:
                    together = [call, *(CollectiveCall(op, size, g) for g in rivals)]
                    times.append(simulate_s(self.topology, together)[0])
                else:
                    times.append(self.comms.plan(call).closed_form_s)
            slope = (times[1] - times[0]) / (_SIZES[1] - _SIZES[0])
            self._lines[key] = (times[0] - slope * _SIZES[0], slope)
        intercept, slope = self._lines[key]
        return intercept + slope * nbytes

    def latency_s(self, op: CollectiveOp, nbytes: float, group: tuple[int, ...]) -> float:
        """A latency-bound call (FP8's amaxes) by its own plan, not the large sizes' line."""
        if (op, id(group), nbytes) not in self._lines:
            closed = self.comms.plan(CollectiveCall(op, nbytes, group)).closed_form_s
            self._lines[(op, id(group), nbytes)] = (closed, 0.0)
        return self._lines[(op, id(group), nbytes)][0]

    def _rivals(
        self, op: CollectiveOp, group: tuple[int, ...], beside: tuple[tuple[int, ...], ...]
    ) -> list[tuple[int, ...]]:
        """The groups beside `group` whose flows would share its links (sends: all routed in
        one batch, as the engine finds its replica sends)."""
        if op is CollectiveOp.SEND_RECV:
            pairs = [(g[0], g[1]) for g in beside]
            return list(self.comms.sharing_pairs((group[0], group[1]), pairs))
        return [g for g in beside if self.comms.shares_links(op, group, g)]
