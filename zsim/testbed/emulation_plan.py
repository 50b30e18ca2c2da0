"""Which cluster to emulate for a topology: its nodes and ranks, its inter-node rate scaled down
to what this host sustains beside its ranks, and the zsim topology that amounts to. Calibration
and validation of an emulated cluster build it the same way, so a profile is calibrated on the
very link it is validated on."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from zsim.cluster.topology import Topology
from zsim.errors import positive_number
from zsim.testbed.emulate import EmulatedCluster, check_can_emulate

MAX_EMULATED_RATE_BPS = 125e6
"""The fastest emulated link that this kind of host sustains beside its ranks (tbf on veth was
measured at 0.96 Gbit/s); faster topologies are scaled down to it, and the scale recorded."""


def rate_name(rate_bps: float) -> str:
    """A rate in the topology grammar's unit, e.g. 125e6 bytes/s -> '1000mbit'."""
    mbit = f"{rate_bps * 8 / 1e6:.6f}".rstrip("0").rstrip(".")
    return f"{mbit}mbit"


@dataclass(frozen=True)
class EmulationPlan:
    """The cluster to emulate: the topology's inter-node rate times `scale` is applied."""

    nodes: int
    ranks_per_node: int
    topology_rate_bps: float
    scale: float
    latency_s: float = 0.0

    @property
    def rate_bps(self) -> float:
        return self.topology_rate_bps * self.scale

    @property
    def topology(self) -> str:
        """The zsim topology of the emulated cluster (what the simulator predicts)."""
        return f"{self.nodes}x{self.ranks_per_node}-cpu-{rate_name(self.rate_bps)}"

    @classmethod
    def of(cls, topo: Topology, scale: float | None = None) -> EmulationPlan:
        """`topo`'s nodes on this host (root, tc), at `scale` x its rate (default: down to
        `MAX_EMULATED_RATE_BPS`)."""
        check_can_emulate()
        rate = topo.fabric.nic.bandwidth_bytes_per_s
        chosen = min(1.0, MAX_EMULATED_RATE_BPS / rate) if scale is None else scale
        positive_number("scale", chosen)
        return cls(topo.nodes, topo.gpus_per_node, rate, chosen, topo.fabric.nic.latency_s)


@contextlib.contextmanager
def emulated(plan: EmulationPlan | None) -> Iterator[EmulatedCluster | None]:
    """The emulated cluster of `plan` while the block runs (None without a plan)."""
    if plan is None:
        yield None
        return
    with EmulatedCluster(
        nodes=plan.nodes,
        ranks_per_node=plan.ranks_per_node,
        rate_bps=plan.topology_rate_bps,
        scale=plan.scale,
        latency_s=plan.latency_s,
    ) as cluster:
        yield cluster
