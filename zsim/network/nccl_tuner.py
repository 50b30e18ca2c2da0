"""NCCL's own model of a collective's time (src/graph/tuning.cc, v2.30.7): which protocol
(LL, LL128, Simple) and algorithm (ring, tree) it picks for a size, and the latency it pays.

NCCL times each (algorithm, protocol) as `latency + bytes / algbw` and runs the fastest. The
latency is a base per call plus a hardware latency per pipeline step, much larger for Simple
(3.4 us per NVLink ring step, 14 us per network step) than for LL (0.6, 2.7): small messages go
LL at half the bandwidth (each 8-byte line carries 4 bytes of data and a 4-byte flag), large
ones Simple at full bandwidth but with the larger step latency, which at hundreds of ranks is
most of a ZeRO-3 gather's time.

zsim keeps its route latencies (a preset's hops sum to the LL step latencies, and a user's
slower network adds its own) and adds what the chosen protocol costs beyond LL, as the tuner
counts it. Values below are the tuner's defaults; the CPU vendor and the GPU generation select
among them as NCCL does. Not modelled: NVLS, CollNet and PAT (not used on the presets' fabrics
without SHARP), the per-channel thread counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from zsim.network.collective import CollectiveOp


class Protocol(StrEnum):
    LL = "ll"
    LL128 = "ll128"
    SIMPLE = "simple"


class Hw(StrEnum):
    NVLINK = "nvlink"
    PCI = "pci"
    NET = "net"


PROTOCOLS = (Protocol.LL, Protocol.LL128, Protocol.SIMPLE)

BASE_LATENCY_US = {
    "tree": dict(zip(PROTOCOLS, (6.8, 14.0, 8.4), strict=True)),
    "ring": dict(zip(PROTOCOLS, (6.6, 14.0, 8.4), strict=True)),
}
"""`baseLatencies` (tuning.cc): per call, by algorithm and protocol."""

HW_LATENCY_US = {
    Hw.NVLINK: {
        "tree": dict(zip(PROTOCOLS, (0.6, 1.25, 4.0), strict=True)),
        "ring": dict(zip(PROTOCOLS, (0.6, 1.9, 3.4), strict=True)),
    },
    Hw.PCI: {
        "tree": dict(zip(PROTOCOLS, (1.0, 1.9, 4.0), strict=True)),
        "ring": dict(zip(PROTOCOLS, (1.0, 2.5, 5.7), strict=True)),
    },
    Hw.NET: {
        "tree": dict(zip(PROTOCOLS, (5.0, 8.5, 14.0), strict=True)),
        "ring": dict(zip(PROTOCOLS, (2.7, 4.0, 14.0), strict=True)),
    },
}
"""`hwLatencies` (tuning.cc): per pipeline step, by hardware, algorithm and protocol."""

WIRE_EFFICIENCY = {Protocol.LL: 0.5, Protocol.LL128: 120 / 128, Protocol.SIMPLE: 1.0}
"""Data bytes per byte on the wire: LL sends a 4-byte flag with every 4 bytes of data, LL128
one 8-byte flag per 128-byte line (src/include/device.h: NCCL_LL_LINES, NCCL_LL128_DATAELEMS)."""

_LL_MAX_BW = {"intel": (39.0, 39.0, 20.4), "amd": (87.7, 22.5, 19.0)}
"""`llMaxBws` for multi-node (row by CPU vendor: Intel row 0, AMD row 1), GB/s."""
_LL_MAX_BW_ONE_NODE = {70: 39.0, 80: 87.7, 90: 141.0, 100: 282.0}
"""`llMaxBws` for one node, by GPU generation (compute capability x10)."""
_PER_CHANNEL_LL128_RING = {70: 20.0, 80: 20.0, 90: 36.7, 100: 40.0}
_PER_CHANNEL_TREE = {70: (26.5, 18.5, 10.0), 80: (24.0, 23.6, 17.8), 90: (38.7, 41.4, 36.0),
                     100: (70.0, 42.8, 24.0)}  # fmt: skip
_PER_CHANNEL_LL128_TREE = {70: (20.0, 20.0, 20.0), 80: (20.0, 20.0, 20.0),
                           90: (36.7, 36.7, 29.0), 100: (55.6, 31.67, 20.0)}  # fmt: skip
_TREE_CORRECTION = {
    Protocol.LL: (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9,
                  1.0, 1.0, 1.0, 1.0, 1.0),
    Protocol.LL128: (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9,
                     .9, .9, .9, 1.0, 1.0, 1.0),
    Protocol.SIMPLE: (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7,
                      .7, .8, .9, .9, .9),
}  # fmt: skip
"""`treeCorrectionFactor` by log2(bytes / 64): the tree's bandwidth at mid sizes."""

