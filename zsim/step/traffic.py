"""What a step puts on the network, counted from the calls the simulated ranks issue (not from
the flows the network happened to carry): bytes each simulated rank sends, by category, and
bytes on each link class in the whole cluster.

In symmetric mode a call stands for the same call in every group of its kind at its pipeline
stage (`copies`: the data- and tensor-parallel peers simulated once), as the engine's timing
assumes; with every rank simulated, each group's call is counted by itself.
"""

from __future__ import annotations

from collections.abc import Callable, Set

import numpy as np

from zsim.cluster.build import CLASSES, FloatArray
from zsim.network.collective import CollectiveCall
from zsim.network.communicator import Communicator
from zsim.step.program import Category, Part


class Traffic:
    def __init__(self, comms: Communicator, simulated: Set[int]) -> None:
        self.comms = comms
        self.simulated = simulated
        self.sent: dict[str, float] = {}  # by category, summed over the simulated ranks
        self.links = np.zeros(len(CLASSES))  # bytes per link class, whole cluster
        self._sent: dict[tuple[CollectiveCall, int | None], float] = {}
        self._passes: dict[tuple[int, int], tuple[object, dict[str, float], FloatArray]] = {}

    def book(
        self,
        call: CollectiveCall,
        category: Category,
        sender: int | None = None,
        copies: int = 1,
        times: int = 1,
    ) -> None:
        """One call (or `times` the same): the bytes the simulated ranks among its members (or
        `sender` alone) send, and `copies` x the bytes its flows put on each link class."""
        sent = times * self.sent_bytes(call, sender)
        self.sent[category] = self.sent.get(category, 0.0) + sent
        self.links += (times * copies) * self.comms.class_bytes(call)

    def book_pass(
        self,
        rank: int,
        parts: tuple[Part, ...],
        calls: Callable[[int, tuple[Part, ...]], list[tuple[CollectiveCall, int]]],
        times: int = 1,
    ) -> None:
        """A fused pass's collectives (`calls` resolves its parts' calls and copies), summed
        once per pass and rank: the builder shares one parts tuple among micro-batches.
        `times`: passes of this kind booked at once."""
        key = (rank, id(parts))
        found = self._passes.get(key)
        if found is None:
            sent: dict[str, float] = {}
            links = np.zeros(len(CLASSES))
            for (call, copies), part in zip(
                calls(rank, parts), [p for p in parts if p.comm is not None], strict=True
            ):
                sent[part.category] = sent.get(part.category, 0.0) + self.sent_bytes(call, rank)
                links += copies * self.comms.class_bytes(call)
            found = self._passes[key] = (parts, sent, links)  # holding `parts` keeps its id
        for category, nbytes in found[1].items():
            self.sent[category] = self.sent.get(category, 0.0) + times * nbytes
        self.links += times * found[2]

    def sent_bytes(self, call: CollectiveCall, sender: int | None = None) -> float:
        key = (call, sender)
        if key not in self._sent:
            senders = call.group if sender is None else (sender,)
            simulated = np.asarray(sorted(set(senders) & self.simulated), dtype=np.int64)
            self._sent[key] = sum(
                phase.nbytes * phase.repeat * int(np.isin(phase.src, simulated).sum())
                for phase in self.comms.plan(call).phases
            )
        return self._sent[key]

    def by_link_class(self) -> dict[str, float]:
        """Bytes carried per link class (summed over its directed links), classes used only."""
        return {str(CLASSES[i]): float(v) for i, v in enumerate(self.links.tolist()) if v}
