"""A step cut into DeepSpeed's phases, measured and simulated alike, for the phase table
(diagnosis: where the missing time is; nothing here feeds a prediction). The simulated side is
`zsim.step.phases.simulated_phases` (`simulated_pipeline_phases` for a pipeline, whose phases
are its instructions'); this module reads the worker's records.

DeepSpeed's calls bound the phases of a data-parallel step: `engine(x)` (forward, ZeRO-3's
gathers), `engine.backward` (backward, and every gradient reduction: stage 0's all-reduce in
`allreduce_gradients`, ZeRO-1/2's buckets and the epilogue that waits for them, stage 3's
reduce-scatters), `engine.step` (the norm, the optimizer, ZeRO-1/2's parameter all-gather).
"comm" is the time the rank's thread spent inside `deepspeed.comm`'s calls
(`zsim.testbed.phase_clock`): waiting for a slower peer included.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import Any

from zsim.step.phases import PHASES


def measured_phases(per_rank: list[Mapping[str, Any]], rank: int = 0) -> dict[str, float]:
    """The same keys from the worker's per-rank medians (`phases.median_phases`)."""
    if not per_rank or not per_rank[rank]:
        return {}
    mine = per_rank[rank]
    if not any(float(mine[p]) for p in PHASES):  # a CUDA step: no phases timed
        return {}
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
