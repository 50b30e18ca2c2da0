"""The cluster as a graph: GPUs, NVSwitch/PCIe/host, NICs, leaf and spine switches; routes.

Every edge is directed (a link per direction) and has a bandwidth, a latency and a link class,
held as arrays indexed by edge number (`zsim.cluster.build`), so that a route is an array of
edge indices the flow network can use directly. Each edge draws on one capacity,
`resource[edge]`: its own, or for a half-duplex pair (a CPU rank's loopback TCP stack, whose
sends and receives share one core) the pair's first edge, so flows into and out of that rank
share one capacity. Routing is in `zsim.cluster.routing`.

The spine layer is one aggregated vertex: each leaf's uplink carries
`leaf_ports * nic_rate / oversubscription`. That assumes ECMP / adaptive routing spreads
flows evenly over the spine switches (a fluid model), so hash collisions are not modelled.

Ranks map to GPUs one to one (rank r on GPU r: launchers fill nodes in order); the process
groups of a layout are in `zsim.cluster.grid`, a profile's measured links in
`zsim.cluster.calibrated`. The vertex names and the networkx graph (`edges`, `graph`) are
built when first asked for: the simulator needs only the arrays.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, TypeVar

import networkx as nx
import numpy as np
import numpy.typing as npt

from zsim.cluster.build import (
    CLASSES,
    Edge,
    FloatArray,
    IntArray,
    digest,
    distinct,
    edge_arrays,
    edge_names,
    node_template,
)
from zsim.cluster.fabric import FabricSpec, LinkClass, LocalWork
from zsim.cluster.routing import Routes, RouteTables, reach_of, route_tables, routes_of
from zsim.errors import positive_int, require

T = TypeVar("T")
_FEW_FLOWS = 4  # routes of this many flows or fewer come from the per-pair cache
# the routes of this many flows or more are kept, the latest sets up to this many (flow, edge)
# pairs in all: a big collective's plans for each size, its closed form and its flows share them
_CACHED_FLOWS, _CACHED_PAIRS = 4096, 16_000_000
_CHUNK_FLOWS = 262_144  # routes of more flows are found this many at a time
MAX_GPUS = 131_072
"""The largest cluster the simulator takes (2^17 GPUs: 16,384 nodes of 8); larger ones are
refused before any work starts (`zsim.cluster.names`, `build_topology`)."""


@dataclass(frozen=True, eq=False)
class Route:
    """A path between two GPUs: edge indices in order, and the sum of their latencies."""

    links: IntArray
    latency_s: float


@dataclass(frozen=True, eq=False)
class Topology:
    """A built cluster. Treat every field as read-only (`zsim.cluster.calibrated` changes
    link classes in a copy)."""

    name: str
    fabric: FabricSpec
    nodes: int
    gpus_per_node: int
    template: tuple[Edge, ...]  # node 0's edges, local vertex names
    bandwidth_bytes_per_s: FloatArray  # per edge index
    latency_s: FloatArray  # per edge index
    class_id: IntArray  # per edge index: an index into `zsim.cluster.build.CLASSES`
    resource: IntArray  # per edge index: the edge whose capacity it draws on (see module doc)
    call_latency_s: float
    # send/recv's own fixed cost where it differs from call_latency_s (gloo: torch posts them
    # on the caller's thread, not through the process group's worker queue); None = the same
    p2p_call_latency_s: float | None
    local_work: LocalWork  # a rank's own work in gloo's collectives (CPU fabric)
    _routes: dict[tuple[int, int], Route] = field(default_factory=dict, repr=False)
    _route_sets: dict[bytes, Routes] = field(default_factory=dict, repr=False)
    memo: dict[Any, Any] = field(default_factory=dict, repr=False)  # see `memoized`

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def gpu_model(self) -> str | None:
        return self.fabric.gpu

    def node_of(self, gpu: int) -> int:
        return gpu // self.gpus_per_node

    def local_of(self, gpu: int) -> int:
        return gpu % self.gpus_per_node

    def nic_of(self, gpu: int) -> int:
        """The NIC (rail) a GPU uses to leave its node."""
        return self.local_of(gpu) * self.fabric.nics_per_node // self.gpus_per_node

    def gpu_vertex(self, gpu: int) -> str:
        return f"n{self.node_of(gpu)}.gpu{self.local_of(gpu)}"

    def check_gpus(self, gpus: Sequence[int], field_name: str = "group") -> None:
        """Refuse GPU ids outside the cluster (a group larger than the cluster, a bad id)."""
        require(
            len(gpus) <= self.world_size,
            field_name,
            len(gpus),
            f"at most {self.world_size} GPUs (the size of {self.name})",
        )
        array = np.asarray(gpus)
        bad = array[(array < 0) | (array >= self.world_size)].tolist()
        require(not bad, field_name, bad[:3], f"GPU ids in 0..{self.world_size - 1} ({self.name})")
        unique = len(distinct(array)) == len(array)
        require(unique, field_name, list(gpus)[:8], "distinct GPU ids")

    # ---- links ------------------------------------------------------------------------------

    @cached_property
    def link_class(self) -> tuple[LinkClass, ...]:
        """Per edge index: its link class."""
        return tuple(CLASSES[i] for i in self.class_id.tolist())

    @cached_property
    def edges(self) -> tuple[tuple[str, str], ...]:
        """Per edge index: (u, v) vertex names."""
        return tuple(edge_names(self.template, self.fabric, self.nodes))

    @cached_property
    def graph(self) -> nx.DiGraph:
        """The networkx graph (for drawings and summaries); edges carry their index, bandwidth,
        latency and link class, vertices their kind."""
        graph = nx.DiGraph()
        for index, (u, v) in enumerate(self.edges):
            graph.add_edge(
                u,
                v,
                index=index,
                bandwidth_bytes_per_s=float(self.bandwidth_bytes_per_s[index]),
                latency_s=float(self.latency_s[index]),
                link_class=str(CLASSES[int(self.class_id[index])]),
            )
        for vertex in graph.nodes:
            local = vertex.split(".")[-1]
            kind = local.rstrip("0123456789") if local != "nvswitch" else local
            graph.nodes[vertex]["kind"] = {"pcie": "pcie_switch"}.get(kind, kind)
        return graph

    @property
    def edge_count(self) -> int:
        return int(self.bandwidth_bytes_per_s.shape[0])

    @property
    def half_duplex(self) -> npt.NDArray[np.bool_]:
        """Per edge: whether it shares its capacity with the reverse direction."""
        counts = np.bincount(self.resource, minlength=self.edge_count)
        return np.asarray(counts[self.resource] > 1)

    def link_classes(self) -> list[tuple[LinkClass, float, float, bool, int]]:
        """(class, bandwidth, latency, half duplex, edge count) for each distinct kind of link."""
        table = np.stack(
            [
                self.class_id.astype(np.float64),
                self.bandwidth_bytes_per_s,
                self.latency_s,
                self.half_duplex.astype(np.float64),
            ],
            axis=1,
        )
        kinds, first, counts = np.unique(table, axis=0, return_index=True, return_counts=True)
        rows = sorted(zip(first.tolist(), kinds.tolist(), counts.tolist(), strict=True))
        return [
            (CLASSES[int(c)], float(bw), float(lat), bool(half), int(n))
            for _, (c, bw, lat, half), n in rows
        ]

    # ---- routes -----------------------------------------------------------------------------

    @cached_property
    def route_tables(self) -> RouteTables:
        n_template = len(self.template)
        return route_tables(
            self.template,
            self.latency_s[:n_template],
            self.gpus_per_node,
            self.fabric.nics_per_node,
        )

    def routes_of(self, src: IntArray, dst: IntArray) -> Routes:
        """The routes of many flows at once (vectorised: the hot path of big collectives; a
        few flows come from the per-pair cache)."""
        if len(src) <= _FEW_FLOWS:
            return self._few_routes(src, dst)
        return self._many_routes(src, dst)

    def reach(self, members: Sequence[int]) -> IntArray:
        """The capacities (`resource` ids, with repeats) any route between two of `members`
        can draw on: a superset of any collective's on that group (`routing.reach_of`)."""
        found = reach_of(
            np.asarray(members), self.route_tables, self.fabric, self.nodes, len(self.template)
        )
        return self.resource[found]

    def _few_routes(self, src: IntArray, dst: IntArray) -> Routes:
        found = [self.route(int(a), int(b)) for a, b in zip(src, dst, strict=True)]
        lengths = [len(r.links) for r in found]
        links = [r.links for r in found]
        return Routes(
            np.repeat(np.arange(len(found), dtype=np.int64), lengths),
            np.concatenate(links) if links else np.zeros(0, dtype=np.int64),
            np.array([r.latency_s for r in found], dtype=np.float64),
        )

    def _many_routes(self, src: IntArray, dst: IntArray) -> Routes:
        if len(src) < _CACHED_FLOWS:
            return self._routes_now(src, dst)
        key = digest(src, dst)
        found = self._route_sets.get(key)
        if found is None:
            found = self._routes_now(src, dst)
            held = sum(len(r.pair_link) for r in self._route_sets.values())
            while self._route_sets and held + len(found.pair_link) > _CACHED_PAIRS:
                held -= len(self._route_sets.pop(next(iter(self._route_sets))).pair_link)
            self._route_sets[key] = found
        return found

    def _routes_now(self, src: IntArray, dst: IntArray) -> Routes:
        if len(src) > _CHUNK_FLOWS:  # in pieces: the working arrays stay small
            parts = [
                self._routes_now(src[i : i + _CHUNK_FLOWS], dst[i : i + _CHUNK_FLOWS])
                for i in range(0, len(src), _CHUNK_FLOWS)
            ]
            return Routes(
                np.concatenate(
                    [p.pair_flow + i * _CHUNK_FLOWS for i, p in enumerate(parts)]
                ).astype(np.int32),
                np.concatenate([p.pair_link for p in parts]),
                np.concatenate([p.latency_s for p in parts]),
            )
        return routes_of(
            src,
            dst,
            self.route_tables,
            self.fabric,
            self.nodes,
            len(self.template),
            self.latency_s,
        )

    def memoized(self, key: Any, make: Callable[[], T]) -> T:
        """What `make` computes from this topology alone, once per key (a group's rings, the
        fair share of a pattern's flows): every call of a collective on that group, whatever
        its size, shares it. Keys holding arrays use their ids; the value keeps them alive."""
        found = self.memo.get(key)
        if found is None:
            found = self.memo[key] = make()
        return found

    def route(self, src: int, dst: int) -> Route:
        """The path a flow from GPU `src` to GPU `dst` takes (cached)."""
        key = (src, dst)
        found = self._routes.get(key)
        if found is None:
            found = self._routes[key] = self._build_route(src, dst)
        return found

    def routes(self, pairs: Iterable[tuple[int, int]]) -> list[Route]:
        """`route` for many (src, dst) pairs."""
        return [self.route(*pair) for pair in pairs]

    def _build_route(self, src: int, dst: int) -> Route:
        found = self._routes_now(np.array([src]), np.array([dst]))
        links = found.pair_link.astype(np.int64)
        links.flags.writeable = False
        return Route(links, float(found.latency_s[0]))


