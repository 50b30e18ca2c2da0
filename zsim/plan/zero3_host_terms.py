"""ZeRO-3's host walks over the data-parallel ranks in the planner's closed form.

The simulation runs them on the host thread in issue order (`zsim.step.zero3_host`); here a
micro-step's pass lasts at least as long as the host's walks inside it: the forward's
coalesced gathers (a view per rank each, a view and a cat per rank and parameter at the wait),
the backward's, and the reduce-scatter of every gradient (a slice per rank and parameter).
Where the passes' own time is longer the walks hide behind it, as the host runs ahead; the
throttled walks of a backward that waits on its reductions (which the simulation charges) are
not in this bound.
"""

from __future__ import annotations

from zsim.plan.zero3_terms import Gathered
from zsim.step.job import StageJob
from zsim.step.zero3_host import rank_host_costs


def zero3_host_s(
    job: StageJob,
    gathered: Gathered,
    ranks: tuple[int, int],
    passes: tuple[float, float],
) -> float:
    """Seconds a step's passes wait for the host beyond their own time: `ranks` are the first
    forward's gather group and the later gathers' (hpZ's secondary group), `passes` a
    micro-step's forward and backward."""
    costs = rank_host_costs(job)
    if not costs:
        return 0.0
    cfg, (first, later), (forward, backward) = job.cfg, ranks, passes
    issue, wait, reduce = (costs.get(k, 0.0) for k in ("gather_issue", "gather_wait", "reduce"))
    quantized = cfg.knobs.quantized_weights  # qwZ's gathers walk no ranks here
    f_calls, f_tensors, b_calls, b_tensors = (0, 0, 0, 0) if quantized else gathered.coalesced

    def walks(n: int, calls: int, tensors: int) -> float:
        return n * (calls * issue + tensors * wait) if n > 1 else 0.0

    averaged = job.qgz_nodes or cfg.dp <= 1  # qgZ averages tensor by tensor: no walk
    reduced = 0.0 if averaged else cfg.dp * len(job.tensors()) * reduce
    host_b = walks(later, b_calls, b_tensors) + reduced
    over = max(0.0, walks(first, f_calls, f_tensors) - forward)
    over += (cfg.grad_accum - 1) * max(0.0, walks(later, f_calls, f_tensors) - forward)
    return over + cfg.grad_accum * max(0.0, host_b - backward)
