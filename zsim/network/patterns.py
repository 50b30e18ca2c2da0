"""What a pattern of flows sees on a topology (its bottleneck share, its latencies), and the
building blocks the backends' algorithms share: members by node, rings of flows, and the
point-to-point patterns (send_recv, all_to_all).

The closed form of each algorithm is evaluated with alpha from route latencies and B the
bottleneck fair share of its flows (capacity / flows crossing a link), which is exact when
equal flows start together.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import pairwise

import numpy as np

from zsim.cluster.topology import Topology
from zsim.network.collective import CollectiveCall, CollectiveOp, Phase, ring_closed_form_s
from zsim.network.flows import Flow

Built = tuple[list[Phase], float]  # phases and the closed form (without the call latency)


def fair_share(topo: Topology, flows: Sequence[Flow]) -> float:
    """The smallest fair share of any capacity (capacity / flows drawing on it; a half-duplex
    pair is one capacity): the rate of the slowest flow when all start together (the first
    level of max-min filling)."""
    routes = [r.links for r in topo.routes((f.src, f.dst) for f in flows if f.src != f.dst)]
    if not routes:
        return math.inf
    counts = np.bincount(topo.resource[np.concatenate(routes)])
    used = counts > 0
    return float((topo.bandwidth_bytes_per_s[: counts.shape[0]][used] / counts[used]).min())


def alone_rate(topo: Topology, flows: Sequence[Flow]) -> float:
    """The slowest flow's rate if each ran alone (its route's narrowest link)."""
    routes = topo.routes((f.src, f.dst) for f in flows if f.src != f.dst)
    return min((float(topo.bandwidth_bytes_per_s[r.links].min()) for r in routes), default=math.inf)


def max_latency(topo: Topology, flows: Sequence[Flow]) -> float:
    return max((r.latency_s for r in topo.routes((f.src, f.dst) for f in flows)), default=0.0)


def path_latency(topo: Topology, path: Sequence[int]) -> float:
    return sum(r.latency_s for r in topo.routes(pairwise(path)))


def by_node(topo: Topology, group: Sequence[int]) -> list[list[int]]:
    """Group members per node: nodes in id order, members by local index."""
    nodes: dict[int, list[int]] = {}
    for gpu in sorted(group, key=lambda g: (topo.node_of(g), topo.local_of(g))):
        nodes.setdefault(topo.node_of(gpu), []).append(gpu)
    return [nodes[k] for k in sorted(nodes)]


def ring_flows(rings: Sequence[Sequence[int]], nbytes: float, shift: int = 1) -> tuple[Flow, ...]:
    """Every member sends `nbytes` to the member `shift` places on in its ring."""
    return tuple(
        Flow(ring[i], ring[(i + shift) % len(ring)], nbytes)
        for ring in rings
        for i in range(len(ring))
    )


def ring_latency(topo: Topology, rings: Sequence[Sequence[int]], shift: int = 1) -> float:
    """One pipelined step: the mean hop latency of the slowest ring (in its direction)."""
    cycles = [[*ring, ring[0]] for ring in rings]
    if shift < 0:
        cycles = [cycle[::-1] for cycle in cycles]
    return max(path_latency(topo, cycle) / (len(cycle) - 1) for cycle in cycles)


def point_to_point(topo: Topology, call: CollectiveCall) -> Built:
    """send_recv: one flow. all_to_all: every rank sends S/n to every other, all at once."""
    n, size = len(call.group), call.nbytes
    if call.op is CollectiveOp.SEND_RECV:
        flows: tuple[Flow, ...] = (Flow(call.group[0], call.group[1], size),)
        per_rank = fair_share(topo, flows)
    else:
        flows = tuple(Flow(a, b, size / n) for a in call.group for b in call.group if a != b)
        per_rank = fair_share(topo, flows) * (n - 1)
    closed = ring_closed_form_s(call.op, n, size, max_latency(topo, flows), per_rank)
    return [Phase(flows)], closed
