"""The cluster as a graph: GPUs, NVSwitch/PCIe/host, NICs, leaf and spine switches; routes.

Every edge is directed (a link per direction) and carries `bandwidth_bytes_per_s`, `latency_s`
and `link_class`. Edges are also numbered, node by node in the same order, then the fabric, so
that a route is an array of edge indices the flow network can use directly. Each edge draws on
one capacity, `resource[edge]`: its own, or for a half-duplex pair (a CPU rank's loopback TCP
stack, whose sends and receives share one core) the pair's first edge, so flows into and out of
that rank share one capacity.

Routing, and why:
- inside a node, the least-latency path (NVLink through the NVSwitch when there is one, else
  the PCIe tree or the host's loopback), found once on a template node and shifted by index;
- between nodes, GPU i leaves through its rail's NIC (i * nics // G: with one NIC per GPU,
  GPU i uses NIC i), crosses its leaf, the spine when the two NICs sit on different leaves,
  and the destination's leaf and NIC.
The spine layer is one aggregated vertex: each leaf's uplink carries
`leaf_ports * nic_rate / oversubscription`. That assumes ECMP / adaptive routing spreads
flows evenly over the spine switches (a fluid model), so hash collisions are not modelled.

Ranks map to GPUs one to one (rank r on GPU r: launchers fill nodes in order), and process
groups come from one (dp, pp, tp) grid with TP innermost, so TP groups stay inside a node:
by default DeepSpeed's order, rank = (pp_i * dp + dp_i) * tp + tp_i
(`PipeModelDataParallelTopology(axes=['pipe', 'data', 'model'])`, also Megatron's default),
or picotron's, rank = (dp_i * pp + pp_i) * tp + tp_i (`arange(world).view(dp, pp, tp)`).
The two agree when pp = 1.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from itertools import pairwise
from typing import Any

import networkx as nx
import numpy as np
import numpy.typing as npt

from zsim.errors import InputError, positive_int, require
from zsim.fabric import Backend, FabricSpec, LinkClass, LinkSpec, LocalWork, NicAttach

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True, eq=False)
class Route:
    """A path between two GPUs: edge indices in order, and the sum of their latencies."""

    links: IntArray
    latency_s: float


@dataclass(frozen=True)
class _Edge:
    u: str
    v: str
    link: LinkSpec
    link_class: LinkClass


@dataclass(frozen=True, eq=False)
class Topology:
    """A built cluster. Treat every field as read-only (use `with_link_class` to change)."""

    name: str
    fabric: FabricSpec
    nodes: int
    gpus_per_node: int
    graph: nx.DiGraph
    edges: tuple[tuple[str, str], ...]
    link_class: tuple[LinkClass, ...]  # per edge index
    bandwidth_bytes_per_s: FloatArray  # per edge index
    latency_s: FloatArray  # per edge index
    resource: IntArray  # per edge index: the edge whose capacity it draws on (see module doc)
    call_latency_s: float
    # send/recv's own fixed cost where it differs from call_latency_s (gloo: torch posts them
    # on the caller's thread, not through the process group's worker queue); None = the same
    p2p_call_latency_s: float | None
    local_work: LocalWork  # a rank's own work in gloo's collectives (CPU fabric)
    _template: nx.DiGraph = field(repr=False)  # node 0, local names, edges carry `index`
    _node_routes: dict[str, dict[str, list[int]]] = field(default_factory=dict, repr=False)
    _routes: dict[tuple[int, int], Route] = field(default_factory=dict, repr=False)

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
        bad = [g for g in gpus if not 0 <= g < self.world_size]
        require(not bad, field_name, bad[:3], f"GPU ids in 0..{self.world_size - 1} ({self.name})")
        require(len(set(gpus)) == len(gpus), field_name, list(gpus)[:8], "distinct GPU ids")

    def route(self, src: int, dst: int) -> Route:
        """The path a flow from GPU `src` to GPU `dst` takes (cached)."""
        key = (src, dst)
        found = self._routes.get(key)
        if found is None:
            found = self._build_route(src, dst)
            self._routes[key] = found
        return found

    def routes(self, pairs: Iterable[tuple[int, int]]) -> list[Route]:
        """`route` for many (src, dst) pairs at once (the hot path of big collectives)."""
        cache, build = self._routes, self._build_route
        out = []
        for pair in pairs:
            found = cache.get(pair)
            if found is None:
                found = cache[pair] = build(*pair)
            out.append(found)
        return out

    def _build_route(self, src: int, dst: int) -> Route:
        if src == dst:
            return Route(np.zeros(0, dtype=np.int64), 0.0)
        node_a, node_b = self.node_of(src), self.node_of(dst)
        if node_a == node_b:
            links = self._in_node(node_a, f"gpu{self.local_of(src)}", f"gpu{self.local_of(dst)}")
        else:
            nic_a, nic_b = self.nic_of(src), self.nic_of(dst)
            links = (
                self._in_node(node_a, f"gpu{self.local_of(src)}", f"nic{nic_a}")
                + self._across(node_a, nic_a, node_b, nic_b)
                + self._in_node(node_b, f"nic{nic_b}", f"gpu{self.local_of(dst)}")
            )
        array = np.array(links, dtype=np.int64)
        array.flags.writeable = False
        return Route(array, float(self.latency_s[array].sum()))

    def _in_node(self, node: int, src: str, dst: str) -> list[int]:
        if src not in self._node_routes:
            self._node_routes[src] = _template_routes(self, src)
        offset = node * self._template.number_of_edges()
        return [offset + e for e in self._node_routes[src][dst]]

    def _across(self, node_a: int, nic_a: int, node_b: int, nic_b: int) -> list[int]:
        base = self.nodes * self._template.number_of_edges()
        nics = self.fabric.nics_per_node
        up = base + 2 * (node_a * nics + nic_a)
        down = base + 2 * (node_b * nics + nic_b) + 1
        leaf_a = _leaf(self.fabric, self.nodes, node_a, nic_a)
        leaf_b = _leaf(self.fabric, self.nodes, node_b, nic_b)
        if leaf_a == leaf_b:
            return [up, down]
        spine = base + 2 * self.nodes * nics
        return [up, spine + 2 * leaf_a, spine + 2 * leaf_b + 1, down]

    @property
    def half_duplex(self) -> npt.NDArray[np.bool_]:
        """Per edge: whether it shares its capacity with the reverse direction."""
        counts = np.bincount(self.resource, minlength=len(self.edges))
        return np.asarray(counts[self.resource] > 1)

    def link_classes(self) -> list[tuple[LinkClass, float, float, bool, int]]:
        """(class, bandwidth, latency, half duplex, edge count) for each distinct kind of link."""
        seen: dict[tuple[LinkClass, float, float, bool], int] = {}
        for cls, bw, lat, half in zip(
            self.link_class,
            self.bandwidth_bytes_per_s,
            self.latency_s,
            self.half_duplex.tolist(),
            strict=True,
        ):
            key = (cls, float(bw), float(lat), bool(half))
            seen[key] = seen.get(key, 0) + 1
        return [(c, b, lat, half, n) for (c, b, lat, half), n in seen.items()]


# ---- building ----------------------------------------------------------------------------


def build_topology(name: str, fabric: FabricSpec, nodes: int, gpus_per_node: int) -> Topology:
    """The graph of `nodes` nodes of `gpus_per_node` GPUs of this fabric."""
    positive_int("nodes", nodes)
    require(
        gpus_per_node in fabric.gpus_per_node,
        "gpus_per_node",
        gpus_per_node,
        f"one of {list(fabric.gpus_per_node)} for fabric {fabric.name}",
    )
    template = _node_template(fabric, gpus_per_node)
    edges = [
        _Edge(f"n{k}.{e.u}", f"n{k}.{e.v}", e.link, e.link_class)
        for k in range(nodes)
        for e in template
    ]
    edges += _fabric_edges(fabric, nodes)
    graph = nx.DiGraph()
    for index, e in enumerate(edges):
        graph.add_edge(
            e.u,
            e.v,
            index=index,
            bandwidth_bytes_per_s=e.link.bandwidth_bytes_per_s,
            latency_s=e.link.latency_s,
            link_class=str(e.link_class),
        )
    _label_vertices(graph)
    bandwidth = np.array([e.link.bandwidth_bytes_per_s for e in edges], dtype=np.float64)
    latency = np.array([e.link.latency_s for e in edges], dtype=np.float64)
    resource = _resources(edges)
    for array in (bandwidth, latency, resource):
        array.flags.writeable = False
    return Topology(
        name=name,
        fabric=fabric,
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        graph=graph,
        edges=tuple((e.u, e.v) for e in edges),
        link_class=tuple(e.link_class for e in edges),
        bandwidth_bytes_per_s=bandwidth,
        latency_s=latency,
        resource=resource,
        call_latency_s=fabric.call_latency_s,
        p2p_call_latency_s=None,
        local_work=fabric.local_work,
        _template=_template_graph(template),
    )


def _resources(edges: Sequence[_Edge]) -> IntArray:
    """Each edge's capacity: its own, or, for the second edge of a half-duplex pair (`_both`
    lists u->v then v->u), the first one's."""
    resource = np.arange(len(edges), dtype=np.int64)
    for i in range(1, len(edges)):
        a, b = edges[i - 1], edges[i]
        if b.link.half_duplex and (b.u, b.v) == (a.v, a.u) and b.link == a.link:
            resource[i] = i - 1
    return resource