_NET_OVERHEAD_US = {"intel": 1.0, "amd": 2.0}
"""`getNetOverhead`: the host's cost to post a network step (tripled for Simple)."""

PLATEAU = {True: 1.4, False: 1.9}
"""`ncclTopoGetAlgoTime`'s ring plateau factor, from Ampere on (True) and before."""


@dataclass(frozen=True)
class NcclComm:
    """What the tuner knows about a communicator."""

    ranks: int
    nodes: int
    intra: Hw  # NVLINK or PCI: how GPUs of a node reach each other
    channels: int
    sm: int = 80
    cpu: str = "intel"
    ll128: bool = True  # LL128 enabled (NVLink inside nodes, NICs reached through PCIe switches)

    @property
    def _gen(self) -> int:
        return max(g for g in (70, 80, 90, 100) if g <= max(self.sm, 70))

    @property
    def _index2(self) -> int:
        return self.nodes - 1 if self.nodes <= 2 else 2


def _steps(op: CollectiveOp, ranks: int) -> int:
    if op is CollectiveOp.ALL_REDUCE:
        return 2 * (ranks - 1)
    return ranks - 1 if op in (CollectiveOp.ALL_GATHER, CollectiveOp.REDUCE_SCATTER) else ranks


def _step_latencies_us(algorithm: str, protocol: Protocol, comm: NcclComm) -> tuple[float, float]:
    """(intra-node, inter-node) step latency; one rank per node pays the tree's network value."""
    intra = HW_LATENCY_US[comm.intra][algorithm][protocol]
    ppn_one = comm.ranks == comm.nodes
    inter = HW_LATENCY_US[Hw.NET]["tree" if ppn_one else algorithm][protocol]
    return intra, inter


