"""Building a cluster from a fabric: node 0's edges (a template every node repeats) and the
network's edges (NIC <-> leaf, leaf <-> spine), as arrays, in the order that numbers them.

Edges are numbered node by node (each node's template edges, in template order), then every NIC's
two edges to its leaf (node-major), then every leaf's two edges to the spine. Every number the
simulator uses comes from these arrays; vertex names and the networkx graph are made only when
asked for (a drawing, a summary), so a cluster of 100,000 GPUs costs arrays, not objects.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from zsim.cluster.fabric import Backend, FabricSpec, LinkClass, LinkSpec, NicAttach
from zsim.cluster.nvlink import nccl_link
from zsim.errors import InputError

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
Ints = npt.NDArray[np.integer[Any]]  # (flow, edge) pairs: int32 where they may be many

CLASSES: tuple[LinkClass, ...] = tuple(LinkClass)
"""Link classes by id (`Topology.class_id`)."""


def digest(*arrays: npt.NDArray[Any]) -> bytes:
    """A key for arrays by their contents (a 16-byte BLAKE2 digest of their dtypes, shapes and
    bytes), which does not keep a copy of them as a bytes key would."""
    h = hashlib.blake2b(digest_size=16)
    for a in arrays:
        h.update(str((a.dtype, a.shape)).encode())
        h.update(np.ascontiguousarray(a).data)
    return h.digest()


def distinct(ids: Ints) -> IntArray:
    """The sorted distinct values of an array of ids (GPUs, edges, capacities: non-negative
    integers), as `np.unique` gives them; by counting where the ids are dense (numpy's hashing
    unique took 57 ms per million ids here, counting 1 ms), as `np.unique` where they are few
    against their range (counting costs the range)."""
    return distinct_counts(ids)[0]


def distinct_counts(ids: Ints) -> tuple[IntArray, IntArray]:
    """`distinct(ids)` and how often each occurs (`np.unique(..., return_counts=True)`)."""
    if not ids.size:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    flat = ids.ravel()
    if _sparse(flat):
        values, counts = np.unique(flat, return_counts=True)
        return values.astype(np.int64, copy=False), counts
    counts = np.bincount(flat)
    present = np.flatnonzero(counts)
    return present, counts[present]


def distinct_inverse(ids: Ints) -> tuple[IntArray, IntArray]:
    """`distinct(ids)` and each id's position in it (`np.unique(..., return_inverse=True)`),
    by counting where the ids are dense, by sorting where they are few against their range."""
    flat = ids.ravel()
    if not flat.size or _sparse(flat):
        values, inverse = np.unique(flat, return_inverse=True)
        return values.astype(np.int64, copy=False), inverse.astype(np.int64, copy=False)
    present = np.bincount(flat) > 0
    return np.flatnonzero(present), (np.cumsum(present) - 1)[flat]


def _sparse(flat: Ints) -> bool:
    """Whether ids are few against their range, so sorting them beats counting the range."""
    return int(flat.max()) > _DENSE * flat.size + 4096


_DENSE = 8  # ids counted when their range is at most this many times their number


@dataclass(frozen=True)
class Edge:
    """One directed edge of node 0's template (local vertex names) or of the network."""

    u: str
    v: str
    link: LinkSpec
    link_class: LinkClass


def both(u: str, v: str, link: LinkSpec, cls: LinkClass) -> list[Edge]:
    return [Edge(u, v, link, cls), Edge(v, u, link, cls)]


def node_template(fabric: FabricSpec, gpus: int) -> tuple[Edge, ...]:
    """The edges of node 0, with node-local vertex names (gpu0, nvswitch, pcie0, host, nic0)."""
    edges: list[Edge] = []
    if fabric.nvswitch is not None:
        nvlink = _nvlink(fabric)
        for i in range(gpus):
            edges += both(f"gpu{i}", "nvswitch", nvlink, LinkClass.NVLINK)
    if fabric.loopback is not None:
        for i in range(gpus):
            edges += both(f"gpu{i}", "host", fabric.loopback, LinkClass.LOOPBACK)
    if fabric.pcie is not None:
        switches = math.ceil(gpus / fabric.gpus_per_pcie_switch)
        for i in range(gpus):
            edges += both(f"gpu{i}", pcie_switch(fabric, i), fabric.pcie, LinkClass.PCIE)
        for s in range(switches):
            edges += both(f"pcie{s}", "host", fabric.pcie, LinkClass.PCIE)
    for j in range(fabric.nics_per_node):
        edges += _nic_attachment(fabric, gpus, j)
    return tuple(edges)


def _nvlink(fabric: FabricSpec) -> LinkSpec:
    """A GPU's edge to the NVSwitch plane: at NCCL's rate where the backend is NCCL and the
    fabric names its NVLink count (`zsim.cluster.nvlink`), else at the line rate."""
    assert fabric.nvswitch is not None
    if fabric.backend is not Backend.NCCL:
        return fabric.nvswitch
    return nccl_link(fabric.nvswitch, fabric.gpu, fabric.nvlinks_per_gpu)


def pcie_switch(fabric: FabricSpec, local_gpu: int) -> str:
    return f"pcie{local_gpu // fabric.gpus_per_pcie_switch}"


