"""How each backend performs each collective: a call on a topology becomes phases of flows.

Sources: /work/notes/collectives_algorithms.md (it cites NCCL v2.30 src/device/*.h,
src/graph/{trees,connect,tuning}.cc, gloo/*.cc and torch's ProcessGroupGloo), and NCCL's
src/graph/trees.cc for the double binary tree.

- NCCL ring: per channel a ring through every member. all_reduce is 2(n-1) steps of S/n per
  rank, all_gather and reduce_scatter n-1 steps; broadcast and reduce a pipelined chain from
  (to) the root in 512 KiB chunks. Across nodes there is one channel per member slot of a
  node: channel c enters and leaves every node on one rail (walking nodes alternately forwards
  and backwards), so each ring crosses every node boundary once and a node's NICs share the
  inter-node traffic, as NCCL's rings do.
- NCCL tree (all_reduce only): a chain inside each node, NCCL's double binary tree across
  nodes (tree 1 mirrors tree 0 for an even node count, shifts it for odd); each tree carries
  half the data; reduce-up and broadcast-down run pipelined at once.
- hierarchical: an intra-node ring stage, an inter-node ring stage between GPUs of the same
  local index, an intra-node stage again (all_reduce: reduce_scatter, all_reduce of S/g,
  all_gather). Not NCCL's default; there for comparison.
- gloo (ProcessGroupGloo, CPU tensors): all_reduce a ring sending to rank-1, k >= 2 segments per
  chunk with two in flight (one latency per ring step); all_gather a ring to rank+1 in half
  blocks; reduce_scatter_tensor is an all_reduce of the whole input (clone + allreduce + copy);
  broadcast a binomial tree of whole messages, each rank posting its sends once it has
  received; reduce a ring reduce-scatter then an incast to the root; send_recv one message;
  all_to_all n-1 concurrent flows per rank. Each plan also charges the ranks' own CPU work
  (the topology's `LocalWork`): gloo's and torch's copies, the reductions, the page faults of
  a fresh temporary, a cost per message a rank sends or receives, and the op's own cost per
  byte the busiest rank sends plus receives (`LocalWork.op_s`), charged in each phase for the
  bytes it moves. send_recv pays the topology's send/recv call latency where it has one
  (torch posts gloo's send and recv on the caller's thread, not the worker queue).

Latency: a pipelined ring's chunk crosses every hop in turn, so a ring step costs the ring's
mean hop latency (NCCL's model likewise sums intra- and inter-node hop latencies); a chain or
a tree pays its pipeline fill once. The closed form of each algorithm is evaluated with alpha
from these latencies and B the bottleneck fair share of its flows (capacity / flows crossing
a link), which is exact when equal flows start together.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from itertools import pairwise

import numpy as np

from zsim.collective_model import (
    Algorithm,
    CollectiveCall,
    CollectiveOp,
    Phase,
    Plan,
    chain_closed_form_s,
    gloo_closed_form_s,
    ring_closed_form_s,
    tree_closed_form_s,
)
from zsim.errors import require
from zsim.fabric import Backend
from zsim.network import Flow
from zsim.topology import Topology

NCCL_CHAIN_CHUNK_BYTES = 512 * 1024
"""NCCL's pipeline unit for broadcast and reduce: the 4 MiB Simple buffer over NCCL_STEPS = 8
slots with CHUNKSTEPS = 1 (src/init.cc, src/include/device.h, src/device/broadcast.h)."""

NCCL_TREE_BANDWIDTH_FACTOR = 0.92
"""NCCL's tuner rates a tree at 0.92 of the bus bandwidth (src/graph/tuning.cc, v2.30); used
only to choose like NCCL does, not in the tree's own simulation."""

GLOO_MAX_SEGMENT_BYTES = 1024 * 1024
"""gloo's kMaxSegmentSize (gloo/allreduce.h, gloo/reduce.h)."""

Built = tuple[list[Phase], float]  # phases and the closed form (without the call latency)


