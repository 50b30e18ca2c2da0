"""Transfers timed alone: a point-to-point send that shares no capacity with any other flow
moves at its lone rate (its route's narrowest capacity) from the end of its latency to its
last byte, so it needs no place among the network's flows. A pipeline's sends are mostly such:
timing them alone saves every settle they would cost. The moment another flow comes to share a
capacity with one, it joins the network as a flow with the bytes it has left (`FlowNetwork`
converts it), so the times are those of simulating it as a flow throughout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import simpy

from zsim.cluster.build import distinct, distinct_counts
from zsim.network.active import ActiveCohorts
from zsim.network.rates import FlowSets


class AloneTerms(NamedTuple):
    """A send timed alone: its flow set, the capacities it draws on, its route's latency and
    its lone rate (the narrowest capacity)."""

    flow_set: int
    resources: tuple[int, ...]
    latency_s: float
    rate: float
    alongside: int = -1  # the flow set of its copies (-1: none)
    loads: tuple[float, ...] = ()  # bytes/s it and its copies put on each of `resources`

    @property
    def flow_sets(self) -> tuple[int, ...]:
        """Its own flow set and its copies', if any."""
        return (self.flow_set,) if self.alongside < 0 else (self.flow_set, self.alongside)


MAX_COPY_RESOURCES = 4096  # capacities a send's copies may draw on and still be timed alone


@dataclass(eq=False)
class Lone:
    """A transfer timed alone (`terms`): `nbytes` moving from `data_at` at the lone rate until
    `ends`, when `event` (a timeout) fires; converted to a flow, its callbacks move to the
    flow's end. Its copies on other ranks (`terms.alongside`), which only load the links, move
    with it at the same rate."""

    terms: AloneTerms
    nbytes: float
    data_at: float
    ends: float
    event: simpy.Event
    active: bool = True

    @property
    def resources(self) -> tuple[int, ...]:
        return self.terms.resources

    def left(self, now: float) -> float:
        """Bytes still to move at `now` (all of them before its data starts)."""
        moved = 0.0 if now <= self.data_at else self.terms.rate * (now - self.data_at)
        return self.nbytes - moved


class LoneTransfers:
    """The transfers timed alone, by the capacities they draw on."""

    def __init__(self) -> None:
        self._by_resource: dict[int, Lone] = {}

    def __len__(self) -> int:
        return len({id(lone) for lone in self._by_resource.values()})

    def add(self, lone: Lone) -> None:
        """A transfer on capacities none holds (one that would share them is a flow)."""
        self._by_resource.update(dict.fromkeys(lone.resources, lone))

    def remove(self, lone: Lone) -> None:
        lone.active = False
        for r in lone.resources:  # each maps to it alone (`add`)
            del self._by_resource[r]

    def holds_any(self, resources: tuple[int, ...]) -> bool:
        """Whether a transfer draws on any of these capacities (`on`, stopping at the first)."""
        return not self._by_resource.keys().isdisjoint(resources)

    def on(self, resources: tuple[int, ...]) -> list[Lone]:
        """The transfers drawing on any of these capacities."""
        if self._by_resource.keys().isdisjoint(resources):
            return []
        found = {id(lone): lone for r in resources if (lone := self._by_resource.get(r))}
        return list(found.values())

    def all(self) -> list[Lone]:
        return list({id(lone): lone for lone in self._by_resource.values()}.values())


def solve_alone(
    sets: FlowSets,
    index: ActiveCohorts[Any],
    src: int,
    dst: int,
    alongside: tuple[tuple[int, int], ...],
) -> AloneTerms | None:
    """How a send src -> dst, with its copies, is timed alone (`FlowNetwork.alone_terms`);
    None when it cannot be: it crosses no link, draws on too many capacities to track, or its
    copies would move at another rate or after another latency than it."""
    mine = sets.pattern(np.array([src]), np.array([dst]))
    flow_set, others = mine.moving_set, -1
    resources = index.small_resources(flow_set) if flow_set >= 0 else None
    if resources is None:
        return None
    if alongside:
        theirs = sets.pattern(
            np.array([s for s, _ in alongside]), np.array([d for _, d in alongside])
        )
        others = theirs.moving_set
        more = distinct(sets.flow_set(others).pair_resource) if others >= 0 else None
        if more is None or len(more) > MAX_COPY_RESOURCES:
            return None
        if theirs.local_count or len(theirs.by_latency) != 1:
            return None
        if theirs.by_latency[0][0] != mine.by_latency[0][0]:
            return None  # the copies' data would start at another time
    solved = sets.rates(tuple(sorted({flow_set, others} - {-1})))
    rates = {rate for parts in solved for _, rate in parts}
    if len(rates) != 1:
        return None  # the copies would not move as one
    rate = rates.pop()
    crossing = np.concatenate(
        [sets.flow_set(f).pair_resource for f in (flow_set, others) if f >= 0]
    )
    used, flows = distinct_counts(crossing)
    loads = tuple((flows * rate).tolist())
    return AloneTerms(flow_set, tuple(used.tolist()), mine.by_latency[0][0], rate, others, loads)
