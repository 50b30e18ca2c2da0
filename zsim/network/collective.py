"""The vocabulary of collectives: ops, calls, plans of phases, nccl-tests bandwidths, and
the closed alpha-beta form of each algorithm.

A `CollectiveCall` (op, bytes, GPU group, algorithm) is what the engine issues;
`zsim.network.plans.plan` turns it into a `Plan` (a fixed call latency, then phases run one after
another); `zsim.network.communicator` runs plans on the flow network.

Sizes follow nccl-tests (doc/PERFORMANCE.md): S is the whole buffer of all_reduce, broadcast
and reduce, the gathered output of all_gather, the input of reduce_scatter, the message of
send_recv and the per-rank input of all_to_all.

Closed forms: alpha is the latency of one step, B a rank's bandwidth (bytes/s, all channels
together). On a uniform network the flow simulation of each algorithm equals its form (a
test); on a real topology `zsim.network.plans` evaluates the form with alpha and B taken from the
pattern's routes, which is the fast path (`zsim.network.plans.estimate_s`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np

from zsim.cluster.build import IntArray
from zsim.errors import require
from zsim.network.flows import Flow


class CollectiveOp(StrEnum):
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"
    BROADCAST = "broadcast"
    REDUCE = "reduce"
    SEND_RECV = "send_recv"
    ALL_TO_ALL = "all_to_all"


class Algorithm(StrEnum):
    AUTO = "auto"  # what the backend would pick (NCCL: ring, or tree when cheaper)
    RING = "ring"  # the backend's flat algorithm (gloo: its only ones)
    TREE = "tree"  # NCCL all_reduce: chain in a node, double binary tree across nodes
    HIERARCHICAL = "hierarchical"  # intra-node, then inter-node, then intra-node stages


def bus_bandwidth_factor(op: CollectiveOp, n: int) -> float:
    """nccl-tests' busbw = algbw x factor (doc/PERFORMANCE.md; sendrecv.cu for send_recv)."""
    if op is CollectiveOp.ALL_REDUCE:
        return 2 * (n - 1) / n
    if op in (CollectiveOp.ALL_GATHER, CollectiveOp.REDUCE_SCATTER, CollectiveOp.ALL_TO_ALL):
        return (n - 1) / n
    return 1.0


def bandwidths(op: CollectiveOp, n: int, nbytes: float, time_s: float) -> tuple[float, float]:
    """(algbw, busbw) in bytes/s: algbw = S / t, busbw = algbw x factor."""
    algbw = nbytes / time_s if time_s > 0 else math.inf
    return algbw, algbw * bus_bandwidth_factor(op, n)


@dataclass(frozen=True, eq=False)
class CollectiveCall:
    """One collective the engine issues. `group` lists GPU ids in rank order; `root` is an
    index into it (broadcast, reduce); send_recv's group is (src, dst)."""

    op: CollectiveOp
    nbytes: float
    group: tuple[int, ...]
    algorithm: Algorithm = Algorithm.AUTO
    root: int = 0

    def __post_init__(self) -> None:
        require(self.nbytes >= 0, "bytes", self.nbytes, ">= 0")
        require(len(self.group) >= 1, "group", self.group, "at least one GPU")
        require(len(set(self.group)) == len(self.group), "group", self.group, "distinct GPUs")
        require(
            self.op is not CollectiveOp.SEND_RECV or len(self.group) == 2,
            "group",
            self.group,
            "(src, dst) for send_recv",
        )
        require(0 <= self.root < len(self.group), "root", self.root, "an index into the group")
        key = (self.op, self.nbytes, self.group, self.algorithm, self.root)
        object.__setattr__(self, "_hash", hash(key))  # a group of 100k GPUs hashes once

    def __hash__(self) -> int:
        return self._hash  # type: ignore[attr-defined, no-any-return]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CollectiveCall):
            return NotImplemented
        if self is other:
            return True
        return hash(self) == hash(other) and (
            self.op,
            self.nbytes,
            self.algorithm,
            self.root,
            self.group,
        ) == (other.op, other.nbytes, other.algorithm, other.root, other.group)


def _ids(values: Sequence[int] | IntArray) -> IntArray:
    array = np.asarray(values, dtype=np.int64).reshape(-1)
    array.flags.writeable = False
    return array


NO_GPUS = _ids(())


