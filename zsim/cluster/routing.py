"""Routes, for many flows at once: the edges a flow from GPU a to GPU b crosses, in order.

Inside a node, the least-latency path (NVLink through the NVSwitch when there is one, else the
PCIe tree or the host's loopback; hop count breaks ties), found once on node 0's template and
shifted by the node's edge offset. Between nodes, GPU i leaves through its rail's NIC
(i * nics // G), crosses its leaf, the spine when the two NICs sit on different leaves, and the
destination's leaf and NIC. A route's latency is the sum of its edges' latencies, summed in
route order as numpy sums one route.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import networkx as nx
import numpy as np

from zsim.cluster.build import Edge, FloatArray, IntArray, Ints, distinct, leaf_of, leaves
from zsim.cluster.fabric import FabricSpec


@dataclass(frozen=True)
class RouteTables:
    """Node 0's paths as template edge indices, padded with -1: GPU a -> GPU b, GPU a -> its
    NIC, its NIC -> GPU b."""

    gpu_gpu: IntArray  # (G, G, width)
    gpu_nic: IntArray  # (G, width)
    nic_gpu: IntArray  # (G, width)


def route_tables(
    template: tuple[Edge, ...], latency: FloatArray, gpus: int, nics: int
) -> RouteTables:
    """Least-latency paths in node 0 (template edge latencies `latency`), one Dijkstra per
    source vertex."""
    graph = nx.DiGraph()
    for index, e in enumerate(template):
        graph.add_edge(e.u, e.v, index=index)

    def weight(_u: str, _v: str, data: dict[str, Any]) -> float:
        return float(latency[data["index"]]) + 1e-12

    def paths(src: str) -> dict[str, list[int]]:
        found = nx.single_source_dijkstra_path(graph, src, weight=weight)
        return {
            dst: [int(graph.edges[u, v]["index"]) for u, v in pairwise(path)]
            for dst, path in found.items()
        }

    nic = [i * nics // gpus for i in range(gpus)]
    from_gpu = [paths(f"gpu{a}") for a in range(gpus)]
    from_nic = {j: paths(f"nic{j}") for j in set(nic)}
    gg = [[from_gpu[a][f"gpu{b}"] if a != b else [] for b in range(gpus)] for a in range(gpus)]
    gn = [from_gpu[a][f"nic{nic[a]}"] for a in range(gpus)]
    ng = [from_nic[nic[b]][f"gpu{b}"] for b in range(gpus)]
    width = max(len(r) for rows in (gn, ng, *gg) for r in rows) or 1
    return RouteTables(
        np.stack([_padded(row, width) for row in gg]), _padded(gn, width), _padded(ng, width)
    )


def _padded(routes: list[list[int]], width: int) -> IntArray:
    out = np.full((len(routes), width), -1, dtype=np.int64)
    for index, r in enumerate(routes):
        out[index, : len(r)] = r
    return out


@dataclass(frozen=True)
class Routes:
    """The routes of flows i = 0..F-1: each (flow, edge) pair, in route order, and the latency
    of each route."""

    pair_flow: Ints
    pair_link: Ints
    latency_s: FloatArray


def routes_of(
    src: IntArray,
    dst: IntArray,
    tables: RouteTables,
    fabric: FabricSpec,
    nodes: int,
    template_edges: int,
    latency: FloatArray,
) -> Routes:
    """Every flow's route (flows from a GPU to itself cross nothing)."""
    src, dst = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
    gpus = tables.gpu_gpu.shape[0]
    node_a, local_a = np.divmod(src, gpus)
    node_b, local_b = np.divmod(dst, gpus)
    same = node_a == node_b
    inside = _shifted(tables.gpu_gpu[local_a, local_b], node_a * template_edges)
    out = _shifted(tables.gpu_nic[local_a], node_a * template_edges)
    into = _shifted(tables.nic_gpu[local_b], node_b * template_edges)
    across = _across(fabric, nodes, template_edges, gpus, node_a, local_a, node_b, local_b)
    cross = np.concatenate([out, across, into], axis=1)
    width = max(inside.shape[1], cross.shape[1])
    links = np.full((len(src), width), -1, dtype=np.int64)
    links[same, : inside.shape[1]] = inside[same]
    links[~same, : cross.shape[1]] = cross[~same]
    links[src == dst] = -1
    return _compacted(links, latency)