def _nic_attachment(fabric: FabricSpec, gpus: int, nic: int) -> list[Edge]:
    """NIC j hangs off its rail GPU's PCIe switch, or off the host (root port / net stack)."""
    if fabric.nic_attach is NicAttach.PCIE_SWITCH and fabric.pcie is not None:
        rail_gpu = min(gpus - 1, nic * gpus // fabric.nics_per_node)
        return both(f"nic{nic}", pcie_switch(fabric, rail_gpu), fabric.pcie, LinkClass.PCIE)
    return both(f"nic{nic}", "host", *_host_link(fabric))


def _host_link(fabric: FabricSpec) -> tuple[LinkSpec, LinkClass]:
    """The link to the host: PCIe on a GPU server, loopback on the CPU fabric (full duplex:
    the host's side of the veth is no rank's core; a rank's own link carries its CPU cost)."""
    if fabric.pcie is not None:
        return fabric.pcie, LinkClass.PCIE
    if fabric.loopback is not None:
        return replace(fabric.loopback, half_duplex=False), LinkClass.LOOPBACK
    raise InputError(fabric.name, "no pcie or loopback", "a node with a host link")


def leaves(fabric: FabricSpec, nodes: int) -> int:
    if fabric.rail_optimized:
        return fabric.nics_per_node * math.ceil(nodes / fabric.leaf_ports)
    return math.ceil(nodes * fabric.nics_per_node / fabric.leaf_ports)


def leaf_of(fabric: FabricSpec, nodes: int, node: IntArray, nic: IntArray) -> IntArray:
    """Rail-optimized: NIC j of every node on rail j's leaves; else NICs fill leaves in order."""
    if fabric.rail_optimized:
        per_rail = math.ceil(nodes / fabric.leaf_ports)
        return np.asarray(nic * per_rail + node // fabric.leaf_ports, dtype=np.int64)
    return np.asarray((node * fabric.nics_per_node + nic) // fabric.leaf_ports, dtype=np.int64)


def spine_uplink(fabric: FabricSpec) -> LinkSpec:
    """Each leaf's aggregated uplink: its ports' NIC rate over the oversubscription."""
    uplink = fabric.leaf_ports * fabric.nic.bandwidth_bytes_per_s / fabric.oversubscription
    return LinkSpec(uplink, fabric.switch_latency_s)


@dataclass(frozen=True)
class EdgeArrays:
    """Per edge index: bandwidth (bytes/s per direction), latency (s), link class id, and the
    edge whose capacity it draws on (itself, or for the second edge of a half-duplex pair, the
    first one's: a CPU rank's loopback TCP stack, whose sends and receives share one core)."""

    bandwidth_bytes_per_s: FloatArray
    latency_s: FloatArray
    class_id: IntArray
    resource: IntArray


def edge_arrays(template: tuple[Edge, ...], fabric: FabricSpec, nodes: int) -> EdgeArrays:
    """The arrays of every edge: node 0's template tiled over the nodes, then the network."""
    count = len(template)
    bw = np.array([e.link.bandwidth_bytes_per_s for e in template], dtype=np.float64)
    lat = np.array([e.link.latency_s for e in template], dtype=np.float64)
    cls = np.array([CLASSES.index(e.link_class) for e in template], dtype=np.int64)
    res = _template_resources(template)
    nics, n_leaves = nodes * fabric.nics_per_node, leaves(fabric, nodes)
    spine = spine_uplink(fabric) if n_leaves > 1 else None
    net_bw = [np.full(2 * nics, fabric.nic.bandwidth_bytes_per_s)]
    net_lat = [np.full(2 * nics, fabric.nic.latency_s)]
    if spine is not None:
        net_bw.append(np.full(2 * n_leaves, spine.bandwidth_bytes_per_s))
        net_lat.append(np.full(2 * n_leaves, spine.latency_s))
    net = int(sum(len(a) for a in net_bw))
    offsets = np.repeat(np.arange(nodes, dtype=np.int64) * count, count)
    arrays = EdgeArrays(
        np.concatenate([np.tile(bw, nodes), *net_bw]),
        np.concatenate([np.tile(lat, nodes), *net_lat]),
        np.concatenate(
            [np.tile(cls, nodes), np.full(net, CLASSES.index(fabric.nic_class), dtype=np.int64)]
        ),
        np.concatenate(
            [np.tile(res, nodes) + offsets, nodes * count + np.arange(net, dtype=np.int64)]
        ),
    )
    for array in vars(arrays).values():
        array.flags.writeable = False
    return arrays


def _template_resources(template: tuple[Edge, ...]) -> IntArray:
    """Within node 0: a half-duplex pair's second edge (`both` lists u->v then v->u) draws on
    the first one's capacity."""
    resource = np.arange(len(template), dtype=np.int64)
    for i in range(1, len(template)):
        a, b = template[i - 1], template[i]
        if b.link.half_duplex and (b.u, b.v) == (a.v, a.u) and b.link == a.link:
            resource[i] = i - 1
    return resource


def edge_names(template: tuple[Edge, ...], fabric: FabricSpec, nodes: int) -> list[tuple[str, str]]:
    """(u, v) vertex names of every edge, in edge order (for drawings and summaries)."""
    names = [(f"n{k}.{e.u}", f"n{k}.{e.v}") for k in range(nodes) for e in template]
    node = np.repeat(np.arange(nodes), fabric.nics_per_node)
    nic = np.tile(np.arange(fabric.nics_per_node), nodes)
    for k, j, leaf in zip(
        node.tolist(), nic.tolist(), leaf_of(fabric, nodes, node, nic).tolist(), strict=True
    ):
        names += [(f"n{k}.nic{j}", f"leaf{leaf}"), (f"leaf{leaf}", f"n{k}.nic{j}")]
    if leaves(fabric, nodes) > 1:
        for leaf in range(leaves(fabric, nodes)):
            names += [(f"leaf{leaf}", "spine"), ("spine", f"leaf{leaf}")]
    return names
