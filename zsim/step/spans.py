"""What an engine run leaves behind: a span per task, and a record per fused pass.

A fused pass (a pass of fixed-time work run as one task) keeps its parts as the template the
builder shares among every micro-batch's pass of one chunk, not as spans: a 175B pipeline
step runs hundreds of thousands of parts, and every pass of a kind repeats its template
exactly, shifted to the pass's start. The tasks the prefix ran before the event loop are kept
as columns per rank (`TaskBlock`), and made into spans and passes only when asked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

from zsim.cluster.build import FloatArray, IntArray
from zsim.step.program import Part, Stream, Task, TaskColumns


class Span(NamedTuple):
    """One task's (or one part's) execution on one rank."""

    rank: int
    stream: Stream
    name: str
    category: str
    start_s: float
    end_s: float
    nbytes: float = 0.0

    @classmethod
    def of(cls, rank: int, task: Task, start_s: float, end_s: float) -> Span:
        """A task run as itself, as the engine records it."""
        nbytes = task.comm.nbytes if task.comm else 0.0
        return cls(rank, task.stream, task.name, str(task.category), start_s, end_s, nbytes)


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

    @classmethod
    def of(cls, rank: int, task: Task, start_s: float) -> FusedPass:
        """A fused task (`task.parts`) that started at `start_s`, as the engine records it."""
        end_s = start_s + task.duration_s
        return cls(rank, task.name, str(task.category), task.stream, start_s, end_s, task.parts)

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
class TaskBlock:
    """The tasks of one rank the prefix ran (`zsim.step.prefix`), as columns by task index:
    made into spans and fused passes only when asked (a trace, a timeline), as a pipeline's
    prefix runs tens of thousands of tasks."""

    rank: int
    tasks: Sequence[Task]
    columns: TaskColumns
    span_at: IntArray  # the tasks ended by the cut, as spans (not fused passes), in order
    span_start: FloatArray
    span_end: FloatArray
    pass_at: IntArray  # the fused passes, in order
    pass_start: FloatArray

    @property
    def pass_end(self) -> FloatArray:
        return self.pass_start + self.columns.duration[self.pass_at]

    def spans(self) -> list[Span]:
        rows = zip(
            self.span_at.tolist(), self.span_start.tolist(), self.span_end.tolist(), strict=True
        )
        return [Span.of(self.rank, self.tasks[i], start, end) for i, start, end in rows]

    def passes(self) -> list[FusedPass]:
        rows = zip(self.pass_at.tolist(), self.pass_start.tolist(), strict=True)
        return [FusedPass.of(self.rank, self.tasks[i], start) for i, start in rows]


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
    loop_spans: list[Span]  # tasks the event loop ran as themselves
    end_s: float
    simulated_ranks: tuple[int, ...]
    traffic_bytes: dict[str, float] = field(default_factory=dict)  # sent, by category, per rank
    link_bytes: dict[str, float] = field(default_factory=dict)  # by link class, whole cluster
    loop_passes: list[FusedPass] = field(default_factory=list)
    # set where the step was folded: then `spans` and `passes` are the short step's
    fold: Fold | None = None
    blocks: list[TaskBlock] = field(default_factory=list)  # the prefix's tasks, by rank

    @cached_property
    def spans(self) -> list[Span]:
        """One per task run as itself (not the fused passes' parts): the prefix's, then the
        event loop's."""
        return [*(s for block in self.blocks for s in block.spans()), *self.loop_spans]

    @cached_property
    def passes(self) -> list[FusedPass]:
        return [*(p for block in self.blocks for p in block.passes()), *self.loop_passes]

    def all_spans(self) -> list[Span]:
        """Every task's span and every fused pass's parts as spans."""
        return self.spans + [s for p in self.passes for s in p.spans()]
