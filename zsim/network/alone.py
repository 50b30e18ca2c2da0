"""Transfers timed alone: a point-to-point send that shares no capacity with any other flow
moves at its lone rate (its route's narrowest capacity) from the end of its latency to its
last byte, so it needs no place among the network's flows. A pipeline's sends are mostly such:
timing them alone saves every settle they would cost. The moment another flow comes to share a
capacity with one, it joins the network as a flow with the bytes it has left (`FlowNetwork`
converts it), so the times are those of simulating it as a flow throughout."""

from __future__ import annotations

from dataclasses import dataclass

import simpy


@dataclass(eq=False)
class Lone:
    """A transfer timed alone: `nbytes` of flow set `flow_set`, moving from `data_at` at `rate`
    until `ends`; `event` fires then (or when it ends as a flow, once converted)."""

    flow_set: int
    nbytes: float
    data_at: float
    rate: float
    ends: float
    event: simpy.Event
    resources: tuple[int, ...]
    active: bool = True

    def left(self, now: float) -> float:
        """Bytes still to move at `now` (all of them before its data starts)."""
        return (
            self.nbytes if now <= self.data_at else self.nbytes - self.rate * (now - self.data_at)
        )


class LoneTransfers:
    """The transfers timed alone, by the capacities they draw on."""

    def __init__(self) -> None:
        self._by_resource: dict[int, Lone] = {}

    def __len__(self) -> int:
        return len({id(lone) for lone in self._by_resource.values()})

    def add(self, lone: Lone) -> None:
        for r in lone.resources:
            self._by_resource[r] = lone

    def remove(self, lone: Lone) -> None:
        lone.active = False
        for r in lone.resources:
            if self._by_resource.get(r) is lone:
                del self._by_resource[r]

    def on(self, resources: tuple[int, ...]) -> list[Lone]:
        """The transfers drawing on any of these capacities."""
        found = {id(lone): lone for r in resources if (lone := self._by_resource.get(r))}
        return list(found.values())

    def all(self) -> list[Lone]:
        return list({id(lone): lone for lone in self._by_resource.values()}.values())
