"""A pipeline's steady state, simulated once and repeated: a long step from a short one.

Once every stage of a 1F1B pipeline (Megatron's, DeepSpeed's TrainSchedule; Megatron's
interleaved one, whose order repeats by groups of pp micro-batches) is in its steady state,
each further period of d micro-batches adds the same work to every rank one period later:
the step is a max-plus system whose state repeats, shifted (its flows too: they start and
end shifted alike, so they share their links alike). A step of m micro-batches is then the
step of m1 < m with (m - m1) / d periods of that state repeated: that many periods longer,
and every rank's compute, exposed communication and traffic larger by that many times what
one period holds.

So the engine simulates a short step (`short_config`: its steady state spans a few periods
on every stage at once), and `find_fold` takes the period from stage 0's forwards and checks
it before trusting it: every simulated rank's tasks over two periods must repeat one period
later (the same stream and category, start and end shifted by the period to 1e-9 of the
step). Where they do not (a transient not settled, a straggler's own rhythm) it answers None
and the step is simulated in full. The tests compare folded and full steps on scenarios
where pipeline, tensor- and data-parallel traffic contend.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Protocol

import numpy as np

from zsim.cluster.build import FloatArray, IntArray
from zsim.network.communicator import Communicator
from zsim.step.program import Category, Program, Task
from zsim.step.spans import EngineResult, Fold
from zsim.step.trace import Measures, RankTimes
from zsim.step.traffic import Traffic
from zsim.workload.parallel import ParallelConfig, PipelineSchedule

# micro-batches beyond pp in the short step: its all-stage steady state must hold the three
# periods `find_fold` reads (a window and the two it checks around it; up to two micro-batches
# each), with room to settle
STEADY_MICRO_BATCHES = 8
# groups of pp micro-batches in an interleaved short step: its warm-up of (v - 1) pp + 2 (pp -
# 1) chunk passes and the three periods read; fewer refused the folds tried (pp 4 and 8, v 2-5)
INTERLEAVED_GROUPS = 6
_TOLERANCE = 1e-9  # relative to the step: times that repeat to within this repeat


class Engine(Protocol):
    """What the fold reads of a finished run (`zsim.step.engine.Engine`)."""

    programs: Sequence[Program]
    ranks: tuple[int, ...]
    simulated: set[int]
    comms: Communicator
    task_start: dict[int, list[float]]
    task_end: dict[int, list[float]]

    def coords(self, rank: int) -> tuple[int, int, int]: ...
    def book_task(self, traffic: Traffic, rank: int, task: Task) -> None: ...


def short_config(cfg: ParallelConfig) -> ParallelConfig | None:
    """The step to simulate instead of `cfg`'s, or None where folding cannot pay: no pipeline,
    GPipe (all forwards, then all backwards: no steady state), or too few micro-batches to
    save at least half of them. 1F1B: pp + `STEADY_MICRO_BATCHES`, leaving an even number
    out, so that a steady state that repeats every two micro-batches (sends that meet on a
    link every other one) folds too. Interleaved (v > 1): `INTERLEAVED_GROUPS` groups of pp
    micro-batches, Megatron's period (its order runs micro-batches in groups of pp per
    chunk; the accumulation is a multiple of pp)."""
    if cfg.pp == 1 or cfg.pp_schedule is PipelineSchedule.GPIPE:
        return None
    if cfg.virtual_stages > 1:  # Megatron's interleaved order repeats by groups of pp
        short = INTERLEAVED_GROUPS * cfg.pp
    else:
        short = cfg.pp + STEADY_MICRO_BATCHES
        short += (cfg.grad_accum - short) % 2
    return replace(cfg, grad_accum=short) if 2 * short <= cfg.grad_accum else None


def find_fold(engine: Engine, micro_batches: int, left_out: int) -> Fold | None:
    """How the `left_out` micro-batches go into the short step of `micro_batches` the engine
    ran, or None where its timeline does not repeat there (see the module doc): as periods
    of one micro-batch, else of two, else of pp (interleaved). A period: from stage 0's
    forward of the micro-batch one period before its last to its last (both steady: stage 0
    warms up with fewer)."""
    tolerance = _TOLERANCE * max(max(ends) for ends in engine.task_end.values())
    stage0 = [r for r in engine.ranks if engine.coords(r)[1] == 0]
    kinds = [np.asarray([_kind(t) for t in program.tasks]) for program in engine.programs]
    last = min(_forward_start(engine, r, micro_batches - 1) for r in stage0)
    for size in (1, 2, len(engine.programs)):  # programs: one per stage
        earlier = min(_forward_start(engine, r, micro_batches - 1 - size) for r in stage0)
        period = last - earlier
        if left_out % size or not period > 0:
            continue
        # the window ends a period before the last forward; its bounds, like the checks',
        # sit just before task starts (which fall on them), so a task and its copy fall alike
        at = last - period - tolerance
        checked_from = at - 2 * period  # two periods, each compared with the next
        if all(_repeats(engine, r, kinds, checked_from, period, tolerance) for r in engine.ranks):
            return Fold(left_out // size, period, at, micro_batches)
    return None


def _forward_start(engine: Engine, rank: int, micro_batch: int) -> float:
    """When `rank` started its first forward task of `micro_batch`."""
    tasks = engine.programs[engine.coords(rank)[1]].tasks
    first = next(
        t.index for t in tasks if t.micro_batch == micro_batch and t.category is Category.FORWARD
    )
    return engine.task_start[rank][first]


def _repeats(
    engine: Engine, rank: int, kinds: list[IntArray], lo: float, period: float, tolerance: float
) -> bool:
    """Whether the rank's tasks started in [lo, lo + 2 periods) start and end again one
    period later, and none started before `lo` still runs in the window [lo + P, lo + 2P);
    `kinds`: each stage's tasks' kinds (`_kind`), by task index."""
    kind = kinds[engine.coords(rank)[1]]
    starts, ends = np.asarray(engine.task_start[rank]), np.asarray(engine.task_end[rank])
    if bool(((starts < lo) & (ends > lo + period)).any()):
        return False
    first = (starts >= lo) & (starts < lo + 2 * period)
    second = (starts >= lo + period) & (starts < lo + 3 * period)
    a, b = np.flatnonzero(first), np.flatnonzero(second)
    if len(a) != len(b):
        return False
    a, b = a[_order(kind[a], starts[a], ends[a])], b[_order(kind[b], starts[b], ends[b])]
    return (
        bool((kind[a] == kind[b]).all())
        and _shifted(starts[a], starts[b], period, tolerance)
        and _shifted(ends[a], ends[b], period, tolerance)
    )


def _kind(task: Task) -> int:
    return hash((task.stream, task.category, task.receives, task.duration_s))


def _order(kinds: IntArray, starts: FloatArray, ends: FloatArray) -> IntArray:
    return np.lexsort((ends, starts, kinds))


def _shifted(before: FloatArray, after: FloatArray, period: float, tolerance: float) -> bool:
    return bool(np.all(np.abs(after - before - period) <= tolerance))


def fold_result(engine: Engine, result: EngineResult, fold: Fold) -> EngineResult:
    """The step with the fold's periods: its end and traffic (`spans` and `passes` stay the
    short step's). A period's traffic: what the tasks started in the window book."""
    window = Traffic(engine.comms, engine.simulated)
    lo, hi = fold.window
    for rank in engine.ranks:
        tasks = engine.programs[engine.coords(rank)[1]].tasks
        starts = np.asarray(engine.task_start[rank])
        for index in np.flatnonzero((starts >= lo) & (starts < hi)).tolist():
            engine.book_task(window, rank, tasks[index])
    n, ranks = fold.periods, len(engine.ranks)
    sent = {k: v * n / ranks for k, v in window.sent.items()}
    return replace(
        result,
        end_s=result.end_s + n * fold.period_s,
        traffic_bytes=_added(result.traffic_bytes, sent),
        link_bytes=_added(result.link_bytes, {k: v * n for k, v in window.by_link_class().items()}),
        fold=fold,
    )


def fold_times(times: RankTimes, window: Measures, fold: Fold, step_s: float) -> RankTimes:
    """A rank's times in the short step, with the fold's periods (`window`: one of them)."""
    n = fold.periods
    compute = times.compute_s + n * window.compute_s
    exposed = times.exposed_comm_s + n * window.exposed_comm_s
    by_category = {k: v * n for k, v in window.exposed_by_category.items()}
    return RankTimes(
        times.rank,
        compute,
        exposed,
        max(0.0, step_s - compute - exposed),
        times.comm_total_s + n * window.comm_total_s,
        times.end_s + n * fold.period_s,
        dict(sorted(_added(times.exposed_by_category, by_category).items())),
    )


def _added(base: dict[str, float], more: dict[str, float]) -> dict[str, float]:
    return {k: base.get(k, 0.0) + more.get(k, 0.0) for k in {**base, **more}}