def _both(u: str, v: str, link: LinkSpec, cls: LinkClass) -> list[_Edge]:
    return [_Edge(u, v, link, cls), _Edge(v, u, link, cls)]


def _node_template(fabric: FabricSpec, gpus: int) -> list[_Edge]:
    """The edges of node 0, with node-local vertex names (gpu0, nvswitch, pcie0, host, nic0)."""
    edges: list[_Edge] = []
    if fabric.nvswitch is not None:
        for i in range(gpus):
            edges += _both(f"gpu{i}", "nvswitch", fabric.nvswitch, LinkClass.NVLINK)
    if fabric.loopback is not None:
        for i in range(gpus):
            edges += _both(f"gpu{i}", "host", fabric.loopback, LinkClass.LOOPBACK)
    if fabric.pcie is not None:
        switches = math.ceil(gpus / fabric.gpus_per_pcie_switch)
        for i in range(gpus):
            edges += _both(f"gpu{i}", _pcie_switch(fabric, i), fabric.pcie, LinkClass.PCIE)
        for s in range(switches):
            edges += _both(f"pcie{s}", "host", fabric.pcie, LinkClass.PCIE)
    for j in range(fabric.nics_per_node):
        edges += _nic_attachment(fabric, gpus, j)
    return edges


def _pcie_switch(fabric: FabricSpec, local_gpu: int) -> str:
    return f"pcie{local_gpu // fabric.gpus_per_pcie_switch}"