@dataclass(frozen=True, eq=False)
class Phase:
    """Flows that start together, then each member's own work; the phase ends when the last
    flow has ended and the local work is done. Flow i goes from GPU `src[i]` to `dst[i]`; every
    flow of a phase carries `nbytes` (per step), as every algorithm here sends equal pieces.

    `repeat`: identical consecutive steps, coalesced (see `zsim.network.flows`).
    `latency_s`: one step's latency for the whole phase (a pipelined ring's mean hop, a
    chain's or a tree's pipeline fill) instead of each flow's own route latency.
    `waits_for[i]`: flows of this phase that must end before flow i starts (a dataflow, as in
    gloo's binomial broadcast); None when all start at once.
    `local_s`: seconds every member then spends on its own CPU (gloo on the CPU fabric: copies,
    reductions, page faults, the cost of each message); it does not overlap the transfers, as
    a rank's one core also drives its TCP. A phase may be local work only (no flows).
    """

    src: IntArray = field(default_factory=lambda: NO_GPUS)
    dst: IntArray = field(default_factory=lambda: NO_GPUS)
    nbytes: float = 0.0
    repeat: int = 1
    latency_s: float | None = None
    waits_for: tuple[tuple[int, ...], ...] | None = None
    local_s: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "src", _ids(self.src))
        object.__setattr__(self, "dst", _ids(self.dst))
        require(self.src.shape == self.dst.shape, "phase", "src/dst", "one destination per flow")

    @classmethod
    def of(cls, flows: Sequence[Flow], **options: Any) -> Phase:
        """A phase of these flows (all of the same size)."""
        sizes = {f.nbytes for f in flows}
        require(len(sizes) <= 1, "phase", sorted(sizes)[:3], "flows of one size")
        src, dst = [f.src for f in flows], [f.dst for f in flows]
        return cls(_ids(src), _ids(dst), sizes.pop() if sizes else 0.0, **options)

    @property
    def size(self) -> int:
        return int(self.src.shape[0])

    @property
    def flows(self) -> tuple[Flow, ...]:
        return tuple(
            Flow(a, b, self.nbytes)
            for a, b in zip(self.src.tolist(), self.dst.tolist(), strict=True)
        )


@dataclass(frozen=True)
class Plan:
    """How a call runs: the backend's call latency, then the phases in order."""

    call: CollectiveCall
    algorithm: str  # resolved: nccl-ring, nccl-tree, nccl-hierarchical, nccl-p2p, gloo
    phases: tuple[Phase, ...]
    overhead_s: float
    closed_form_s: float  # the algorithm's alpha-beta time, call latency included


# ---- closed forms (alpha-beta), one per algorithm --------------------------------------


def ring_closed_form_s(op: CollectiveOp, n: int, nbytes: float, alpha_s: float, bw: float) -> float:
    """A ring on a uniform network of per-rank bandwidth `bw` (bytes/s, all channels):
    all_gather / reduce_scatter (n-1)(alpha + S/(n B)); all_reduce 2(n-1)(alpha + S/(n B));
    broadcast / reduce as a pipelined chain (n-1) alpha + S/B; send_recv alpha + S/B;
    all_to_all alpha + (n-1) S/(n B)."""
    if n == 1:
        return 0.0
    if op in (CollectiveOp.ALL_GATHER, CollectiveOp.REDUCE_SCATTER):
        return (n - 1) * (alpha_s + nbytes / (n * bw))
    if op is CollectiveOp.ALL_REDUCE:
        return 2 * (n - 1) * (alpha_s + nbytes / (n * bw))
    if op in (CollectiveOp.BROADCAST, CollectiveOp.REDUCE):
        return (n - 1) * alpha_s + nbytes / bw
    if op is CollectiveOp.ALL_TO_ALL:
        return alpha_s + (n - 1) * nbytes / (n * bw)
    return alpha_s + nbytes / bw


def chain_closed_form_s(
    n: int, nbytes: float, alpha_s: float, bw: float, chunk_bytes: float
) -> float:
    """A pipelined chain of n ranks (NCCL broadcast / reduce, per channel): the first chunk
    crosses n-1 hops ((n-1) alpha + (n-2) chunk / B), then the rest streams (S / B)."""
    if n == 1:
        return 0.0
    first_chunk = min(chunk_bytes, nbytes)
    return (n - 1) * alpha_s + max(n - 2, 0) * first_chunk / bw + nbytes / bw


def tree_closed_form_s(nbytes: float, pipeline_latency_s: float, bw: float) -> float:
    """NCCL's pipelined tree all_reduce: every GPU sends S up and S down in all, so
    2 S / B after the pipeline fills (NCCL's tuner: algbw = busBw / 2)."""
    return pipeline_latency_s + 2 * nbytes / bw


def gloo_closed_form_s(
    op: CollectiveOp, n: int, nbytes: float, alpha_s: float, bw: float, segments: int = 2
) -> float:
    """gloo's algorithms on the network, without the ranks' local work (added by the caller).

    gloo keeps two segments in flight (allreduce.cc, allgather.cc, reduce.cc), so a ring step's
    segments expose one latency alpha, not one each: exactly so when a step is two segments
    (S <= 2n MiB), and above that the segments' own transfers hide the rest. all_reduce (and
    reduce_scatter_tensor, an all_reduce of the input) is then the textbook ring
    2(n-1)(alpha + S/(n B)), all_gather (n-1)(alpha + S/(n B)). `segments` (k) matters only to
    reduce, whose ring sends n k - 2 segments of S/(n k) before the root gathers S/n from each."""
    if n == 1:
        return 0.0
    if op is CollectiveOp.ALL_REDUCE or op is CollectiveOp.REDUCE_SCATTER:
        return 2 * (n - 1) * (alpha_s + nbytes / (n * bw))
    if op is CollectiveOp.ALL_GATHER:
        return (n - 1) * (alpha_s + nbytes / (n * bw))
    if op is CollectiveOp.BROADCAST:
        return math.ceil(math.log2(n)) * (alpha_s + nbytes / bw)
    if op is CollectiveOp.REDUCE:
        ring = (n - 1) * alpha_s + (n * segments - 2) * nbytes / (n * segments * bw)
        return ring + alpha_s + (n - 1) * nbytes / (n * bw)
    if op is CollectiveOp.ALL_TO_ALL:
        return alpha_s + (n - 1) * nbytes / (n * bw)
    return alpha_s + nbytes / bw