# ---- what a pattern of flows sees ----------------------------------------------------------


def _share(topo: Topology, flows: Sequence[Flow]) -> float:
    """The smallest fair share of any capacity (capacity / flows drawing on it; a half-duplex
    pair is one capacity): the rate of the slowest flow when all start together (the first
    level of max-min filling)."""
    routes = [r.links for r in topo.routes((f.src, f.dst) for f in flows if f.src != f.dst)]
    if not routes:
        return math.inf
    counts = np.bincount(topo.resource[np.concatenate(routes)])
    used = counts > 0
    return float((topo.bandwidth_bytes_per_s[: counts.shape[0]][used] / counts[used]).min())


def _alone(topo: Topology, flows: Sequence[Flow]) -> float:
    """The slowest flow's rate if each ran alone (its route's narrowest link)."""
    routes = topo.routes((f.src, f.dst) for f in flows if f.src != f.dst)
    return min((float(topo.bandwidth_bytes_per_s[r.links].min()) for r in routes), default=math.inf)


def _max_latency(topo: Topology, flows: Sequence[Flow]) -> float:
    return max((r.latency_s for r in topo.routes((f.src, f.dst) for f in flows)), default=0.0)


def _path_latency(topo: Topology, path: Sequence[int]) -> float:
    return sum(r.latency_s for r in topo.routes(pairwise(path)))


# ---- NCCL rings and chains -----------------------------------------------------------------


def _by_node(topo: Topology, group: Sequence[int]) -> list[list[int]]:
    """Group members per node: nodes in id order, members by local index."""
    nodes: dict[int, list[int]] = {}
    for gpu in sorted(group, key=lambda g: (topo.node_of(g), topo.local_of(g))):
        nodes.setdefault(topo.node_of(gpu), []).append(gpu)
    return [nodes[k] for k in sorted(nodes)]


def nccl_rings(topo: Topology, group: Sequence[int]) -> list[list[int]]:
    """One ring per channel. On one node, one ring in local order. Across nodes, one channel
    per member slot of the smallest node: channel c enters the first node at member c and
    leaves at c-1, walks the next node backwards from c-1 to c, and so on, so every
    inter-node hop joins two GPUs of the same rail."""
    members = _by_node(topo, group)
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


def _ring_flows(rings: Sequence[Sequence[int]], nbytes: float, shift: int = 1) -> tuple[Flow, ...]:
    """Every member sends `nbytes` to the member `shift` places on in its ring."""
    return tuple(
        Flow(ring[i], ring[(i + shift) % len(ring)], nbytes)
        for ring in rings
        for i in range(len(ring))
    )


def _ring_latency(topo: Topology, rings: Sequence[Sequence[int]], shift: int = 1) -> float:
    """One pipelined step: the mean hop latency of the slowest ring (in its direction)."""
    cycles = [[*ring, ring[0]] for ring in rings]
    if shift < 0:
        cycles = [cycle[::-1] for cycle in cycles]
    return max(_path_latency(topo, cycle) / (len(cycle) - 1) for cycle in cycles)


def _ring_phase(
    topo: Topology, op: CollectiveOp, rings: list[list[int]], bytes_per_ring: float
) -> tuple[Phase, float]:
    """Equal rings running `op` at once, each on `bytes_per_ring` (channels of one group, or
    the disjoint groups of a hierarchical stage)."""
    m = len(rings[0])
    steps = 2 * (m - 1) if op is CollectiveOp.ALL_REDUCE else m - 1
    flows = _ring_flows(rings, bytes_per_ring / m)
    alpha = _ring_latency(topo, rings)
    closed = ring_closed_form_s(op, m, bytes_per_ring, alpha, _share(topo, flows))
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
    n, share = len(chains[0]), _share(topo, flows)
    alpha = max(_path_latency(topo, chain) for chain in chains) / max(n - 1, 1)
    closed = chain_closed_form_s(n, bytes_per_chain, alpha, share, NCCL_CHAIN_CHUNK_BYTES)
    fill_s = closed - bytes_per_chain / share
    return Phase(flows, latency_s=fill_s), closed