def build_topology(name: str, fabric: FabricSpec, nodes: int, gpus_per_node: int) -> Topology:
    """`nodes` nodes of `gpus_per_node` GPUs of this fabric (at most `MAX_GPUS` in all)."""
    positive_int("nodes", nodes)
    require(
        gpus_per_node in fabric.gpus_per_node,
        "gpus_per_node",
        gpus_per_node,
        f"one of {list(fabric.gpus_per_node)} for fabric {fabric.name}",
    )
    check_size(name, nodes * gpus_per_node)
    template = node_template(fabric, gpus_per_node)
    arrays = edge_arrays(template, fabric, nodes)
    return Topology(
        name=name,
        fabric=fabric,
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        template=template,
        bandwidth_bytes_per_s=arrays.bandwidth_bytes_per_s,
        latency_s=arrays.latency_s,
        class_id=arrays.class_id,
        resource=arrays.resource,
        call_latency_s=fabric.call_latency_s,
        p2p_call_latency_s=None,
        local_work=fabric.local_work,
    )


def without_nccl_effects(topo: Topology, protocols: bool, nvlink_rate: bool) -> Topology:
    """`topo` with NCCL's protocol model (`protocols`) and its NVLink rate (`nvlink_rate`)
    switched off where asked: an ablation (zsim.workload.mechanisms)."""
    fabric = topo.fabric
    if protocols:
        fabric = replace(fabric, protocol="ideal")
    if nvlink_rate and fabric.nvlinks_per_gpu is not None:
        fabric = replace(fabric, nvlinks_per_gpu=None)
        return replace(
            build_topology(topo.name, fabric, topo.nodes, topo.gpus_per_node),
            call_latency_s=topo.call_latency_s,
            p2p_call_latency_s=topo.p2p_call_latency_s,
            local_work=topo.local_work,
        )
    return topo if fabric is topo.fabric else replace(topo, fabric=fabric, memo={})  # plans differ


def with_slower_links(topo: Topology, factor: float) -> Topology:
    """`topo` with every link at 1 / `factor` of its bandwidth: a what-if (the planner's
    question whether its pick holds if the network delivers less than modelled), not a
    model of any cluster."""
    ok = 1.0 <= factor < float("inf")
    require(ok, "slower_links", factor, "a finite factor >= 1 (1: the links as modelled)")
    if factor == 1.0:
        return topo
    slower = topo.bandwidth_bytes_per_s / factor
    return replace(topo, bandwidth_bytes_per_s=slower, _routes={}, _route_sets={}, memo={})


def check_size(name: str, gpus: int) -> None:
    require(
        gpus <= MAX_GPUS,
        "topology",
        name,
        f"at most {MAX_GPUS:,} GPUs ({gpus:,} asked): the largest cluster zsim simulates",
    )
