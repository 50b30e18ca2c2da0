"""What an engine run leaves behind: a span per task, and a record per fused pass.

A fused pass (a pass of fixed-time work run as one task) keeps its parts as the template the
builder shares among every micro-batch's pass of one chunk, not as spans: a 175B pipeline
step runs hundreds of thousands of parts, and every pass of a kind repeats its template
exactly, shifted to the pass's start.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from zsim.step.program import Part, Stream


class Span(NamedTuple):
    """One task's (or one part's) execution on one rank."""

    rank: int
    stream: Stream
    name: str
    category: str
    start_s: float
    end_s: float
    nbytes: float = 0.0


class FusedPass(NamedTuple):
    """A pass run as one task (`kernels.fused_pass`); `parts` (starts relative to the pass's)
    is one tuple shared by every pass of its kind, so `id(parts)` names the kind."""

    rank: int
    name: str
    category: str
    stream: Stream
    start_s: float
    end_s: float
    parts: tuple[Part, ...]

    def spans(self) -> list[Span]:
        """The parts as spans, on the pass's stream (the one it occupied)."""
        return [
            Span(
                self.rank,
                self.stream,
                p.name,
                str(p.category),
                self.start_s + p.start_s,
                self.start_s + p.start_s + p.duration_s,
                p.comm.nbytes if p.comm is not None else 0.0,
            )
            for p in self.parts
        ]


@dataclass(frozen=True)
class Fold:
    """A pipeline's steady state repeated (`zsim.step.fold`): `periods` periods of `period_s`
    inserted at `at_s` of the short step of `micro_batches` simulated, each a copy of the
    period before it."""

    periods: int
    period_s: float
    at_s: float
    micro_batches: int

    @property
    def window(self) -> tuple[float, float]:
        return self.at_s - self.period_s, self.at_s


@dataclass
class EngineResult:
    spans: list[Span]  # one per task run as itself (not the fused passes' parts)
    end_s: float
    simulated_ranks: tuple[int, ...]
    traffic_bytes: dict[str, float] = field(default_factory=dict)  # sent, by category, per rank
    link_bytes: dict[str, float] = field(default_factory=dict)  # by link class, whole cluster
    passes: list[FusedPass] = field(default_factory=list)
    # set where the step was folded: then `spans` and `passes` are the short step's
    fold: Fold | None = None

    def all_spans(self) -> list[Span]:
        """Every task's span and every fused pass's parts as spans."""
        return self.spans + [s for p in self.passes for s in p.spans()]