def _nccl_ring(topo: Topology, call: CollectiveCall) -> Built:
    rings = nccl_rings(topo, call.group)
    if call.op in (CollectiveOp.BROADCAST, CollectiveOp.REDUCE):
        root = call.group[call.root]
        chains = [ring[ring.index(root) :] + ring[: ring.index(root)] for ring in rings]
        towards_root = call.op is CollectiveOp.REDUCE
        phase, closed = _chain_phase(topo, chains, call.nbytes / len(rings), towards_root)
    else:
        phase, closed = _ring_phase(topo, call.op, rings, call.nbytes / len(rings))
    return [phase], closed


# ---- NCCL double binary tree --------------------------------------------------------------


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
    `nranks` is even and shifts it by one rank when odd, so no rank is interior in both."""
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


def _tree_channels(topo: Topology, group: Sequence[int]) -> list[tuple[list[list[int]], list[int]]]:
    """(chains per node, parent of each node) for every channel x tree. Channel c's chain in
    a node starts at member c, the node's head, which talks to the other nodes."""
    members = _by_node(topo, group)
    out = []
    for c in range(min(len(node) for node in members)):
        chains = [node[c:] + node[:c] for node in members]
        out += [(chains, parents) for parents in dtree_parents(len(members))]
    return out


def _tree_latency(topo: Topology, chains: list[list[int]], parents: list[int]) -> float:
    """Pipeline fill: from the farthest chain tail up to the root, and back down."""
    up = 0.0
    for position in range(len(chains)):
        total, p = 0.0, position
        while parents[p] >= 0:
            total += topo.route(chains[p][0], chains[parents[p]][0]).latency_s
            p = parents[p]
        up = max(up, total)
    chain_s = max(_path_latency(topo, chain[::-1]) for chain in chains)
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


def _nccl_tree(topo: Topology, call: CollectiveCall) -> Built:
    """all_reduce on every channel x tree at once, each carrying S / (2 C) up and down."""
    channels = _tree_channels(topo, call.group)
    per_tree = call.nbytes / len(channels)
    flows = tuple(f for chains, parents in channels for f in _tree_flows(chains, parents, per_tree))
    latency = max(_tree_latency(topo, chains, parents) for chains, parents in channels)
    # each flow carries S / (2 C) at the bottleneck share, so 2 S / B = S / (2 C share)
    closed = tree_closed_form_s(call.nbytes, latency, 2 * len(channels) * _share(topo, flows))
    return [Phase(flows, latency_s=latency)], closed


# ---- hierarchical ---------------------------------------------------------------------------


def _hierarchical(topo: Topology, call: CollectiveCall) -> Built:
    nodes = _by_node(topo, call.group)
    g = len(nodes[0])
    require(
        all(len(node) == g for node in nodes),
        "group",
        [len(node) for node in nodes],
        "the same number of members on every node (hierarchical algorithm)",
    )
    if len(nodes) == 1 or g == 1:
        return _nccl_ring(topo, call)
    rails = [[node[i] for node in nodes] for i in range(g)]
    stages = _stages(topo, call, nodes, rails)
    return [phase for phase, _ in stages], sum(closed for _, closed in stages)


