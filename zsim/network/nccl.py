"""How NCCL performs each collective (v2.30; derivation and sources in docs/collectives.md).

- ring: per channel a ring through every member. all_reduce is 2(n-1) steps of S/n per rank,
  all_gather and reduce_scatter n-1 steps; broadcast and reduce a pipelined chain from (to) the
  root in 512 KiB chunks. Across nodes there is one channel per member slot of a node: channel
  c enters and leaves every node on one rail (walking nodes alternately forwards and
  backwards), so each ring crosses every node boundary once and a node's NICs share the
  inter-node traffic, as NCCL's rings do.
- tree (all_reduce only): a chain inside each node, NCCL's double binary tree across nodes
  (src/graph/trees.cc; tree 1 mirrors tree 0 for an even node count, shifts it for odd); each
  tree carries half the data; reduce-up and broadcast-down run pipelined at once.
- hierarchical: an intra-node ring stage, an inter-node ring stage between GPUs of the same
  local index, an intra-node stage again (all_reduce: reduce_scatter, all_reduce of S/g,
  all_gather). Not NCCL's default; there for comparison.

Latency: a pipelined ring's chunk crosses every hop in turn, so a ring step costs the ring's
mean hop latency (NCCL's model likewise sums intra- and inter-node hop latencies); a chain or
a tree pays its pipeline fill once.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

from zsim.cluster.topology import Topology
from zsim.errors import require
from zsim.network.collective import (
    Algorithm,
    CollectiveCall,
    CollectiveOp,
    Phase,
    chain_closed_form_s,
    ring_closed_form_s,
    tree_closed_form_s,
)
from zsim.network.flows import Flow
from zsim.network.patterns import (
    Built,
    by_node,
    fair_share,
    path_latency,
    ring_flows,
    ring_latency,
)

NCCL_CHAIN_CHUNK_BYTES = 512 * 1024
"""NCCL's pipeline unit for broadcast and reduce: the 4 MiB Simple buffer over NCCL_STEPS = 8
slots with BROADCAST/REDUCE_CHUNKSTEPS = 1 (src/include/collectives.h; the chunk size is computed
in src/enqueue.cc): the Simple protocol's; LL and LL128 chunks are not modelled."""


NCCL_TREE_BANDWIDTH_FACTOR = 0.92
"""NCCL's tuner rates a tree at 0.92 of the bus bandwidth (src/graph/tuning.cc, v2.30); used
only to choose like NCCL does, not in the tree's own simulation."""


# ---- rings and chains ----------------------------------------------------------------------


def nccl_rings(topo: Topology, group: Sequence[int]) -> list[list[int]]:
    """One ring per channel. On one node, one ring in local order. Across nodes, one channel
    per member slot of the smallest node: channel c enters the first node at member c and
    leaves at c-1, walks the next node backwards from c-1 to c, and so on, so every
    inter-node hop joins two GPUs of the same rail."""
    members = by_node(topo, group)
    if len(members) == 1:
        return [members[0]]
    rings = []
    for c in range(min(len(node) for node in members)):
        ring: list[int] = []
        for position, node in enumerate(members):
            step = 1 if position % 2 == 0 else -1
            first = c if step == 1 else c - 1
            ring += [node[(first + step * i) % len(node)] for i in range(len(node))]
        rings.append(ring)
    return rings


def ring_phase(
    topo: Topology, op: CollectiveOp, rings: list[list[int]], bytes_per_ring: float
) -> tuple[Phase, float]:
    """Equal rings running `op` at once, each on `bytes_per_ring` (channels of one group, or
    the disjoint groups of a hierarchical stage)."""
    m = len(rings[0])
    steps = 2 * (m - 1) if op is CollectiveOp.ALL_REDUCE else m - 1
    flows = ring_flows(rings, bytes_per_ring / m)
    alpha = ring_latency(topo, rings)
    closed = ring_closed_form_s(op, m, bytes_per_ring, alpha, fair_share(topo, flows))
    return Phase(flows, repeat=steps, latency_s=alpha), closed


def _chain_phase(
    topo: Topology, chains: list[list[int]], bytes_per_chain: float, towards_root: bool
) -> tuple[Phase, float]:
    """Pipelined chains from (or, reversed, to) their first member, at once."""
    flows = tuple(
        Flow(b, a, bytes_per_chain) if towards_root else Flow(a, b, bytes_per_chain)
        for chain in chains
        for a, b in pairwise(chain)
    )
    n, share = len(chains[0]), fair_share(topo, flows)
    alpha = max(path_latency(topo, chain) for chain in chains) / max(n - 1, 1)
    closed = chain_closed_form_s(n, bytes_per_chain, alpha, share, NCCL_CHAIN_CHUNK_BYTES)
    fill_s = closed - bytes_per_chain / share
    return Phase(flows, latency_s=fill_s), closed


def nccl_ring(topo: Topology, call: CollectiveCall) -> Built:
    rings = nccl_rings(topo, call.group)
    if call.op in (CollectiveOp.BROADCAST, CollectiveOp.REDUCE):
        root = call.group[call.root]
        chains = [ring[ring.index(root) :] + ring[: ring.index(root)] for ring in rings]
        towards_root = call.op is CollectiveOp.REDUCE
        phase, closed = _chain_phase(topo, chains, call.nbytes / len(rings), towards_root)
    else:
        phase, closed = ring_phase(topo, call.op, rings, call.nbytes / len(rings))
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


