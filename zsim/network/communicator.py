"""Collectives on the flow network: a `Communicator` owns one `FlowNetwork` for a simpy run and
starts calls and transfers on it, so every collective shares the links with all the others
(contention between TP, DP and PP traffic comes from the network, not from a formula); plans are
cached per call. `simulate_s(topology, calls)` runs calls together on a fresh network (CLI,
calibration, tests).
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Any

import numpy as np
import simpy

from zsim.cluster.build import CLASSES, FloatArray, distinct
from zsim.cluster.fabric import Backend
from zsim.cluster.topology import Topology
from zsim.network.collective import Algorithm, CollectiveCall, CollectiveOp, Phase, Plan
from zsim.network.flows import FlowGroup, FlowNetwork
from zsim.network.plans import plan


def run_plan(
    network: FlowNetwork,
    chosen: Plan,
    exact_steps: bool = False,
    alongside: Sequence[Plan] = (),
) -> Generator[simpy.Event, Any, float]:
    """A simpy process body: the call latency, then each phase (its flows, then the members'
    local work); returns the elapsed seconds. `exact_steps` runs repeated steps one at a time
    instead of coalesced (for checking). `alongside`: single-phase plans whose flows start with
    this plan's single phase and only load the links (the same call in other groups)."""
    env = network.env
    start = env.now
    if chosen.overhead_s > 0:
        yield env.timeout(chosen.overhead_s)
    for phase in chosen.phases:
        if phase.waits_for is not None:
            yield from _dataflow(network, phase)
        elif exact_steps:
            for _ in range(phase.repeat):
                yield network.launch([_group(phase, repeat=1)])
        else:
            others = [_group(p.phases[0], waited=False) for p in alongside]
            yield network.launch([_group(phase), *others])
        if phase.local_s > 0:
            yield env.timeout(phase.local_s)
    return float(env.now - start)


def _group(phase: Phase, repeat: int | None = None, waited: bool = True) -> FlowGroup:
    steps = phase.repeat if repeat is None else repeat
    return FlowGroup(phase.src, phase.dst, phase.nbytes, steps, phase.latency_s, waited)


def single_phase(chosen: Plan) -> bool:
    """Whether a plan is one phase of flows that start together (so that copies of it on other
    groups can start with it: `run_plan`'s `alongside`)."""
    return len(chosen.phases) == 1 and chosen.phases[0].waits_for is None


def _dataflow(network: FlowNetwork, phase: Phase) -> Generator[simpy.Event, Any, None]:
    """Each flow starts once the flows it waits for have ended."""
    env = network.env
    ended = [env.event() for _ in range(phase.size)]
    waits = phase.waits_for or ()

    def one(i: int) -> Generator[simpy.Event, Any, None]:
        yield simpy.AllOf(env, [ended[j] for j in waits[i]])
        one = FlowGroup(phase.src[i : i + 1], phase.dst[i : i + 1], phase.nbytes)
        yield network.launch([one])
        ended[i].succeed()

    for i in range(phase.size):
        env.process(one(i))
    yield simpy.AllOf(env, ended)


def _nccl_send(call: CollectiveCall) -> bool:
    return (
        call.op is CollectiveOp.SEND_RECV
        and len(call.group) == 2
        and call.algorithm in (Algorithm.AUTO, Algorithm.RING)
    )


_Lone = tuple[int, int, float, float, tuple[tuple[int, int], ...]]  # see `lone_send`