def _stages(
    topo: Topology, call: CollectiveCall, nodes: list[list[int]], rails: list[list[int]]
) -> list[tuple[Phase, float]]:
    size, g, op = call.nbytes, len(rails), call.op
    if op is CollectiveOp.ALL_REDUCE:
        return [
            _ring_phase(topo, CollectiveOp.REDUCE_SCATTER, nodes, size),
            _ring_phase(topo, CollectiveOp.ALL_REDUCE, rails, size / g),
            _ring_phase(topo, CollectiveOp.ALL_GATHER, nodes, size),
        ]
    if op is CollectiveOp.ALL_GATHER:
        return [_ring_phase(topo, op, rails, size / g), _ring_phase(topo, op, nodes, size)]
    if op is CollectiveOp.REDUCE_SCATTER:
        return [_ring_phase(topo, op, nodes, size), _ring_phase(topo, op, rails, size / g)]
    root = call.group[call.root]
    rail = next(r for r in rails if root in r)
    across = [rail[rail.index(root) :] + rail[: rail.index(root)]]
    slot = next(i for i, r in enumerate(rails) if root in r)
    inside = [node[slot:] + node[:slot] for node in nodes]
    if op is CollectiveOp.BROADCAST:
        return [_chain_phase(topo, across, size, False), _chain_phase(topo, inside, size, False)]
    return [_chain_phase(topo, inside, size, True), _chain_phase(topo, across, size, True)]


# ---- point-to-point -------------------------------------------------------------------------


def _direct(topo: Topology, call: CollectiveCall) -> Built:
    """send_recv: one flow. all_to_all: every rank sends S/n to every other, all at once."""
    n, size = len(call.group), call.nbytes
    if call.op is CollectiveOp.SEND_RECV:
        flows: tuple[Flow, ...] = (Flow(call.group[0], call.group[1], size),)
        per_rank = _share(topo, flows)
    else:
        flows = tuple(Flow(a, b, size / n) for a in call.group for b in call.group if a != b)
        per_rank = _share(topo, flows) * (n - 1)
    closed = ring_closed_form_s(call.op, n, size, _max_latency(topo, flows), per_rank)
    return [Phase(flows)], closed


# ---- gloo -----------------------------------------------------------------------------------

GLOO_ELEMENT_BYTES = 4
"""The element gloo rounds its segments to: fp32, what the CPU ranks reduce. Only buffers of a
few elements per segment depend on it (which segments hold data, hence the message count)."""


def gloo_allreduce_segments(nbytes: float, n: int) -> int:
    """k, segments per rank-chunk of gloo's ring allreduce (gloo/allreduce.cc `ring`):
    numSegments = roundUp(max(ceil(S / 1 MiB), 2 n), n) and k = numSegments / n."""
    return math.ceil(max(math.ceil(nbytes / GLOO_MAX_SEGMENT_BYTES), 2 * n) / n)


def gloo_reduce_segments(nbytes: float, n: int) -> int:
    """k for gloo's reduce (gloo/reduce.cc): the segment is min(ceil(S / 2n), 1 MiB)."""
    segment = min(math.ceil(nbytes / (2 * n)), GLOO_MAX_SEGMENT_BYTES)
    segments = math.ceil(nbytes / segment) if segment else 0
    return math.ceil(max(segments, 2 * n) / n)


def _filled_segments(nbytes: float, segments: int, segment_bytes: float) -> int:
    """How many of `segments` segments start inside the buffer: gloo skips the others (a
    segment whose offset is past the end has no length)."""
    if nbytes <= 0:
        return 0
    unit = max(math.ceil(segment_bytes / GLOO_ELEMENT_BYTES), 1) * GLOO_ELEMENT_BYTES
    return min(math.ceil(nbytes / unit), segments)


def _holding_data(first: int, count: int, segments: int, filled: int) -> int:
    """Of the `count` segments first, first + 1, ... (mod `segments`), those below `filled`."""
    lo = first % segments
    hi = lo + count  # count <= segments: the window wraps at most once
    return max(0, min(hi, filled) - lo) + max(0, min(hi, segments + filled) - max(lo, segments))


def _busiest_ring_rank(
    n: int, k: int, filled: int, iterations: int, send_first: int, recv_first: int
) -> int:
    """Messages the busiest rank sends plus receives in a segmented ring loop: in iteration i
    rank r sends segment (r + send_first) k + i and receives (r + recv_first) k + i."""
    total = n * k
    return max(
        _holding_data((r + send_first) * k, iterations, total, filled)
        + _holding_data((r + recv_first) * k, iterations, total, filled)
        for r in range(n)
    )


