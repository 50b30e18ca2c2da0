"""How NCCL performs each collective (v2.30; derivation and sources in docs/collectives.md).

- ring: per channel a ring through every member. all_reduce is 2(n-1) steps of S/n per rank,
  all_gather and reduce_scatter n-1 steps; broadcast and reduce a pipelined chain from (to) the
  root in 512 KiB chunks. Across nodes there is one channel per member slot of a node: channel
  c enters and leaves every node on one rail (walking nodes alternately forwards and
  backwards), so each ring crosses every node boundary once and a node's NICs share the
  inter-node traffic, as NCCL's rings do. A fabric whose `backend.ring_channels` is N > 0
  has N channels on one path instead (each node entered at its first member, left at its
  last), as NCCL 2.10 built them on Jean Zay's Omni-Path nodes.
- tree (all_reduce only): a chain inside each node, NCCL's double binary tree across nodes
  (src/graph/trees.cc; tree 1 mirrors tree 0 for an even node count, shifts it for odd); each
  tree carries half the data; reduce-up and broadcast-down run pipelined at once.
- hierarchical: an intra-node ring stage, an inter-node ring stage between GPUs of the same
  local index, an intra-node stage again (all_reduce: reduce_scatter, all_reduce of S/g,
  all_gather). Not NCCL's default; there for comparison.

Latency: a pipelined ring's chunk crosses every hop in turn, so a ring step costs the ring's
mean hop latency (NCCL's model likewise sums intra- and inter-node hop latencies); a chain or
a tree pays its pipeline fill once. On top of the routes, each ring and tree call pays what its
protocol costs beyond LL, and carries its protocol's wire bytes, by NCCL's own tuner
(`zsim.network.nccl_tuner`), which also picks the protocol and, for all_reduce, ring or tree.
Chains (broadcast, reduce) keep the route latencies and Simple's chunks.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from zsim.cluster.build import IntArray, distinct, distinct_counts
from zsim.cluster.fabric import NicAttach
from zsim.cluster.nvlink import compute_capability
from zsim.cluster.topology import Topology
from zsim.errors import InputError
from zsim.network.collective import (
    Algorithm,
    CollectiveCall,
    CollectiveOp,
    Phase,
    chain_closed_form_s,
    ring_closed_form_s,
    tree_closed_form_s,
)
from zsim.network.nccl_tuner import (
    PROTOCOLS,
    WIRE_EFFICIENCY,
    Hw,
    NcclComm,
    Protocol,
    choose,
    extra_latency_s,
)
from zsim.network.patterns import (
    Built,
    by_node,
    fair_share,
    path_latencies,
    ring_flows,
    ring_latency,
)

NCCL_CHAIN_CHUNK_BYTES = 512 * 1024
"""NCCL's pipeline unit for broadcast and reduce: the 4 MiB Simple buffer over NCCL_STEPS = 8
slots with BROADCAST/REDUCE_CHUNKSTEPS = 1 (src/include/collectives.h; the chunk size is computed
in src/enqueue.cc): the Simple protocol's; LL and LL128 chunks are not modelled."""


