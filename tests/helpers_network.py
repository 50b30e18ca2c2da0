"""Small topologies built for tests: a uniform star and a two-leaf fabric.

They go through the same validation as a user's cluster file, so they exercise it too.
"""

from __future__ import annotations

from typing import Any

from zsim.cluster.fabric import fabric_from_mapping
from zsim.cluster.topology import Topology, build_topology
from zsim.inputs import presets


def cluster(data: dict[str, Any], nodes: int, gpus: int, name: str = "test") -> Topology:
    spec = fabric_from_mapping(data, name, presets.gpu_names())
    return build_topology(name, spec, nodes, gpus)


def uniform_star(
    n: int,
    bandwidth_gbps: float,
    step_latency_us: float,
    backend: str = "nccl",
    duplex: str = "full",
    local_work: dict[str, float] | None = None,
) -> Topology:
    """n ranks on one host, each with its own link of `bandwidth_gbps` GB/s per direction
    (`duplex: half`: both directions together) to a central switch; a rank-to-rank step
    crosses two links of half the latency each. `local_work`: the fabric's section (gloo)."""
    data: dict[str, Any] = {
        "gpu": None,
        "gpus_per_node": [n],
        "backend": {"name": backend, "call_latency_us": 0, "protocol": "ideal"},
        "loopback": {
            "bandwidth_GBps": bandwidth_gbps,
            "latency_us": step_latency_us / 2,
            "duplex": duplex,
        },
        "nics": {"per_node": 1, "rate_Gbps": 8, "link_class": "veth", "attach": "host"},
        "network": {"leaf_ports": 8, "oversubscription": 1.0},
    }
    if local_work is not None:
        data["local_work"] = local_work
    return cluster(data, 1, n, f"star{n}")


def two_leaves(oversubscription: float) -> Topology:
    """4 nodes of 1 GPU, 1 x 100 Gb/s NIC each, 2 NICs per leaf: nodes 0-1 and 2-3 on
    different leaves, joined by a spine whose uplinks are 2 x 12.5 GB/s / oversubscription."""
    data = {
        "gpu": "a100-80gb",
        "gpus_per_node": [1],
        "backend": {"name": "nccl", "call_latency_us": 0, "protocol": "ideal"},
        "pcie": {"bandwidth_GBps": 1000, "latency_us": 0},
        "nics": {
            "per_node": 1,
            "rate_Gbps": 100,
            "link_class": "ethernet",
            "attach": "host",
            "latency_us": 0,
        },
        "network": {"leaf_ports": 2, "oversubscription": oversubscription, "latency_us": 0},
    }
    return cluster(data, 4, 1, f"two-leaves-1:{oversubscription:g}")