def steps_latency_us(
    op: CollectiveOp, algorithm: str, protocol: Protocol, comm: NcclComm, floor: bool = True
) -> float:
    """The tuner's latency without the base: a ring's steps (inter-node steps at the network
    latency, the rest at the intra-node one, floored by the host's network post overhead when
    the ring leaves the node) or a tree's up-and-down pipeline fill. `floor=False`: without the
    overhead floor (what route latencies sum to)."""
    intra, inter = _step_latencies_us(algorithm, protocol, comm)
    if comm.nodes == 1:
        inter = 0.0
    if algorithm == "tree":
        return 2 * ((comm.ranks // comm.nodes - 1) * intra + _log2i(comm.nodes) * inter)
    if floor and comm.nodes > 1:
        overhead = _NET_OVERHEAD_US[comm.cpu] * (3 if protocol is Protocol.SIMPLE else 1)
        intra = max(intra, overhead)
    steps = _steps(op, comm.ranks)
    inter_steps = (
        0 if comm.nodes == 1 else (2 if op is CollectiveOp.ALL_REDUCE else 1) * (comm.nodes - 1)
    )
    return (steps - inter_steps) * intra + inter_steps * inter


def latency_us(
    op: CollectiveOp, algorithm: str, protocol: Protocol, comm: NcclComm, nbytes: float
) -> float:
    """NCCL's `latencies[coll][a][p]`, with `ncclTopoGetAlgoTime`'s ring plateau (x1.4 from
    Ampere on, x1.9 before, for a multi-node Simple ring all_reduce of 64+ bytes per rank per
    channel)."""
    total = BASE_LATENCY_US[algorithm][protocol] + steps_latency_us(op, algorithm, protocol, comm)
    if _plateau(op, algorithm, protocol, comm, nbytes):
        total *= PLATEAU[comm.sm >= 80]
    return total


def _plateau(
    op: CollectiveOp, algorithm: str, protocol: Protocol, comm: NcclComm, nbytes: float
) -> bool:
    per_rank = nbytes / (comm.channels * comm.ranks)
    return (
        algorithm == "ring"
        and protocol is Protocol.SIMPLE
        and comm.nodes > 1
        and op is CollectiveOp.ALL_REDUCE
        and per_rank >= 64
    )


def extra_latency_s(
    op: CollectiveOp,
    algorithm: str,
    protocol: Protocol,
    comm: NcclComm,
    nbytes: float,
    call_latency_s: float,
) -> float:
    """What the protocol costs beyond the route latencies and the call latency: the tuner's
    step latencies less its LL steps without the floor (what a preset's hops sum to), and the
    ring plateau's share of the whole (the call latency standing for the tuner's base)."""
    chosen = steps_latency_us(op, algorithm, protocol, comm)
    route_like = steps_latency_us(op, algorithm, Protocol.LL, comm, floor=False)
    extra = (chosen - route_like) * 1e-6
    if _plateau(op, algorithm, protocol, comm, nbytes):
        extra += (PLATEAU[comm.sm >= 80] - 1) * (call_latency_s + chosen * 1e-6)
    return extra


def bus_bandwidth(algorithm: str, protocol: Protocol, comm: NcclComm, bus: float) -> float:
    """The tuner's bus bandwidth (bytes/s) for a protocol, from zsim's bus bandwidth `bus`
    (a rank's share over all channels): LL at half (capped by `llMaxBw`), LL128 at 0.92
    (capped per channel), the tree at 0.92 (and its own protocol factors and caps)."""
    gb = 1e9
    ll_cap = (
        _LL_MAX_BW_ONE_NODE[comm._gen]
        if comm.nodes == 1
        else _LL_MAX_BW["amd" if comm.cpu == "amd" else "intel"][comm._index2]
    ) * gb
    ch = comm.channels
    if algorithm == "ring":
        if protocol is Protocol.LL:
            return min(ll_cap, bus * 0.5)
        if protocol is Protocol.LL128:
            return min(bus * 0.92, ch * _PER_CHANNEL_LL128_RING[comm._gen] * gb)
        return bus
    tree = min(bus * 0.92, ch * _PER_CHANNEL_TREE[comm._gen][comm._index2] * gb)
    if protocol is Protocol.LL:
        return min(tree / 3.8, ll_cap)
    if protocol is Protocol.LL128:
        factor = 7 / 9 if comm.nodes == 1 else 120 / 128
        return min(tree * factor, ch * _PER_CHANNEL_LL128_TREE[comm._gen][comm._index2] * gb)
    return tree


def time_s(
    op: CollectiveOp,
    algorithm: str,
    protocol: Protocol,
    comm: NcclComm,
    nbytes: float,
    bus: float,
) -> float:
    """`ncclTopoGetAlgoTime` for one call: latency + bytes / algbw, the ring's algbw being
    busBw n / steps, the tree's busBw / 2 (times its correction by size)."""
    bw = bus_bandwidth(algorithm, protocol, comm, bus)
    if algorithm == "ring":
        bw *= comm.ranks / _steps(op, comm.ranks)
    else:
        bw *= 0.5
        log_size = _log2i(int(nbytes) >> 6)
        if 0 <= log_size < 23:
            bw *= _TREE_CORRECTION[protocol][log_size]
    return latency_us(op, algorithm, protocol, comm, nbytes) * 1e-6 + nbytes / bw


def choose(
    op: CollectiveOp,
    comm: NcclComm,
    nbytes: float,
    buses: dict[str, float],
    protocols: tuple[Protocol, ...] = PROTOCOLS,
) -> tuple[str, Protocol]:
    """The (algorithm, protocol) NCCL runs: the fastest by `time_s` among the algorithms in
    `buses` (name -> zsim's bus bandwidth there) and the enabled `protocols` (NCCL_PROTO)."""
    enabled = [p for p in protocols if comm.ll128 or p is not Protocol.LL128] or list(protocols)
    options = [(a, p) for a in buses for p in enabled]
    return min(options, key=lambda o: time_s(op, o[0], o[1], comm, nbytes, buses[o[0]]))


def _log2i(n: int) -> int:
    """NCCL's `log2i`: floor(log2 n), -1 for n <= 0."""
    return n.bit_length() - 1 if n > 0 else -1