def nccl_comm(topo: Topology, gpus: IntArray, channels: int) -> NcclComm:
    """What NCCL's tuner knows of a communicator over `gpus`: LL128 is on where GPUs of a
    node talk over NVLink and reach their NICs through PCIe switches (tuning.cc: typeIntra <=
    NVB, typeInter <= PXB)."""
    nodes = len(distinct(gpus // topo.gpus_per_node))
    nvlink = topo.fabric.nvswitch is not None
    near_nic = topo.fabric.nic_attach is NicAttach.PCIE_SWITCH
    return NcclComm(
        ranks=len(gpus),
        nodes=nodes,
        intra=Hw.NVLINK if nvlink else Hw.PCI,
        channels=channels,
        sm=compute_capability(topo.fabric.gpu),
        cpu=topo.fabric.host_cpu,
        ll128=nvlink and (nodes == 1 or near_nic),
    )


def _protocols(topo: Topology) -> tuple[Protocol, ...] | None:
    """The protocols NCCL may pick on this fabric; None for the ideal network (no protocol)."""
    chosen = topo.fabric.protocol
    if chosen == "ideal":
        return None
    return PROTOCOLS if chosen == "auto" else (Protocol(chosen),)


def _costs(
    topo: Topology, op: CollectiveOp, algorithm: str, comm: NcclComm, nbytes: float, bus: float
) -> tuple[float, float]:
    """(extra latency s, wire efficiency) of the protocol NCCL picks for `algorithm`."""
    protocols = _protocols(topo)
    if protocols is None:
        return 0.0, 1.0
    _, protocol = choose(op, comm, nbytes, {algorithm: bus}, protocols)
    extra = extra_latency_s(op, algorithm, protocol, comm, nbytes, topo.call_latency_s)
    return extra, WIRE_EFFICIENCY[protocol]


# ---- rings and chains ----------------------------------------------------------------------


@dataclass(frozen=True)
class RingBasis:
    """What a call on equal rings (rows) costs whatever its op and size: their flows, the
    flows' fair share and one pipelined step's latency. A group's is kept (`group_rings`):
    every call on it, of any op and size, reuses it."""

    rings: IntArray
    src: IntArray
    dst: IntArray
    share: float
    latency_s: float

    @property
    def bus(self) -> float:
        """A rank's send rate over all channels when every ring sends at once (busBw)."""
        return self.share * len(self.rings)


def ring_basis(topo: Topology, rings: IntArray) -> RingBasis:
    src, dst = ring_flows(rings)
    return RingBasis(rings, src, dst, fair_share(topo, src, dst), ring_latency(topo, rings))


def group_rings(topo: Topology, group: Sequence[int]) -> RingBasis:
    """The basis of a group's NCCL rings, kept on the topology."""
    key = ("ring_basis", tuple(group))
    return topo.memoized(key, lambda: ring_basis(topo, nccl_rings(topo, group)))


def nccl_rings(topo: Topology, group: Sequence[int]) -> IntArray:
    """One ring per channel (a row). On one node, one ring in local order. Across nodes, one
    channel per member slot of the smallest node: channel c enters the first node at member c
    and leaves at c-1, walks the next node backwards from c-1 to c, and so on, so every
    inter-node hop joins two GPUs of the same rail; with `backend.ring_channels` N, N
    channels on one path, every node walked from its first member to its last."""
    if len(group) < 64:
        return _rings(topo, group)
    return topo.memoized(("nccl_rings", tuple(group)), lambda: _rings(topo, group))


def _rings(topo: Topology, group: Sequence[int]) -> IntArray:
    if topo.fabric.ring_channels:  # channels on one path across nodes (the module's doc)
        nodes = by_node(topo, group)
        if len(nodes) > 1:
            return np.tile(np.concatenate(nodes), (topo.fabric.ring_channels, 1))
    grid = regular_nodes(topo, group)  # nodes x members
    if grid is not None and len(grid) == 1:
        return grid
    if grid is not None:
        channels = g = grid.shape[1]
        c = np.arange(channels)[:, None]
        position = np.arange(len(grid))
        step = np.where(position % 2 == 0, 1, -1)
        first = np.where(step == 1, c, c - 1)  # channels x nodes
        index = (first[:, :, None] + step[None, :, None] * np.arange(g)) % g
        rings: IntArray = grid[position[None, :, None], index].reshape(channels, -1)
        return rings
    members = by_node(topo, group)
    irregular = []
    for channel in range(min(len(node) for node in members)):
        ring: list[int] = []
        for p, node in enumerate(members):
            step_p = 1 if p % 2 == 0 else -1
            start = channel if step_p == 1 else channel - 1
            ring += [int(node[(start + step_p * i) % len(node)]) for i in range(len(node))]
        irregular.append(ring)
    return np.asarray(irregular, dtype=np.int64)


def ring_phase(
    topo: Topology, op: CollectiveOp, basis: RingBasis, bytes_per_ring: float, channels: bool = True
) -> tuple[Phase, float]:
    """Equal rings running `op` at once, each on `bytes_per_ring`, in the protocol NCCL
    picks: the channels of one call, or (`channels=False`) the disjoint groups of a
    hierarchical stage, each its own call."""
    rings, share = basis.rings, basis.share
    m = rings.shape[1]
    steps = 2 * (m - 1) if op is CollectiveOp.ALL_REDUCE else m - 1
    per_call = len(rings) if channels else 1
    comm = nccl_comm(topo, rings[0], per_call)
    nbytes = bytes_per_ring * per_call
    extra, efficiency = _costs(topo, op, "ring", comm, nbytes, share * per_call)
    alpha = basis.latency_s + extra / steps
    wire = bytes_per_ring / efficiency
    closed = ring_closed_form_s(op, m, wire, alpha, share)
    return Phase(basis.src, basis.dst, wire / m, repeat=steps, latency_s=alpha), closed


def chain_phase(
    topo: Topology, chains: IntArray, bytes_per_chain: float, towards_root: bool
) -> tuple[Phase, float]:
    """Pipelined chains (rows) from (or, reversed, to) their first member, at once."""
    a, b = chains[:, :-1].ravel(), chains[:, 1:].ravel()
    src, dst = (b, a) if towards_root else (a, b)
    n, share = chains.shape[1], fair_share(topo, src, dst)
    alpha = float(path_latencies(topo, chains).max()) / max(n - 1, 1)
    closed = chain_closed_form_s(n, bytes_per_chain, alpha, share, NCCL_CHAIN_CHUNK_BYTES)
    fill_s = closed - bytes_per_chain / share
    return Phase(src, dst, bytes_per_chain, latency_s=fill_s), closed


def rotated_to(rings: IntArray, root: int) -> IntArray:
    """Each ring rotated to start at `root`."""
    start = np.argmax(rings == root, axis=1)
    index = (start[:, None] + np.arange(rings.shape[1])) % rings.shape[1]
    return np.take_along_axis(rings, index, axis=1)


def nccl_ring(topo: Topology, call: CollectiveCall) -> Built:
    if call.op in (CollectiveOp.BROADCAST, CollectiveOp.REDUCE):
        rings = nccl_rings(topo, call.group)
        chains = rotated_to(rings, call.group[call.root])
        towards_root = call.op is CollectiveOp.REDUCE
        phase, closed = chain_phase(topo, chains, call.nbytes / len(rings), towards_root)
    else:
        basis = group_rings(topo, call.group)
        phase, closed = ring_phase(topo, call.op, basis, call.nbytes / len(basis.rings))
    return [phase], closed


# ---- double binary tree -------------------------------------------------------------------


def btree_parent(nranks: int, rank: int) -> int:
    """The parent of `rank` in NCCL's binary tree over `nranks` (src/graph/trees.cc,
    ncclGetBtree): the root is 0; take the lowest set bit, clear it and set the next one up,
    or only clear it when that is out of range. -1 for the root."""
    if rank == 0:
        return -1
    bit = 1
    while bit < nranks and not bit & rank:
        bit <<= 1
    up = (rank ^ bit) | (bit << 1)
    return up if up < nranks else rank ^ bit


@functools.lru_cache(maxsize=256)  # the same node counts come back for every group
def dtree_parents(nranks: int) -> tuple[list[int], list[int]]:
    """Both trees of NCCL's double binary tree (ncclGetDtree): tree 1 mirrors tree 0 when
    `nranks` is even (then no rank is interior in both) and shifts it by one rank when odd."""
    first = [btree_parent(nranks, r) for r in range(nranks)]
    second = []
    for r in range(nranks):
        if nranks % 2:
            up = btree_parent(nranks, (r - 1) % nranks)
            second.append(-1 if up == -1 else (up + 1) % nranks)
        else:
            up = btree_parent(nranks, nranks - 1 - r)
            second.append(-1 if up == -1 else nranks - 1 - up)
    return first, second


def regular_nodes(topo: Topology, group: Sequence[int]) -> IntArray | None:
    """The group's members as nodes x members, or None when nodes hold different numbers."""
    gpus = np.asarray(group, dtype=np.int64)
    node, local = np.divmod(gpus, topo.gpus_per_node)
    counts = distinct_counts(node)[1]
    if (counts != counts[0]).any():
        return None
    return gpus[np.lexsort((local, node))].reshape(len(counts), counts[0])  # as by_node


def tree_channels(topo: Topology, group: Sequence[int]) -> list[tuple[IntArray, IntArray]]:
    """(chains: one row per node, parent of each node) for every channel x tree. Channel c's
    chain in a node starts at member c, the node's head, which talks to the other nodes; with
    `backend.ring_channels` N, N channels whose heads are every node's first member (as the
    rings on one path)."""
    grid = regular_nodes(topo, group)
    if grid is None:
        members = [len(node) for node in by_node(topo, group)]
        raise InputError("group", members, "the same number of members on every node (NCCL tree)")
    trees = [np.asarray(p, dtype=np.int64) for p in dtree_parents(grid.shape[0])]
    one_path = topo.fabric.ring_channels if len(grid) > 1 else 0  # as `_rings`
    heads = [0] * one_path or range(grid.shape[1])
    return [(np.roll(grid, -c, axis=1), p) for c in heads for p in trees]


def trees_latency(topo: Topology, channels: list[tuple[IntArray, IntArray]]) -> float:
    """The slowest pipeline fill of every channel x tree (`tree_channels`): from the farthest
    chain tail up to the root, and back down. All trees' hops are routed in one batch."""
    chains = np.stack([chain for chain, _ in channels])  # trees x nodes x members
    parents = np.stack([parent for _, parent in channels])  # trees x nodes
    heads, has_parent = chains[:, :, 0], parents >= 0
    up = np.take_along_axis(heads, np.where(has_parent, parents, 0), axis=1)
    hop = np.zeros(heads.shape)
    hop[has_parent] = topo.routes_of(heads[has_parent], up[has_parent]).latency_s
    rows = np.arange(len(heads))[:, None]
    total, at = np.zeros(heads.shape), np.broadcast_to(np.arange(heads.shape[1]), heads.shape)
    at = at.copy()
    climbing = has_parent
    while climbing.any():  # each node's path to the root, summed from the node up
        total[climbing] += hop[rows, at][climbing]
        at[climbing] = parents[rows, at][climbing]
        climbing = parents[rows, at] >= 0
    tails_first = chains[:, :, ::-1].reshape(-1, chains.shape[2])
    chain_s = path_latencies(topo, tails_first).reshape(len(chains), -1).max(axis=1)
    return float((2 * (total.max(axis=1) + chain_s)).max())


def _tree_flows(chains: IntArray, parents: IntArray) -> tuple[IntArray, IntArray]:
    """Up and down each node's chain, and between each node's head and its parent's."""
    a, b = chains[:, :-1].ravel(), chains[:, 1:].ravel()
    heads, child = chains[:, 0], np.flatnonzero(parents >= 0)
    up, down = heads[child], heads[parents[child]]
    return np.concatenate([b, a, up, down]), np.concatenate([a, b, down, up])


@dataclass(frozen=True)
class TreeBasis:
    """A group's double binary trees whatever the call's size: every channel x tree's flows,
    their fair share, the slowest pipeline fill, and the group's rings (NCCL's tuner rates
    the tree by the rings' bus bandwidth). Kept per group (`group_trees`)."""

    src: IntArray
    dst: IntArray
    share: float
    latency_s: float
    trees: int  # channels x 2
    rings: RingBasis


def group_trees(topo: Topology, group: Sequence[int]) -> TreeBasis:
    def make() -> TreeBasis:
        channels = tree_channels(topo, group)
        pairs = [_tree_flows(chains, parents) for chains, parents in channels]
        src = np.concatenate([p[0] for p in pairs])
        dst = np.concatenate([p[1] for p in pairs])
        latency = trees_latency(topo, channels)
        share = fair_share(topo, src, dst)
        return TreeBasis(src, dst, share, latency, len(channels), group_rings(topo, group))

    return topo.memoized(("tree_basis", tuple(group)), make)


def nccl_tree(topo: Topology, call: CollectiveCall) -> Built:
    """all_reduce on every channel x tree at once, each carrying S / (2 C) up and down, in the
    protocol NCCL picks for the tree."""
    basis = group_trees(topo, call.group)
    comm = nccl_comm(topo, np.asarray(call.group), len(basis.rings.rings))
    extra, efficiency = _costs(topo, call.op, "tree", comm, call.nbytes, basis.rings.bus)
    wire = call.nbytes / efficiency
    latency = basis.latency_s + extra
    # each flow carries S / (2 C) at the bottleneck share, so 2 S / B = S / (2 C share)
    closed = tree_closed_form_s(wire, latency, 2 * basis.trees * basis.share)
    return [Phase(basis.src, basis.dst, wire / basis.trees, latency_s=latency)], closed


def nccl_prefers_tree(topo: Topology, call: CollectiveCall) -> bool:
    """NCCL's auto choice for multi-node all_reduce, by its tuner (`nccl_tuner.choose`): the
    tree moves 2 S at 0.92 of the ring's bus bandwidth but pays ~log2(nodes) latencies, the
    ring 2(n-1)/n S and 2(n-1) steps. Groups with unequal members per node use the ring."""
    if call.algorithm is not Algorithm.AUTO or call.op is not CollectiveOp.ALL_REDUCE:
        return False
    group = np.asarray(call.group)
    if len(distinct(group // topo.gpus_per_node)) < 2:
        return False
    if regular_nodes(topo, call.group) is None:
        return False
    rings = group_rings(topo, call.group)
    bus = rings.bus
    comm = nccl_comm(topo, group, len(rings.rings))
    protocols = _protocols(topo) or (Protocol.SIMPLE,)
    algorithm, _ = choose(call.op, comm, call.nbytes, {"ring": bus, "tree": bus}, protocols)
    return algorithm == "tree"
