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

from zsim.cluster.device import ZERO3_HOST_COSTS, DeviceProfile
from zsim.plan.zero3_terms import Gathered
from zsim.step.zero3_host import rank_host_costs
from zsim.workload.parallel import ParallelConfig


def zero3_host_s(
    cfg: ParallelConfig,
    device: DeviceProfile,
    gloo: bool,
    gathered: Gathered,
    ranks: tuple[int, int],
    passes: tuple[float, float],
    scattered: bool,
) -> float:
    """Seconds a step's passes wait for the host beyond their own time: `ranks` are the first
    forward's gather group and the later gathers' (hpZ's secondary group), `passes` a
    micro-step's forward and backward, `scattered` whether the gradients are reduce-scattered
    (not where qgZ averages them tensor by tensor)."""
    costs = rank_host_costs(cfg, device, gloo)
    if not costs:
        return 0.0
    (first, later), (forward, backward) = ranks, passes
    issue, wait, reduce = (costs.get(k, 0.0) for k in ZERO3_HOST_COSTS)
    quantized = cfg.knobs.quantized_weights  # qwZ's gathers walk no ranks here
    f_calls, f_tensors, b_calls, b_tensors = (0, 0, 0, 0) if quantized else gathered.coalesced

    def walks(n: int, calls: int, tensors: int) -> float:
        return n * (calls * issue + tensors * wait) if n > 1 else 0.0

    host_b = walks(later, b_calls, b_tensors) + (
        cfg.dp * gathered.tensors * reduce if scattered else 0.0
    )
    over = max(0.0, walks(first, f_calls, f_tensors) - forward)
    over += (cfg.grad_accum - 1) * max(0.0, walks(later, f_calls, f_tensors) - forward)
    return over + cfg.grad_accum * max(0.0, host_b - backward)