def gloo_allreduce_messages(nbytes: float, n: int) -> tuple[int, int]:
    """Messages the busiest rank sends plus receives in the reduce-scatter and the all-gather
    loop of gloo's ring allreduce (allreduce.cc): (n-1) k iterations each; in reduce-scatter
    rank r sends segment (r+1) k + i to r-1 and receives (r+2) k + i, in all-gather it sends
    r k + i and receives (r+1) k + i, segments counted modulo n k, empty ones skipped. An
    8-byte buffer fills 2 of 4 segments: each loop runs one way, 2 messages per rank, not 4."""
    k = gloo_allreduce_segments(nbytes, n)
    filled = _filled_segments(nbytes, n * k, nbytes / (n * k))
    steps = (n - 1) * k
    return (
        _busiest_ring_rank(n, k, filled, steps, 1, 2),
        _busiest_ring_rank(n, k, filled, steps, 0, 1),
    )


def _gloo(topo: Topology, call: CollectiveCall) -> Built:
    n, size, op, work = len(call.group), call.nbytes, call.op, topo.local_work
    if op is CollectiveOp.ALL_REDUCE:
        return _gloo_allreduce(topo, call.group, size, op)
    if op is CollectiveOp.REDUCE_SCATTER:
        # ProcessGroupGloo: clone the input on the calling thread (its heap keeps the memory),
        # all_reduce the clone, copy the own chunk out
        clone_s = work.copy_s(size)
        phases, closed = _gloo_allreduce(topo, call.group, size, op)
        chunk_s = work.copy_s(size / n)
        local = [Phase((), local_s=clone_s), *phases, Phase((), local_s=chunk_s)]
        return local, clone_s + closed + chunk_s
    if op is CollectiveOp.ALL_GATHER:
        return _gloo_allgather(topo, call.group, size)
    if op is CollectiveOp.BROADCAST:
        return _gloo_broadcast(topo, call)
    if op is CollectiveOp.REDUCE:
        return _gloo_reduce(topo, call)
    phases, closed = _direct(topo, call)
    # send_recv: one message of S at each end; all_to_all: n-1 blocks of S/n sent and n-1
    # received per rank, and the own block copied (alltoall.cc)
    p2p = op is CollectiveOp.SEND_RECV
    messages = 1 if p2p else 2 * (n - 1)
    own = 0.0 if p2p else work.copy_s(size / n)
    moved = size if p2p else 2 * (n - 1) / n * size
    local_s = messages * work.message_s + own + work.op_s(op, moved)
    return [replace(phases[-1], local_s=local_s)], closed + local_s


def _gloo_allreduce(topo: Topology, group: Sequence[int], size: float, op: CollectiveOp) -> Built:
    """Ring reduce-scatter then ring all-gather (allreduce.cc `ring`, to rank-1), n-1 steps of
    S/n each; two segments in flight, so each step exposes one latency. Each rank then pays
    its messages, after reduce-scatter the sums of the (n-1)/n S bytes it received, and in
    each loop `op`'s own cost for the 2 (n-1)/n S bytes it sends plus receives (`op` is
    all_reduce, or reduce_scatter, which torch runs as this all_reduce)."""
    n, work = len(group), topo.local_work
    ring = [list(group)]
    flows = _ring_flows(ring, size / n, shift=-1)
    alpha = _ring_latency(topo, ring, shift=-1)
    scatter, gather = gloo_allreduce_messages(size, n)
    own_s = work.op_s(op, 2 * (n - 1) / n * size)
    scatter_s = scatter * work.message_s + work.reduce_s((n - 1) / n * size) + own_s
    gather_s = gather * work.message_s + own_s
    closed = gloo_closed_form_s(CollectiveOp.ALL_REDUCE, n, size, alpha, _share(topo, flows))
    phases = [
        Phase(flows, repeat=n - 1, latency_s=alpha, local_s=scatter_s),
        Phase(flows, repeat=n - 1, latency_s=alpha, local_s=gather_s),
    ]
    return phases, closed + scatter_s + gather_s