def _shifted(links: IntArray, offset: IntArray) -> IntArray:
    return np.where(links >= 0, links + offset[:, None], -1)


def _across(
    fabric: FabricSpec,
    nodes: int,
    template_edges: int,
    gpus: int,
    node_a: IntArray,
    local_a: IntArray,
    node_b: IntArray,
    local_b: IntArray,
) -> IntArray:
    """NIC up, [leaf -> spine, spine -> leaf,] NIC down: edge indices, -1 where no spine."""
    up, _, to_spine, leaf_a = _nic_edges(fabric, nodes, template_edges, gpus, node_a, local_a)
    _, down, from_spine, leaf_b = _nic_edges(fabric, nodes, template_edges, gpus, node_b, local_b)
    crosses = (leaf_a != leaf_b) & (leaves(fabric, nodes) > 1)
    return np.stack(
        [up, np.where(crosses, to_spine, -1), np.where(crosses, from_spine + 1, -1), down], axis=1
    )


def _nic_edges(
    fabric: FabricSpec, nodes: int, template_edges: int, gpus: int, node: IntArray, local: IntArray
) -> tuple[IntArray, IntArray, IntArray, IntArray]:
    """(NIC up, NIC down, its leaf's link to the spine, the leaf) of GPUs (node, local); the
    leaf's link from the spine is the next edge."""
    nics = fabric.nics_per_node
    nic = local * nics // gpus
    base = nodes * template_edges
    up = base + 2 * (node * nics + nic)
    leaf = leaf_of(fabric, nodes, node, nic)
    return up, up + 1, base + 2 * nodes * nics + 2 * leaf, leaf


def reach_of(
    members: IntArray, tables: RouteTables, fabric: FabricSpec, nodes: int, template_edges: int
) -> IntArray:
    """Every edge a route between two of `members` can cross (with repeats): a superset of
    what any algorithm's flows on the group use, from O(members) pieces, not O(members^2)
    routes. A route between nodes is its source's half (path to its NIC, NIC up, its leaf's
    spine uplink where leaves differ) and its destination's (spine downlink, NIC down, path
    from the NIC), so each member's both halves cover every pair it is in."""
    gpus = tables.gpu_gpu.shape[0]
    node, local = np.divmod(np.asarray(members, dtype=np.int64), gpus)
    present = np.zeros((nodes, gpus), dtype=bool)
    present[node, local] = True
    hosts = distinct(node)
    at_host = present[hosts]  # (hosts, G): which locals each member node holds
    pair = at_host[:, :, None] & at_host[:, None, :] & ~np.eye(gpus, dtype=bool)
    where, a, b = np.nonzero(pair)
    parts = [_shifted(tables.gpu_gpu[a, b], hosts[where] * template_edges).ravel()]
    if len(hosts) > 1:
        up, down, to_spine, leaf = _nic_edges(fabric, nodes, template_edges, gpus, node, local)
        parts += [
            _shifted(tables.gpu_nic[local], node * template_edges).ravel(),
            _shifted(tables.nic_gpu[local], node * template_edges).ravel(),
            up,
            down,
        ]
        if len(np.unique(leaf)) > 1:
            parts += [to_spine, to_spine + 1]
    found = np.concatenate(parts)
    return found[found >= 0]


def _compacted(links: IntArray, latency: FloatArray) -> Routes:
    """Pad entries dropped (row-major order keeps each row's edges in route order); each
    route's latency summed as numpy sums the route's latencies alone (rows of one length at a
    time, so that the summation order is that of a single route)."""
    valid = links >= 0
    pair_link = links[valid]
    lengths = valid.sum(axis=1)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    route_latency = np.zeros(len(links))
    pair_latency = latency[pair_link]
    for n in np.unique(lengths).tolist():
        if n:
            rows = np.flatnonzero(lengths == n)
            index = starts[rows][:, None] + np.arange(n)
            route_latency[rows] = pair_latency[index].sum(axis=1)
    pair_flow = np.repeat(np.arange(len(links), dtype=np.int32), lengths)
    return Routes(pair_flow, pair_link.astype(np.int32), route_latency)