class Communicator:
    """Collectives and point-to-point transfers on one shared flow network."""

    def __init__(
        self, env: simpy.Environment, topology: Topology, exact_steps: bool = False
    ) -> None:
        self.env = env
        self.topology = topology
        self.network = FlowNetwork(env, topology)
        self.exact_steps = exact_steps
        self._plans: dict[CollectiveCall, Plan] = {}
        self._links: dict[CollectiveCall, frozenset[int]] = {}
        self._class_bytes: dict[CollectiveCall, FloatArray] = {}
        self._sends: dict[tuple[CollectiveCall, int], tuple[_Lone | None, object]] = {}
        self._reaches: dict[tuple[int, ...], frozenset[int]] = {}
        # NCCL plans a send_recv as one flow from the first member to the second with no local
        # work (`patterns.point_to_point`): the copies of a send need no plan of their own
        self._p2p_flow = topology.fabric.backend is Backend.NCCL and not exact_steps

    def plan(self, call: CollectiveCall) -> Plan:
        if call not in self._plans:
            self._plans[call] = plan(self.topology, call)
        return self._plans[call]

    def run(self, call: CollectiveCall, alongside: Sequence[CollectiveCall] = ()) -> simpy.Process:
        """Start `call` now; the process's value is its duration in seconds. `alongside`: the
        same call on other groups, which only loads the links; the engine's symmetric ranks'
        copies. Started with this call's flows when both are single-phase plans, else each as
        its own process."""
        chosen = self.plan(call)
        others = [self.plan(c) for c in alongside]
        together = single_phase(chosen) and all(single_phase(p) for p in others)
        process = self.env.process(
            run_plan(self.network, chosen, self.exact_steps, others if together else ())
        )
        if not together:
            for other in alongside:
                self.env.process(run_plan(self.network, self.plan(other), self.exact_steps))
        return process

    def send(self, call: CollectiveCall, alongside: Sequence[CollectiveCall] = ()) -> simpy.Event:
        """A point-to-point send, timed alone while nothing shares its links
        (`FlowNetwork.transfer_alone`) when its plan and its copies' are one flow and no local
        work; the event fires when it has arrived. `alongside`: the same send on other ranks."""
        key = (call, id(alongside))  # a pipeline repeats its sends, with the same copies
        found = self._sends.get(key)
        if found is None:  # kept with the copies it was asked with, so their id stays theirs
            found = self._sends[key] = (self.lone_send(call, alongside), alongside)
        alone = found[0]
        if alone is None:
            return self.run(call, alongside)
        src, dst, nbytes, delay_s, pairs = alone
        return self.network.transfer_alone(src, dst, nbytes, delay_s, pairs)

    def lone_send(
        self, call: CollectiveCall, alongside: Sequence[CollectiveCall] = ()
    ) -> _Lone | None:
        """(source, destination, bytes, call latency, the copies' pairs) of a send that may be
        timed alone: its plan and its copies' are one flow each with no local work (None
        otherwise, or with `exact_steps`)."""
        flows = [self._one_flow(c) for c in (call, *alongside)]
        if any(f is None for f in flows) or self.exact_steps:
            return None
        pairs = tuple((f[0], f[1]) for f in flows if f is not None)
        return (*pairs[0], call.nbytes, self.plan(call).overhead_s, pairs[1:])

    def _one_flow(self, call: CollectiveCall) -> tuple[int, int] | None:
        if self._p2p_flow and _nccl_send(call):
            return call.group[0], call.group[1]  # NCCL's send_recv: its one flow, unplanned
        chosen = self.plan(call)
        phase = chosen.phases[0] if len(chosen.phases) == 1 else None
        if phase is None or phase.local_s > 0 or phase.size != 1:
            return None
        return int(phase.src[0]), int(phase.dst[0])

    def collective(
        self,
        op: CollectiveOp,
        nbytes: float,
        group: Sequence[int],
        algorithm: Algorithm = Algorithm.AUTO,
        root: int = 0,
    ) -> simpy.Process:
        return self.run(CollectiveCall(op, nbytes, tuple(group), algorithm, root))

    def transfer(self, src: int, dst: int, nbytes: float) -> simpy.Process:
        """A point-to-point send (pipeline activations): one send_recv call."""
        return self.collective(CollectiveOp.SEND_RECV, nbytes, (src, dst))

    def class_bytes(self, call: CollectiveCall) -> FloatArray:
        """Bytes `call`'s flows put on each link class (by `zsim.cluster.build.CLASSES`
        index), summed over the directed links they cross."""
        found = self._class_bytes.get(call)
        if found is None:
            found = np.zeros(len(CLASSES))
            for phase in self.plan(call).phases:
                if phase.nbytes <= 0:
                    continue
                # the phase's pattern, routed once for this count and for its flows' run
                moving = self.network.sets.pattern(phase.src, phase.dst).moving_set
                if moving >= 0:
                    pairs = self.network.sets.flow_set(moving).class_pairs
                    found += phase.nbytes * phase.repeat * pairs
            self._class_bytes[call] = found
        return found

    def links_of(self, call: CollectiveCall) -> frozenset[int]:
        """The link capacities `call`'s flows draw on (directed links; a half-duplex pair's
        two directions are one)."""
        nccl = self.topology.fabric.backend is Backend.NCCL
        if (
            call not in self._links
            and len(call.group) == 2
            and (nccl or call.op is CollectiveOp.SEND_RECV)
        ):
            self._links[call] = self._pair_links(call)
        if call not in self._links:
            phases = self.plan(call).phases
            src = np.concatenate([p.src for p in phases]) if phases else np.zeros(0, np.int64)
            dst = np.concatenate([p.dst for p in phases]) if phases else np.zeros(0, np.int64)
            routes = self.topology.routes_of(src, dst)
            self._links[call] = frozenset(
                distinct(self.topology.resource[routes.pair_link]).tolist()
            )
        return self._links[call]

    def _pair_links(self, call: CollectiveCall) -> frozenset[int]:
        """An NCCL call between two GPUs moves data between them whatever its algorithm: from
        the root (broadcast) or to it (reduce), from the first to the second (send_recv), both
        ways otherwise (its plan's flows, without planning it; gloo's reduce differs)."""
        first, second = call.group
        root, other = (first, second) if call.root == 0 else (second, first)
        one_way = {
            CollectiveOp.SEND_RECV: [(first, second)],
            CollectiveOp.BROADCAST: [(root, other)],
            CollectiveOp.REDUCE: [(other, root)],
        }
        pairs = one_way.get(call.op, [(first, second), (second, first)])
        links = [self.topology.route(src, dst).links for src, dst in pairs]
        return frozenset(self.topology.resource[np.concatenate(links)].tolist())

    def sharing_pairs(
        self, pair: tuple[int, int], others: Sequence[tuple[int, int]]
    ) -> list[tuple[int, int]]:
        """The point-to-point transfers among `others` whose routes share a capacity with
        `pair`'s (then they contend)."""
        if not others:
            return []
        mine = self.links_of(CollectiveCall(CollectiveOp.SEND_RECV, 1.0, pair))
        src, dst = (np.array(side, dtype=np.int64) for side in zip(*others, strict=True))
        routes = self.topology.routes_of(src, dst)
        hit = np.isin(self.topology.resource[routes.pair_link], np.array(sorted(mine)))
        chosen = set(distinct(routes.pair_flow[hit]).tolist())
        return [p for i, p in enumerate(others) if i in chosen]

    def reach(self, group: tuple[int, ...]) -> frozenset[int]:
        """Every capacity a route between two members of `group` can cross (kept)."""
        if group not in self._reaches:
            self._reaches[group] = frozenset(distinct(self.topology.reach(group)).tolist())
        return self._reaches[group]

    def shares_links(
        self, op: CollectiveOp, group_a: Sequence[int], group_b: Sequence[int]
    ) -> bool:
        """Whether `op` on the two groups crosses a common link (then they contend). Groups
        whose members' routes cross no common link do not, whatever their algorithm: that is
        tested first, without planning either."""
        if self.reach(tuple(group_a)).isdisjoint(self.reach(tuple(group_b))):
            return False
        a = self.links_of(CollectiveCall(op, 1.0, tuple(group_a)))
        b = self.links_of(CollectiveCall(op, 1.0, tuple(group_b)))
        return not a.isdisjoint(b)


def simulate_s(
    topo: Topology, calls: Sequence[CollectiveCall], exact_steps: bool = False
) -> list[float]:
    """Run `calls` together from time 0 on a fresh network; each one's duration in seconds."""
    env = simpy.Environment()
    comm = Communicator(env, topo, exact_steps)
    processes = [comm.run(call) for call in calls]
    env.run()
    return [float(p.value or 0.0) for p in processes]