def _gloo_allgather(topo: Topology, group: Sequence[int], size: float) -> Built:
    """ProcessGroupGloo allocates a flat output on its worker thread (a fresh block when it
    does not fit that thread's heap: `LocalWork.fresh_above_bytes`), gloo primes the
    own slot (a copy of S/n) and runs a ring to rank+1 in half blocks, two in flight: n-1
    steps of S/n, 2(n-1) messages each way per rank; torch then copies the n slices out. The
    op's own cost is charged on the 2 (n-1)/n S bytes a rank sends plus receives."""
    n, work = len(group), topo.local_work
    ring = [list(group)]
    flows = _ring_flows(ring, size / n)
    alpha = _ring_latency(topo, ring)
    prime_s = work.allocate_s(size) + work.copy_s(size / n)
    own_s = work.op_s(CollectiveOp.ALL_GATHER, 2 * (n - 1) / n * size)
    after_s = 4 * (n - 1) * work.message_s + work.copy_s(size) + own_s
    closed = gloo_closed_form_s(CollectiveOp.ALL_GATHER, n, size, alpha, _share(topo, flows))
    phases = [
        Phase((), local_s=prime_s),
        Phase(flows, repeat=n - 1, latency_s=alpha, local_s=after_s),
    ]
    return phases, prime_s + closed + after_s


def _gloo_broadcast(topo: Topology, call: CollectiveCall) -> Built:
    """Binomial tree (gloo/broadcast.cc): in round i virtual ranks below 2^i send the whole
    message to vrank + 2^i; sends are posted at once, so a rank's sends share its link. The
    busiest rank's messages each cost `message_s` and move S bytes at the op's own cost."""
    n, size = len(call.group), call.nbytes
    flows: list[Flow] = []
    waits: list[tuple[int, ...]] = []
    delivered: dict[int, int] = {}  # vrank -> index of the flow that delivered to it
    messages = [0] * n  # sent plus received, per vrank
    for i in range(math.ceil(math.log2(n))):
        for vrank in range(min(2**i, n - 2**i)):
            peer = vrank + 2**i
            waits.append((delivered[vrank],) if vrank in delivered else ())
            delivered[peer] = len(flows)
            src, dst = call.group[(vrank + call.root) % n], call.group[(peer + call.root) % n]
            flows.append(Flow(src, dst, size))
            messages[vrank] += 1
            messages[peer] += 1
    alpha = _max_latency(topo, flows)
    closed = gloo_closed_form_s(CollectiveOp.BROADCAST, n, size, alpha, _alone(topo, flows))
    work = topo.local_work
    local_s = max(messages) * (work.message_s + work.op_s(CollectiveOp.BROADCAST, size))
    return [Phase(tuple(flows), waits_for=tuple(waits), local_s=local_s)], closed + local_s


def _gloo_reduce(topo: Topology, call: CollectiveCall) -> Built:
    """A ring reduce-scatter of n k - 2 segment sends (gloo/reduce.cc), two in flight so its
    n-1 steps expose one latency each, then every rank sends its reduced chunk S/n straight
    to the root (an incast). The op's own cost is charged on the bytes the busiest rank sends
    plus receives in each part."""
    n, size, work = len(call.group), call.nbytes, topo.local_work
    k = gloo_reduce_segments(size, n)
    iterations = n * k - 2
    ring = [list(call.group)]
    scatter = _ring_flows(ring, size / (n * k), shift=-1)
    root = call.group[call.root]
    gather = tuple(Flow(g, root, size / n) for g in call.group if g != root)
    alpha = _ring_latency(topo, ring, shift=-1)
    segment = min(math.ceil(size / (2 * n)), GLOO_MAX_SEGMENT_BYTES)
    filled = _filled_segments(size, n * k, segment)
    ring_s = _busiest_ring_rank(n, k, filled, iterations, 1, 2) * work.message_s
    ring_s += work.reduce_s((n - 1) / n * size)
    ring_s += work.op_s(CollectiveOp.REDUCE, 2 * iterations * size / (n * k))
    # the root receives from every other rank
    gather_s = (n - 1) * work.message_s + work.op_s(CollectiveOp.REDUCE, (n - 1) / n * size)
    closed = (n - 1) * alpha + iterations * size / (n * k * _share(topo, scatter)) + ring_s
    closed += _max_latency(topo, gather) + size / n / _share(topo, gather) + gather_s
    return [
        Phase(scatter, repeat=iterations, latency_s=(n - 1) * alpha / iterations, local_s=ring_s),
        Phase(gather, local_s=gather_s),
    ], closed


