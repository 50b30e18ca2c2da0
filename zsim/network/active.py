"""The flows in their data phase (as cohorts), indexed by the capacities they draw on, so that
what a change touches is found without looking at everything else on the network: a cohort's
neighbours share a capacity with it, and a connected component of them is solved alone."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Generic, Protocol, TypeVar

import numpy as np

from zsim.network.rates import FlowSets

SMALL = 64
"""Flow sets drawing on at most this many capacities are indexed capacity by capacity; larger
ones (a collective over many GPUs: few at a time) are compared pairwise."""


class _Cohort(Protocol):
    flow_set: int
    count: int


C = TypeVar("C", bound=_Cohort)


class ActiveCohorts(Generic[C]):
    """Cohorts by id, with the capacities each one's flows draw on."""

    def __init__(self, sets: FlowSets) -> None:
        self.sets = sets
        self._cohorts: dict[int, C] = {}
        self._next = 0
        self._by_resource: dict[int, set[int]] = {}
        self._big: set[int] = set()
        self._resources: dict[int, tuple[int, ...] | None] = {}  # None: a big flow set

    def add(self, cohort: C) -> int:
        key = self._next
        self._next += 1
        self._cohorts[key] = cohort
        resources = self._of(cohort.flow_set)
        if resources is None:
            self._big.add(key)
        else:
            for r in resources:
                self._by_resource.setdefault(r, set()).add(key)
        return key

    def pop(self, key: int) -> C:
        cohort = self._cohorts.pop(key)
        resources = self._of(cohort.flow_set)
        if resources is None:
            self._big.discard(key)
        else:
            for r in resources:
                holders = self._by_resource[r]
                holders.discard(key)
                if not holders:
                    del self._by_resource[r]
        return cohort

    def ids(self) -> set[int]:
        return self._cohorts.keys()  # type: ignore[return-value]  # a live, set-like view

    def flows(self) -> int:
        return sum(c.count for c in self._cohorts.values())

    def neighbours(self, flow_set: int) -> set[int]:
        """Active cohorts whose flows share a capacity with this flow set's."""
        resources = self._of(flow_set)
        overlap = self.sets.overlap
        found = {b for b in self._big if overlap(flow_set, self._cohorts[b].flow_set)}
        if resources is not None:
            for r in resources:
                found |= self._by_resource.get(r, set())
            return found
        small = (k for k, c in self._cohorts.items() if k not in self._big)
        return found | {k for k in small if overlap(flow_set, self._cohorts[k].flow_set)}

    def shares(self, flow_set: int) -> bool:
        """Whether any active cohort shares a capacity with this flow set (`neighbours`,
        stopping at the first)."""
        if not self._cohorts:
            return False
        resources = self._of(flow_set)
        if resources is None:
            return bool(self.neighbours(flow_set))
        # a capacity is a key while some cohort holds it
        if not self._by_resource.keys().isdisjoint(resources):
            return True
        overlap = self.sets.overlap
        return any(overlap(flow_set, self._cohorts[b].flow_set) for b in self._big)

    def small_resources(self, flow_set: int) -> tuple[int, ...] | None:
        """The capacities of a flow set drawing on few (None for a big one)."""
        return self._of(flow_set)

    def component(self, seeds: Iterable[int]) -> set[int]:
        """The cohorts connected to `seeds` through shared capacities, seeds included."""
        reached = set(seeds)
        frontier = list(reached)
        while frontier:
            key = frontier.pop()
            for other in self.neighbours(self._cohorts[key].flow_set) - reached:
                reached.add(other)
                frontier.append(other)
        return reached

    def _of(self, flow_set: int) -> tuple[int, ...] | None:
        found = self._resources.get(flow_set, ())
        if found == ():
            pairs = self.sets.flow_set(flow_set).pair_resource
            unique = np.unique(pairs) if len(pairs) <= 4 * SMALL else pairs[: SMALL + 1]
            found = self._resources[flow_set] = (
                tuple(unique.tolist()) if len(unique) <= SMALL else None
            )
        return found