def tree_channels(topo: Topology, group: Sequence[int]) -> list[tuple[list[list[int]], list[int]]]:
    """(chains per node, parent of each node) for every channel x tree. Channel c's chain in
    a node starts at member c, the node's head, which talks to the other nodes."""
    members = by_node(topo, group)
    out = []
    for c in range(min(len(node) for node in members)):
        chains = [node[c:] + node[:c] for node in members]
        out += [(chains, parents) for parents in dtree_parents(len(members))]
    return out


def tree_latency(topo: Topology, chains: list[list[int]], parents: list[int]) -> float:
    """Pipeline fill: from the farthest chain tail up to the root, and back down."""
    up = 0.0
    for position in range(len(chains)):
        total, p = 0.0, position
        while parents[p] >= 0:
            total += topo.route(chains[p][0], chains[parents[p]][0]).latency_s
            p = parents[p]
        up = max(up, total)
    chain_s = max(path_latency(topo, chain[::-1]) for chain in chains)
    return 2 * (up + chain_s)


def _tree_flows(chains: list[list[int]], parents: list[int], nbytes: float) -> list[Flow]:
    flows: list[Flow] = []
    for position, chain in enumerate(chains):
        for a, b in pairwise(chain):
            flows += [Flow(b, a, nbytes), Flow(a, b, nbytes)]  # up the chain and down it
        if parents[position] >= 0:
            head, parent_head = chain[0], chains[parents[position]][0]
            flows += [Flow(head, parent_head, nbytes), Flow(parent_head, head, nbytes)]
    return flows


def nccl_tree(topo: Topology, call: CollectiveCall) -> Built:
    """all_reduce on every channel x tree at once, each carrying S / (2 C) up and down."""
    channels = tree_channels(topo, call.group)
    per_tree = call.nbytes / len(channels)
    flows = tuple(f for chains, parents in channels for f in _tree_flows(chains, parents, per_tree))
    latency = max(tree_latency(topo, chains, parents) for chains, parents in channels)
    # each flow carries S / (2 C) at the bottleneck share, so 2 S / B = S / (2 C share)
    closed = tree_closed_form_s(call.nbytes, latency, 2 * len(channels) * fair_share(topo, flows))
    return [Phase(flows, latency_s=latency)], closed


# ---- hierarchical ---------------------------------------------------------------------------


def hierarchical(topo: Topology, call: CollectiveCall) -> Built:
    nodes = by_node(topo, call.group)
    g = len(nodes[0])
    require(
        all(len(node) == g for node in nodes),
        "group",
        [len(node) for node in nodes],
        "the same number of members on every node (hierarchical algorithm)",
    )
    if len(nodes) == 1 or g == 1:
        return nccl_ring(topo, call)
    rails = [[node[i] for node in nodes] for i in range(g)]
    stages = _stages(topo, call, nodes, rails)
    return [phase for phase, _ in stages], sum(closed for _, closed in stages)


def _stages(
    topo: Topology, call: CollectiveCall, nodes: list[list[int]], rails: list[list[int]]
) -> list[tuple[Phase, float]]:
    size, g, op = call.nbytes, len(rails), call.op
    if op is CollectiveOp.ALL_REDUCE:
        return [
            ring_phase(topo, CollectiveOp.REDUCE_SCATTER, nodes, size),
            ring_phase(topo, CollectiveOp.ALL_REDUCE, rails, size / g),
            ring_phase(topo, CollectiveOp.ALL_GATHER, nodes, size),
        ]
    if op is CollectiveOp.ALL_GATHER:
        return [ring_phase(topo, op, rails, size / g), ring_phase(topo, op, nodes, size)]
    if op is CollectiveOp.REDUCE_SCATTER:
        return [ring_phase(topo, op, nodes, size), ring_phase(topo, op, rails, size / g)]
    root = call.group[call.root]
    rail = next(r for r in rails if root in r)
    across = [rail[rail.index(root) :] + rail[: rail.index(root)]]
    slot = next(i for i, r in enumerate(rails) if root in r)
    inside = [node[slot:] + node[:slot] for node in nodes]
    if op is CollectiveOp.BROADCAST:
        return [_chain_phase(topo, across, size, False), _chain_phase(topo, inside, size, False)]
    return [_chain_phase(topo, inside, size, True), _chain_phase(topo, across, size, True)]


def nccl_prefers_tree(topo: Topology, call: CollectiveCall) -> bool:
    """NCCL's auto choice for multi-node all_reduce, by its tuner's model (tuning.cc): the
    tree moves 2 S at 0.92 of the ring's bus bandwidth but pays ~log2(nodes) latencies,
    the ring 2(n-1)/n S and 2(n-1) steps."""
    multi_node = len({topo.node_of(g) for g in call.group}) > 1
    if call.algorithm is not Algorithm.AUTO or call.op is not CollectiveOp.ALL_REDUCE:
        return False
    if not multi_node:
        return False
    rings = nccl_rings(topo, call.group)
    flows = ring_flows(rings, 1.0)
    bus = fair_share(topo, flows) * len(rings)
    n = len(call.group)
    ring_s = ring_closed_form_s(call.op, n, call.nbytes, ring_latency(topo, rings), bus)
    latency = max(tree_latency(topo, c, p) for c, p in tree_channels(topo, call.group))
    return tree_closed_form_s(call.nbytes, latency, bus * NCCL_TREE_BANDWIDTH_FACTOR) < ring_s