# ---- choosing -------------------------------------------------------------------------------

Builder = Callable[[Topology, CollectiveCall], Built]


def _builder(topo: Topology, call: CollectiveCall) -> tuple[str, Builder]:
    algorithm, op = call.algorithm, call.op
    flat = algorithm in (Algorithm.AUTO, Algorithm.RING)
    if topo.fabric.backend is Backend.GLOO:
        require(flat, "algorithm", str(algorithm), "auto or ring: gloo has no other algorithm")
        return "gloo", _gloo
    if op in (CollectiveOp.SEND_RECV, CollectiveOp.ALL_TO_ALL):
        require(flat, "algorithm", str(algorithm), f"auto or ring for {op} (point-to-point)")
        return "nccl-p2p", _direct
    if algorithm is Algorithm.TREE:
        require(op is CollectiveOp.ALL_REDUCE, "algorithm", "tree", "all_reduce only (NCCL)")
        return "nccl-tree", _nccl_tree
    if algorithm is Algorithm.HIERARCHICAL:
        return "nccl-hierarchical", _hierarchical
    return "nccl-ring", _nccl_ring


def plan(topo: Topology, call: CollectiveCall) -> Plan:
    """The phases `call` runs as on `topo`, and its closed form (call latency included)."""
    topo.check_gpus(call.group)
    name, build = _builder(topo, call)
    overhead = topo.call_latency_s
    if call.op is CollectiveOp.SEND_RECV and topo.p2p_call_latency_s is not None:
        overhead = topo.p2p_call_latency_s
    overhead += topo.local_work.op_call(call.op)
    if len(call.group) == 1:
        return Plan(call, name, (), overhead, overhead)
    if name == "nccl-ring" and _nccl_prefers_tree(topo, call):
        name, build = "nccl-tree", _nccl_tree
    phases, closed = build(topo, call)
    return Plan(call, name, tuple(phases), overhead, overhead + closed)


def _nccl_prefers_tree(topo: Topology, call: CollectiveCall) -> bool:
    """NCCL's auto choice for multi-node all_reduce, by its tuner's model (tuning.cc): the
    tree moves 2 S at 0.92 of the ring's bus bandwidth but pays ~log2(nodes) latencies,
    the ring 2(n-1)/n S and 2(n-1) steps."""
    multi_node = len({topo.node_of(g) for g in call.group}) > 1
    if call.algorithm is not Algorithm.AUTO or call.op is not CollectiveOp.ALL_REDUCE:
        return False
    if not multi_node:
        return False
    rings = nccl_rings(topo, call.group)
    flows = _ring_flows(rings, 1.0)
    bus = _share(topo, flows) * len(rings)
    n = len(call.group)
    ring_s = ring_closed_form_s(call.op, n, call.nbytes, _ring_latency(topo, rings), bus)
    latency = max(_tree_latency(topo, c, p) for c, p in _tree_channels(topo, call.group))
    return tree_closed_form_s(call.nbytes, latency, bus * NCCL_TREE_BANDWIDTH_FACTOR) < ring_s


def estimate_s(topo: Topology, call: CollectiveCall) -> float:
    """The fast path: the chosen algorithm's closed form, without simulating."""
    return plan(topo, call).closed_form_s
