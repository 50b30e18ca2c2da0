"""A step cut into DeepSpeed's phases, measured and simulated alike, for the phase table
(diagnosis: where the missing time is; nothing here feeds a prediction).

DeepSpeed's calls bound the phases of a data-parallel step: `engine(x)` (forward, ZeRO-3's
gathers), `engine.backward` (backward, and every gradient reduction: stage 0's all-reduce in
`allreduce_gradients`, ZeRO-1/2's buckets and the epilogue that waits for them, stage 3's
reduce-scatters), `engine.step` (the norm, the optimizer, ZeRO-1/2's parameter all-gather).
In the simulation the same cuts fall at the first backward kernel and at the optimizer's first
task (the gradient norm, or the step itself where no norm is taken). "comm" is the time inside
collectives: on the measured side the rank's thread inside `deepspeed.comm`'s calls
(`zsim.validate.phases`), on the simulated side the collectives' spans in each phase (on a CPU
rank every collective blocks the thread that calls it).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from typing import Any

from zsim.step.spans import Span
from zsim.validate.phases import PHASES

STEP_STARTS = ("grad_norm", "step_prepare", "optimizer_step")  # the sim's first optimizer tasks
COMM_CATEGORIES = ("grad_reduce", "param_gather")


def simulated_phases(spans: Iterable[Span], rank: int, end_s: float) -> dict[str, float]:
    """forward/backward/step seconds and `<phase>_comm` seconds of `rank`'s simulated step."""
    mine = sorted((s for s in spans if s.rank == rank), key=lambda s: s.start_s)
    backward = min((s.start_s for s in mine if s.category == "backward"), default=end_s)
    step = min((s.start_s for s in mine if s.name in STEP_STARTS), default=end_s)
    cuts = {"forward": (0.0, backward), "backward": (backward, step), "step": (step, end_s)}
    out = {p: hi - lo for p, (lo, hi) in cuts.items()}
    for phase, (lo, hi) in cuts.items():
        out[f"{phase}_comm"] = sum(
            max(0.0, min(s.end_s, hi) - max(s.start_s, lo)) for s in mine if _is_transfer(s)
        )
    return out


def _is_transfer(span: Span) -> bool:
    """A collective's own span: not the norm kernel of the reduction category, nor ZeRO-3's
    copy of a gathered buffer into its parameters."""
    in_comm = span.category in COMM_CATEGORIES
    return in_comm and span.name != "grad_norm" and not span.name.endswith("copy_out")


def measured_phases(per_rank: list[Mapping[str, Any]], rank: int = 0) -> dict[str, float]:
    """The same keys from the worker's per-rank medians (`phases.median_phases`)."""
    if not per_rank or not per_rank[rank]:
        return {}
    mine = per_rank[rank]
    out = {p: float(mine[p]) for p in PHASES}
    for phase in PHASES:
        out[f"{phase}_comm"] = sum(
            float(v) for k, v in mine.get("comm_s", {}).items() if k.startswith(f"{phase}.")
        )
    return out


def median_over_launches(launches: list[dict[str, float]]) -> dict[str, float]:
    """Each phase's median over the launches that recorded phases."""
    keys = sorted({k for launch in launches for k in launch})
    return {k: statistics.median([x[k] for x in launches if k in x]) for k in keys}