def _nic_attachment(fabric: FabricSpec, gpus: int, nic: int) -> list[_Edge]:
    """NIC j hangs off its rail GPU's PCIe switch, or off the host (root port / net stack)."""
    if fabric.nic_attach is NicAttach.PCIE_SWITCH and fabric.pcie is not None:
        rail_gpu = min(gpus - 1, nic * gpus // fabric.nics_per_node)
        return _both(f"nic{nic}", _pcie_switch(fabric, rail_gpu), fabric.pcie, LinkClass.PCIE)
    return _both(f"nic{nic}", "host", *_host_link(fabric))


def _host_link(fabric: FabricSpec) -> tuple[LinkSpec, LinkClass]:
    """The link to the host: PCIe on a GPU server, loopback on the CPU fabric (full duplex:
    the host's side of the veth is no rank's core; a rank's own link carries its CPU cost)."""
    if fabric.pcie is not None:
        return fabric.pcie, LinkClass.PCIE
    if fabric.loopback is not None:
        return replace(fabric.loopback, half_duplex=False), LinkClass.LOOPBACK
    raise InputError(fabric.name, "no pcie or loopback", "a node with a host link")


def _leaves(fabric: FabricSpec, nodes: int) -> int:
    if fabric.rail_optimized:
        return fabric.nics_per_node * math.ceil(nodes / fabric.leaf_ports)
    return math.ceil(nodes * fabric.nics_per_node / fabric.leaf_ports)


def _leaf(fabric: FabricSpec, nodes: int, node: int, nic: int) -> int:
    """Rail-optimized: NIC j of every node on rail j's leaves; else NICs fill leaves in order."""
    if fabric.rail_optimized:
        per_rail = math.ceil(nodes / fabric.leaf_ports)
        return nic * per_rail + node // fabric.leaf_ports
    return (node * fabric.nics_per_node + nic) // fabric.leaf_ports


def _fabric_edges(fabric: FabricSpec, nodes: int) -> list[_Edge]:
    """NIC <-> leaf for every NIC (node-major), then leaf <-> spine for every leaf."""
    edges: list[_Edge] = []
    for k in range(nodes):
        for j in range(fabric.nics_per_node):
            leaf_vertex = f"leaf{_leaf(fabric, nodes, k, j)}"
            edges += _both(f"n{k}.nic{j}", leaf_vertex, fabric.nic, fabric.nic_class)
    leaves = _leaves(fabric, nodes)
    if leaves > 1:
        uplink = fabric.leaf_ports * fabric.nic.bandwidth_bytes_per_s / fabric.oversubscription
        link = LinkSpec(uplink, fabric.switch_latency_s)
        for leaf in range(leaves):
            edges += _both(f"leaf{leaf}", "spine", link, fabric.nic_class)
    return edges


def _label_vertices(graph: nx.DiGraph) -> None:
    for vertex in graph.nodes:
        local = vertex.split(".")[-1]
        kind = local.rstrip("0123456789") if local != "nvswitch" else local
        graph.nodes[vertex]["kind"] = {"pcie": "pcie_switch"}.get(kind, kind)


def _template_graph(template: list[_Edge]) -> nx.DiGraph:
    graph = nx.DiGraph()
    for index, e in enumerate(template):
        graph.add_edge(e.u, e.v, index=index)
    return graph


def _template_routes(topo: Topology, src: str) -> dict[str, list[int]]:
    """Least-latency paths from one vertex of node 0 to all others (hop count breaks ties),
    as template edge indices; one Dijkstra per source."""
    latency = topo.latency_s

    def weight(_u: str, _v: str, data: dict[str, Any]) -> float:
        return float(latency[data["index"]]) + 1e-12

    paths = nx.single_source_dijkstra_path(topo._template, src, weight=weight)
    return {
        dst: [int(topo._template.edges[u, v]["index"]) for u, v in pairwise(path)]
        for dst, path in paths.items()
    }


# ---- calibrated overrides ---------------------------------------------------------------


def with_link_class(
    topo: Topology,
    link_class: LinkClass,
    *,
    bandwidth_bytes_per_s: float | None = None,
    latency_s: float | None = None,
) -> Topology:
    """A copy where every edge of `link_class` has the given bandwidth and/or latency.

    This is how a calibrated profile replaces spec-sheet numbers with measured ones.
    """
    require(
        bandwidth_bytes_per_s is None or bandwidth_bytes_per_s > 0,
        f"{link_class} bandwidth",
        bandwidth_bytes_per_s,
        "a positive number of bytes/s",
    )
    require(latency_s is None or latency_s >= 0, f"{link_class} latency", latency_s, ">= 0 s")
    mask = np.array([c is link_class for c in topo.link_class], dtype=bool)
    bandwidth = topo.bandwidth_bytes_per_s.copy()
    latency = topo.latency_s.copy()
    if bandwidth_bytes_per_s is not None:
        bandwidth[mask] = bandwidth_bytes_per_s
    if latency_s is not None:
        latency[mask] = latency_s
    bandwidth.flags.writeable = False
    latency.flags.writeable = False
    graph = topo.graph.copy()
    for (u, v), bw, lat in zip(topo.edges, bandwidth, latency, strict=True):
        graph.edges[u, v].update(bandwidth_bytes_per_s=float(bw), latency_s=float(lat))
    return replace(
        topo,
        graph=graph,
        bandwidth_bytes_per_s=bandwidth,
        latency_s=latency,
        _node_routes={},
        _routes={},
    )


def with_call_latency(
    topo: Topology, call_latency_s: float, p2p_call_latency_s: float | None = None
) -> Topology:
    """A copy with a measured per-call collective latency and, when given, send/recv's own."""
    require(call_latency_s >= 0, "call latency", call_latency_s, ">= 0 s")
    p2p = p2p_call_latency_s
    require(p2p is None or p2p >= 0, "send/recv call latency", p2p, ">= 0 s")
    return replace(
        topo,
        call_latency_s=call_latency_s,
        p2p_call_latency_s=p2p,
        _node_routes={},
        _routes={},
    )


def with_local_work(
    topo: Topology,
    op_s_per_byte: Mapping[str, float] | None = None,
    op_call_s: Mapping[str, float] | None = None,
    **rates: float,
) -> Topology:
    """A copy whose ranks' local work has the given fields of `LocalWork` (calibrated rates),
    and, when given, the ops' own costs per byte and per call (`LocalWork.op_s_per_byte`,
    `LocalWork.op_call_s`, each replaced whole)."""
    for key, value in rates.items():
        if key == "message_s":
            require(value >= 0, "local work message_s", value, ">= 0 s")
        else:
            require(value > 0, f"local work {key}", value, "> 0 bytes/s")
    fields: dict[str, Any] = dict(rates)  # the float fields of LocalWork
    work = replace(topo.local_work, **fields)
    if op_s_per_byte is not None:
        for op, value in op_s_per_byte.items():
            require(value >= 0, f"local work op_s_per_byte.{op}", value, ">= 0 s per byte")
        work = replace(work, op_s_per_byte=dict(op_s_per_byte))
    if op_call_s is not None:
        for op, value in op_call_s.items():
            require(value >= 0, f"local work op_call_s.{op}", value, ">= 0 s")
        work = replace(work, op_call_s=dict(op_call_s))
    return replace(topo, local_work=work, _node_routes={}, _routes={})


# ---- ranks and process groups -----------------------------------------------------------


class RankOrder(StrEnum):
    """How (dp, pp, tp) coordinates become a rank; axes listed outermost first."""

    PP_DP_TP = "pp-dp-tp"
    """DeepSpeed's PipeModelDataParallelTopology and Megatron's default: rank =
    (pp_i * dp + dp_i) * tp + tp_i."""
    DP_PP_TP = "dp-pp-tp"
    """picotron's grid arange(world).view(dp, pp, tp): rank = (dp_i * pp + pp_i) * tp + tp_i."""


class GroupKind(StrEnum):
    TP = "tp"
    DP = "dp"
    PP = "pp"
    WORLD = "world"


@dataclass(frozen=True)
class RankGrid:
    """The (dp, pp, tp) layout of one job."""

    dp: int = 1
    pp: int = 1
    tp: int = 1
    order: RankOrder = RankOrder.PP_DP_TP

    def __post_init__(self) -> None:
        for name in ("dp", "pp", "tp"):
            positive_int(name, getattr(self, name))

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    def rank(self, dp_i: int, pp_i: int, tp_i: int) -> int:
        if self.order is RankOrder.PP_DP_TP:
            return (pp_i * self.dp + dp_i) * self.tp + tp_i
        return (dp_i * self.pp + pp_i) * self.tp + tp_i

    def groups(self, kind: GroupKind) -> tuple[tuple[int, ...], ...]:
        """Every group of one kind as rank tuples (members in group-rank order), ordered by
        their first rank."""
        if kind is GroupKind.WORLD:
            return (tuple(range(self.world_size)),)
        groups = (tuple(self._members(kind, a, b)) for a, b in self._others(kind))
        return tuple(sorted(groups))

    def _others(self, kind: GroupKind) -> Iterator[tuple[int, int]]:
        sizes = {GroupKind.TP: (self.dp, self.pp), GroupKind.DP: (self.pp, self.tp)}
        first, second = sizes.get(kind, (self.dp, self.tp))
        for a in range(first):
            for b in range(second):
                yield a, b

    def _members(self, kind: GroupKind, a: int, b: int) -> Iterator[int]:
        if kind is GroupKind.TP:
            return (self.rank(a, b, t) for t in range(self.tp))
        if kind is GroupKind.DP:
            return (self.rank(d, a, b) for d in range(self.dp))
        return (self.rank(a, p, b) for p in range(self.pp))


def process_groups(topo: Topology, grid: RankGrid, kind: GroupKind) -> tuple[tuple[int, ...], ...]:
    """The GPU ids of every `kind` group of `grid` placed on `topo` (rank r on GPU r)."""
    if grid.world_size > topo.world_size:
        raise InputError(
            "layout",
            f"dp={grid.dp} x pp={grid.pp} x tp={grid.tp} = {grid.world_size} GPUs",
            f"at most {topo.world_size} GPUs (the size of {topo.name})",
        )
    return grid.groups(kind)


def describe(topo: Topology) -> dict[str, Any]:
    """A JSON-ready summary: counts, each link class with its numbers, and on a gloo fabric
    its ranks' local work."""
    gloo = topo.fabric.backend is Backend.GLOO
    kinds: dict[str, int] = {}
    for _, data in topo.graph.nodes(data=True):
        kinds[data["kind"]] = kinds.get(data["kind"], 0) + 1
    return {
        "name": topo.name,
        "fabric": topo.fabric.name,
        "description": topo.fabric.description,
        "gpu": topo.gpu_model,
        "backend": str(topo.fabric.backend),
        "nodes": topo.nodes,
        "gpus_per_node": topo.gpus_per_node,
        "gpus": topo.world_size,
        "vertices": kinds,
        "rail_optimized": topo.fabric.rail_optimized,
        "oversubscription": topo.fabric.oversubscription,
        "call_latency_us": round(topo.call_latency_s * 1e6, 6),
        **(
            {"p2p_call_latency_us": round(topo.p2p_call_latency_s * 1e6, 6)}
            if topo.p2p_call_latency_s is not None
            else {}
        ),
        "links": [
            {
                "class": str(cls),
                "bandwidth_GBps": round(bw / 1e9, 9),
                "latency_us": round(lat * 1e6, 6),
                "duplex": "half" if half else "full",
                "directed_edges": count,
            }
            for cls, bw, lat, half, count in topo.link_classes()
        ],
        **({"local_work": _local_work_summary(topo.local_work)} if gloo else {}),
    }


def _local_work_summary(work: LocalWork) -> dict[str, Any]:
    out: dict[str, Any] = {
        "message_us": round(work.message_s * 1e6, 6),
        "copy_GBps": round(work.copy_bytes_per_s / 1e9, 9),
        "reduce_GBps": round(work.reduce_bytes_per_s / 1e9, 9),
        "first_touch_GBps": round(work.first_touch_bytes_per_s / 1e9, 9),
        "fresh_above_bytes": work.fresh_above_bytes,
    }
    if work.op_s_per_byte:
        out["op_ns_per_byte"] = {
            str(op): round(v * 1e9, 9) for op, v in sorted(work.op_s_per_byte.items())
        }
    if work.op_call_s:
        out["op_call_us"] = {str(op): round(v * 1e6, 6) for op, v in sorted(work.op_call_s.items())}
    return out
