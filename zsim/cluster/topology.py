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

Ranks map to GPUs one to one (rank r on GPU r: launchers fill nodes in order); the process
groups of a layout are in `zsim.cluster.grid`, a profile's measured links in
`zsim.cluster.calibrated`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from itertools import pairwise
from typing import Any

import networkx as nx
import numpy as np
import numpy.typing as npt

from zsim.cluster.fabric import FabricSpec, LinkClass, LinkSpec, LocalWork, NicAttach
from zsim.errors import InputError, positive_int, require

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
