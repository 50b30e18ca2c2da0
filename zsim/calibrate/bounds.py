"""What physics allows a fitted link: the floors and ceilings `links.fit_links` keeps.

- **Latency floor.** A message cannot cross a route faster than a one-byte TCP ping-pong
  measures it (`pingpong`: half the round trip, the fastest of its trips). A route's latency in
  zsim is the sum of its links' (each class's latency times the links of that class it
  crosses), so the floor of a class is the ping-pong over a route of that class alone divided
  by its links, or, over a route that also crosses classes already floored, what remains after
  theirs. What gloo spends per message beyond the bare socket stays the ranks' `message_s`.
- **Bandwidth ceiling.** A link moves at most its line rate: the rate the topology names where
  it is a wire (the veth pairs' tc rate, a NIC's), and on loopback, where every byte a rank
  sends or receives is copied through the kernel by its own core, the rank's measured memcpy
  rate (`LocalWork.copy_bytes_per_s`).

A class with no ping-pong keeps floor 0 (nothing measured it), and one whose preset has no
line rate and is not loopback keeps no ceiling.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from zsim.calibrate.measurement import Kind, Measurement
from zsim.cluster.fabric import NETWORK_CLASSES, LinkClass
from zsim.cluster.topology import Topology


@dataclass(frozen=True)
class LinkBounds:
    latency_floor_s: dict[LinkClass, float]
    bandwidth_ceiling_bytes_per_s: dict[LinkClass, float]

    def latency_floor(self, cls: LinkClass) -> float:
        return self.latency_floor_s.get(cls, 0.0)

    def bandwidth_ceiling(self, cls: LinkClass) -> float | None:
        return self.bandwidth_ceiling_bytes_per_s.get(cls)


def group_gpus(topo: Topology, group: str, ranks: int) -> tuple[int, ...]:
    """The GPUs (ranks) of the measured group the calibration worker's rank 0 was in."""
    return concurrent_groups(topo, group, ranks)[0]


def concurrent_groups(topo: Topology, group: str, ranks: int) -> tuple[tuple[int, ...], ...]:
    """Every group of this kind that the calibration worker measures at once, rank 0's first:
    every rank calls the microbenchmark in its own group (`calibrate.worker.groups`: one per
    node for intra, one per local rank for inter), so the inter groups of a node share its
    links as they did when measured."""
    g, world = topo.gpus_per_node, topo.world_size
    if group == "intra":
        return tuple(tuple(range(n, n + min(ranks, g))) for n in range(0, world, g))
    if group == "inter":
        return tuple(tuple(range(j, world, g))[:ranks] for j in range(g))
    return (tuple(range(ranks)),)


def route_classes(topo: Topology, a: int, b: int) -> Counter[LinkClass]:
    """How many links of each class the route from GPU `a` to GPU `b` crosses."""
    return Counter(topo.link_class[e] for e in topo.route(a, b).links)


def one_way_floor_s(row: Measurement) -> float:
    """A ping-pong row's floor: its fastest one-way trip."""
    return float(np.min(row.samples_s))


def link_bounds(topo: Topology, rows: Sequence[Measurement]) -> LinkBounds:
    """The floors from the ping-pong rows among `rows` (routes of fewer classes first) and the
    ceilings from `topo` (with the profile's local rates applied)."""
    routes = []
    for row in rows:
        if row.kind is Kind.PINGPONG:
            a, b = group_gpus(topo, row.group, 2)[:2]
            routes.append((route_classes(topo, a, b), one_way_floor_s(row)))
    floors: dict[LinkClass, float] = {}
    for classes, t in sorted(routes, key=lambda r: len(r[0])):
        unknown = [c for c in classes if c not in floors]
        if len(unknown) != 1:
            continue  # every class already floored, or two unknowns on one route
        known = sum(n * floors[c] for c, n in classes.items() if c in floors)
        floors[unknown[0]] = max(0.0, (t - known) / classes[unknown[0]])
    return LinkBounds(floors, _ceilings(topo))


def _ceilings(topo: Topology) -> dict[LinkClass, float]:
    out: dict[LinkClass, float] = {}
    for cls in set(topo.link_class):
        if cls is LinkClass.LOOPBACK:
            out[cls] = float(topo.local_work.copy_bytes_per_s)
        elif cls in NETWORK_CLASSES:
            mask = np.array([c is cls for c in topo.link_class])
            out[cls] = float(np.min(topo.bandwidth_bytes_per_s[mask]))
    return out


def as_params(bounds: LinkBounds) -> dict[str, float]:
    """The bounds as the profile records them beside the fitted parameters."""
    out = {f"{c}.latency_floor_s": v for c, v in sorted(bounds.latency_floor_s.items())}
    ceilings = sorted(bounds.bandwidth_ceiling_bytes_per_s.items())
    return out | {f"{c}.bandwidth_ceiling_bytes_per_s": v for c, v in ceilings}
