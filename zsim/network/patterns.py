"""What a pattern of flows sees on a topology (its bottleneck share, its latencies), and the
building blocks the backends' algorithms share: members by node, rings of flows, and the
point-to-point patterns (send_recv, all_to_all). Flows are arrays (source GPUs, destination
GPUs), so a collective over a hundred thousand GPUs costs numpy, not Python objects.

The closed form of each algorithm is evaluated with alpha from route latencies and B the
bottleneck fair share of its flows (capacity / flows crossing a link), which is exact when
equal flows start together. Latencies along a path are summed hop by hop, in path order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from zsim.cluster.build import FloatArray, IntArray
from zsim.cluster.topology import Topology
from zsim.network.collective import CollectiveCall, CollectiveOp, Phase, ring_closed_form_s

Built = tuple[list[Phase], float]  # phases and the closed form (without the call latency)

_MEMO_FLOWS = 4096
"""Patterns of this many flows or more keep what is derived from them (`Topology.memoized`):
every call of a collective on one big group, whatever its size, reuses the same arrays."""


def fair_share(topo: Topology, src: IntArray, dst: IntArray) -> float:
    """The smallest fair share of any capacity (capacity / flows drawing on it; a half-duplex
    pair is one capacity): the rate of the slowest flow when all start together (the first
    level of max-min filling)."""
    if len(src) < _MEMO_FLOWS:
        return _fair_share(topo, src, dst)
    key = ("fair_share", id(src), id(dst))
    return topo.memoized(key, lambda: (_fair_share(topo, src, dst), src, dst))[0]


def _fair_share(topo: Topology, src: IntArray, dst: IntArray) -> float:
    moving = src != dst
    if not moving.any():
        return math.inf
    routes = topo.routes_of(src[moving], dst[moving])
    counts = np.bincount(topo.resource[routes.pair_link])
    used = counts > 0
    return float((topo.bandwidth_bytes_per_s[: counts.shape[0]][used] / counts[used]).min())


def alone_rate(topo: Topology, src: IntArray, dst: IntArray) -> float:
    """The slowest flow's rate if each ran alone (its route's narrowest link)."""
    moving = src != dst
    if not moving.any():
        return math.inf
    routes = topo.routes_of(src[moving], dst[moving])
    return float(topo.bandwidth_bytes_per_s[routes.pair_link].min())


def max_latency(topo: Topology, src: IntArray, dst: IntArray) -> float:
    if not len(src):
        return 0.0
    return float(topo.routes_of(src, dst).latency_s.max())


def path_latencies(topo: Topology, paths: IntArray) -> FloatArray:
    """The latency of each path (a row of GPUs, walked in order), hop by hop."""
    hops = topo.routes_of(paths[:, :-1].ravel(), paths[:, 1:].ravel()).latency_s
    if paths.shape[1] < 2:
        return np.zeros(paths.shape[0])
    return np.cumsum(hops.reshape(paths.shape[0], -1), axis=1)[:, -1]


def path_latency(topo: Topology, path: Sequence[int]) -> float:
    return float(path_latencies(topo, np.asarray([path], dtype=np.int64))[0])


def by_node(topo: Topology, group: Sequence[int]) -> list[IntArray]:
    """Group members per node: nodes in id order, members by local index."""
    gpus = np.asarray(group, dtype=np.int64)
    node, local = np.divmod(gpus, topo.gpus_per_node)
    ordered = gpus[np.lexsort((local, node))]
    cuts = np.flatnonzero(np.diff(ordered // topo.gpus_per_node)) + 1
    return np.split(ordered, cuts)


def ring_flows(rings: IntArray, shift: int = 1) -> tuple[IntArray, IntArray]:
    """Every member sends to the member `shift` places on in its ring (rings are rows)."""
    return rings.ravel(), np.roll(rings, -shift, axis=1).ravel()


def ring_latency(topo: Topology, rings: IntArray, shift: int = 1) -> float:
    """One pipelined step: the mean hop latency of the slowest ring (in its direction)."""
    if rings.size < _MEMO_FLOWS:
        return _ring_latency(topo, rings, shift)
    key = ("ring_latency", id(rings), shift)
    return topo.memoized(key, lambda: (_ring_latency(topo, rings, shift), rings))[0]


def _ring_latency(topo: Topology, rings: IntArray, shift: int) -> float:
    cycles = np.concatenate([rings, rings[:, :1]], axis=1)
    if shift < 0:
        cycles = cycles[:, ::-1]
    return float((path_latencies(topo, cycles) / (cycles.shape[1] - 1)).max())


def point_to_point(topo: Topology, call: CollectiveCall) -> Built:
    """send_recv: one flow. all_to_all: every rank sends S/n to every other, all at once."""
    n, size = len(call.group), call.nbytes
    group = np.asarray(call.group, dtype=np.int64)
    if call.op is CollectiveOp.SEND_RECV:
        phase = Phase(group[:1], group[1:2], size)
        per_rank = fair_share(topo, phase.src, phase.dst)
    else:
        src, dst = np.repeat(group, n), np.tile(group, n)
        keep = src != dst
        phase = Phase(src[keep], dst[keep], size / n)
        per_rank = fair_share(topo, phase.src, phase.dst) * (n - 1)
    closed = ring_closed_form_s(call.op, n, size, max_latency(topo, phase.src, phase.dst), per_rank)
    return [phase], closed


def member_pair_links(topo: Topology, groups: Sequence[Sequence[int]]) -> tuple[IntArray, IntArray]:
    """(capacity, group index) of every hop of every route between two members of a group
    (groups of one size), every ordered pair taken, in one batch of routes: a superset of the
    links any algorithm's flows on the group cross."""
    members = np.array(groups, dtype=np.int64)  # (groups, size)
    size = members.shape[1]
    off_diagonal = ~np.eye(size, dtype=bool)
    src = np.repeat(members, size, axis=1).reshape(-1, size, size)[:, off_diagonal]
    dst = np.tile(members, size).reshape(-1, size, size)[:, off_diagonal]
    owner = np.repeat(np.arange(len(members)), off_diagonal.sum())
    routes = topo.routes_of(src.ravel(), dst.ravel())
    return topo.resource[routes.pair_link], owner[routes.pair_flow]
