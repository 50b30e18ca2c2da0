"""How gloo performs each collective on CPU tensors (ProcessGroupGloo; derivation and sources
in docs/collectives.md).

all_reduce is a ring sending to rank-1, k >= 2 segments per chunk with two in flight (one
latency per ring step); all_gather a ring to rank+1 in half blocks; reduce_scatter_tensor an
all_reduce of the whole input (clone + allreduce + copy); broadcast a binomial tree of whole
messages, each rank posting its sends once it has received; reduce a ring reduce-scatter then
an incast to the root; send_recv one message; all_to_all n-1 concurrent flows per rank.

Each plan also charges the ranks' own CPU work (the topology's `LocalWork`): gloo's and torch's
copies, the reductions, the page faults of a fresh temporary, a cost per message a rank sends or
receives, and the op's own cost per byte the busiest rank sends plus receives
(`LocalWork.op_s`), charged in each phase for the bytes it moves.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from zsim.cluster.topology import Topology
from zsim.network.collective import CollectiveCall, CollectiveOp, Phase, gloo_closed_form_s
from zsim.network.flows import Flow
from zsim.network.patterns import (
    Built,
    alone_rate,
    fair_share,
    max_latency,
    point_to_point,
    ring_flows,
    ring_latency,
)

GLOO_MAX_SEGMENT_BYTES = 1024 * 1024
"""gloo's kMaxSegmentSize (gloo/allreduce.h, gloo/reduce.h)."""


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


def gloo(topo: Topology, call: CollectiveCall) -> Built:
    n, size, op, work = len(call.group), call.nbytes, call.op, topo.local_work
    if op is CollectiveOp.ALL_REDUCE:
        return _gloo_allreduce(topo, call.group, size, op)
    if op is CollectiveOp.REDUCE_SCATTER:
        # ProcessGroupGloo: clone the input on the calling thread (its heap keeps the memory),
        # all_reduce the clone, copy the own chunk out
        clone_s = work.copy_s(size)
        phases, closed = _gloo_allreduce(topo, call.group, size, op)
        chunk_s = work.copy_s(size / n)
        local = [Phase(local_s=clone_s), *phases, Phase(local_s=chunk_s)]
        return local, clone_s + closed + chunk_s
    if op is CollectiveOp.ALL_GATHER:
        return _gloo_allgather(topo, call.group, size)
    if op is CollectiveOp.BROADCAST:
        return _gloo_broadcast(topo, call)
    if op is CollectiveOp.REDUCE:
        return _gloo_reduce(topo, call)
    phases, closed = point_to_point(topo, call)
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
    ring = np.asarray([group], dtype=np.int64)
    src, dst = ring_flows(ring, shift=-1)
    alpha = ring_latency(topo, ring, shift=-1)
    scatter, gather = gloo_allreduce_messages(size, n)
    own_s = work.op_s(op, 2 * (n - 1) / n * size)
    scatter_s = scatter * work.message_s + work.reduce_s((n - 1) / n * size) + own_s
    gather_s = gather * work.message_s + own_s
    share = fair_share(topo, src, dst)
    closed = gloo_closed_form_s(CollectiveOp.ALL_REDUCE, n, size, alpha, share)
    phases = [
        Phase(src, dst, size / n, repeat=n - 1, latency_s=alpha, local_s=scatter_s),
        Phase(src, dst, size / n, repeat=n - 1, latency_s=alpha, local_s=gather_s),
    ]
    return phases, closed + scatter_s + gather_s


def _gloo_allgather(topo: Topology, group: Sequence[int], size: float) -> Built:
    """ProcessGroupGloo allocates a flat output on its worker thread (a fresh block when it
    does not fit that thread's heap: `LocalWork.fresh_above_bytes`), gloo primes the
    own slot (a copy of S/n) and runs a ring to rank+1 in half blocks, two in flight: n-1
    steps of S/n, 2(n-1) messages each way per rank; torch then copies the n slices out. The
    op's own cost is charged on the 2 (n-1)/n S bytes a rank sends plus receives."""
    n, work = len(group), topo.local_work
    ring = np.asarray([group], dtype=np.int64)
    src, dst = ring_flows(ring)
    alpha = ring_latency(topo, ring)
    prime_s = work.allocate_s(size) + work.copy_s(size / n)
    own_s = work.op_s(CollectiveOp.ALL_GATHER, 2 * (n - 1) / n * size)
    after_s = 4 * (n - 1) * work.message_s + work.copy_s(size) + own_s
    share = fair_share(topo, src, dst)
    closed = gloo_closed_form_s(CollectiveOp.ALL_GATHER, n, size, alpha, share)
    phases = [
        Phase(local_s=prime_s),
        Phase(src, dst, size / n, repeat=n - 1, latency_s=alpha, local_s=after_s),
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
    phase = Phase.of(flows, waits_for=tuple(waits))
    alpha = max_latency(topo, phase.src, phase.dst)
    rate = alone_rate(topo, phase.src, phase.dst)
    closed = gloo_closed_form_s(CollectiveOp.BROADCAST, n, size, alpha, rate)
    work = topo.local_work
    local_s = max(messages) * (work.message_s + work.op_s(CollectiveOp.BROADCAST, size))
    return [replace(phase, local_s=local_s)], closed + local_s


def _gloo_reduce(topo: Topology, call: CollectiveCall) -> Built:
    """A ring reduce-scatter of n k - 2 segment sends (gloo/reduce.cc), two in flight so its
    n-1 steps expose one latency each, then every rank sends its reduced chunk S/n straight
    to the root (an incast). The op's own cost is charged on the bytes the busiest rank sends
    plus receives in each part."""
    n, size, work = len(call.group), call.nbytes, topo.local_work
    k = gloo_reduce_segments(size, n)
    iterations = n * k - 2
    ring = np.asarray([call.group], dtype=np.int64)
    scatter = Phase(*ring_flows(ring, shift=-1), size / (n * k))
    root = call.group[call.root]
    senders = ring[0][ring[0] != root]
    gather = Phase(senders, np.full_like(senders, root), size / n)
    alpha = ring_latency(topo, ring, shift=-1)
    segment = min(math.ceil(size / (2 * n)), GLOO_MAX_SEGMENT_BYTES)
    filled = _filled_segments(size, n * k, segment)
    ring_s = _busiest_ring_rank(n, k, filled, iterations, 1, 2) * work.message_s
    ring_s += work.reduce_s((n - 1) / n * size)
    ring_s += work.op_s(CollectiveOp.REDUCE, 2 * iterations * size / (n * k))
    # the root receives from every other rank
    gather_s = (n - 1) * work.message_s + work.op_s(CollectiveOp.REDUCE, (n - 1) / n * size)
    scatter_share = fair_share(topo, scatter.src, scatter.dst)
    closed = (n - 1) * alpha + iterations * size / (n * k * scatter_share) + ring_s
    gather_share = fair_share(topo, gather.src, gather.dst)
    closed += max_latency(topo, gather.src, gather.dst) + size / n / gather_share + gather_s
    step = (n - 1) * alpha / iterations
    return [
        replace(scatter, repeat=iterations, latency_s=step, local_s=ring_s),
        replace(gather, local_s=gather_s),
    ], closed
