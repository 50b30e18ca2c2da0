"""The bytes of every flow that has ended, booked to its source and destination GPU and to each
link it crossed: traffic reports come from the simulated flows themselves."""

from __future__ import annotations

import numpy as np

from zsim.cluster.build import CLASSES, FloatArray
from zsim.cluster.fabric import LinkClass
from zsim.cluster.topology import Topology
from zsim.network.rates import FlowSets


class Booked:
    """Ended flows, by flow set: `book` them as they end (summed per flow set: a pipeline ends
    the same few kinds of flow thousands of times); read per GPU, link or link class."""

    def __init__(self, topology: Topology, sets: FlowSets) -> None:
        self.topology = topology
        self.sets = sets
        self.flows = 0  # how many flows have ended
        self._ended: dict[int, float] = {}  # flow set -> bytes per flow, summed
        self._counts: dict[int, int] = {}  # flow set -> its flows

    def book(self, flow_set: int, nbytes: float, times: int = 1) -> None:
        """Every flow of `flow_set` carried `nbytes` (`times` over)."""
        count = self._counts.get(flow_set)
        if count is None:
            count = self._counts[flow_set] = self.sets.flow_set(flow_set).count
        self.flows += times * count
        self._ended[flow_set] = self._ended.get(flow_set, 0.0) + times * nbytes

    def by_link_class(self) -> dict[LinkClass, float]:
        """Bytes carried so far, summed over the directed links of each class."""
        total = np.zeros(len(CLASSES))
        for flow_set, nbytes in self._ended.items():
            total += nbytes * self.sets.flow_set(flow_set).class_pairs
        used = np.unique(self.topology.class_id)
        return {CLASSES[i]: float(total[i]) for i in used.tolist()}

    def per_link(self) -> FloatArray:
        out = np.zeros(self.topology.edge_count)
        for flow_set, nbytes in self._ended.items():
            np.add.at(out, self.sets.flow_set(flow_set).pair_edge, nbytes)
        return out

    def per_gpu(self, source: bool) -> FloatArray:
        """Bytes each GPU sent (`source`) or received."""
        out = np.zeros(self.topology.world_size)
        for flow_set, nbytes in self._ended.items():
            fs = self.sets.flow_set(flow_set)
            np.add.at(out, fs.src if source else fs.dst, nbytes)
        return out
