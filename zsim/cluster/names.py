"""Cluster names: `NxG-fabric[-rate]`, N nodes of G GPUs of a fabric preset, e.g.
`2x4-ethernet`; `2x2-cpu-1gbit` also sets the NIC rate (tc's units, bits per second)."""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass

from zsim.errors import InputError, choose, positive_int, require

GRAMMAR = (
    "NxG-FABRIC[-RATE]: N nodes of G GPUs, e.g. 2x4-ethernet, 2x2-cpu-1gbit (RATE: kbit/mbit/gbit)"
)


_NAME = re.compile(r"^(\d+)x(\d+)-([a-z0-9][a-z0-9-]*?)(?:-(\d+(?:\.\d+)?)(kbit|mbit|gbit))?$")


_RATE_SCALE = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


@dataclass(frozen=True)
class ClusterName:
    """A parsed `NxG-fabric[-rate]` name."""

    nodes: int
    gpus_per_node: int
    fabric: str
    nic_rate_bytes_per_s: float | None  # from a -RATE suffix (tc's units: bits per second)


def fabric_of(name: str) -> str:
    """The fabric part of a cluster name (`4x8-dgx-a100` -> `dgx-a100`), without checking it
    is a preset; anything else (a cluster file's path) as it is."""
    match = _NAME.match(name)
    return match.group(3) if match else name


def parse_cluster_name(name: str, fabrics: Collection[str]) -> ClusterName:
    match = _NAME.match(name)
    if not match:
        raise InputError("topology", name, f"{GRAMMAR}; fabrics: {', '.join(sorted(fabrics))}")
    nodes, gpus, fabric, rate, unit = match.groups()
    try:
        fabric = choose("topology fabric", fabric, sorted(fabrics))
    except InputError as exc:
        raise InputError("topology", name, f"{GRAMMAR}; {exc.allowed}") from None
    bits = None if rate is None else float(rate) * _RATE_SCALE[unit]
    require(bits is None or bits > 0, "topology", name, "a positive rate")
    return ClusterName(
        positive_int("topology nodes", int(nodes)),
        positive_int("topology GPUs per node", int(gpus)),
        fabric,
        None if bits is None else bits / 8,
    )
