"""Megatron-Core's data parallelism in closed form, for the planner's fast tier (the schedule
it stands for: `zsim.step.megatron_dp`).

Gradients are reduced in the DDP's buckets (`megatron_dp.buckets`, each scaled by 1 / dp in
place first): with --overlap-grad-reduce the buckets' calls run beside the last micro-batch's
backward, so the step waits for what the backward does not hide and at least for the last
bucket; without it, for all of them. The distributed optimizer's (ZeRO-1) parameter gathers run
beside the next forward with --overlap-param-gather (the first bucket's always waited for),
else after the optimizer step.
"""

from __future__ import annotations

from collections.abc import Callable

from zsim.cluster.device import DeviceProfile
from zsim.cluster.grid import RankGrid
from zsim.network.collective import CollectiveOp, bus_bandwidth_factor
from zsim.plan.sm_terms import beyond
from zsim.step.job import StageJob
from zsim.step.megatron_dp import bucket_numel, buckets, grad_bytes
from zsim.workload.fp8 import AMAX_KERNELS, amax_bytes
from zsim.workload.mechanisms import Mechanism
from zsim.workload.parallel import Precision, ZeroStage

Collective = Callable[[CollectiveOp, float, tuple[int, ...]], float]
Kept = Callable[[tuple[object, ...], tuple[int, ...]], tuple[int, ...]]


def megatron_terms(
    job: StageJob,
    device: DeviceProfile,
    collective: Collective,
    group: tuple[int, ...],
    passes: tuple[float, float],
    slow: float = 1.0,
) -> tuple[float, float, float]:
    """(exposed reduction and gather wait, gathers after the optimizer step, bytes sent) of one
    rank; `passes`: its forward and backward of one micro-batch; `slow`: a pass beside the
    collectives over alone (`sm_terms`)."""
    cfg, (forward, backward) = job.cfg, passes
    n, d, e = len(group), grad_bytes(cfg), job.element_bytes
    sizes = [bucket_numel(job, b) for b in buckets(job)]
    sharded = cfg.zero_stage is ZeroStage.OPTIMIZER
    op = CollectiveOp.REDUCE_SCATTER if sharded else CollectiveOp.ALL_REDUCE
    scale = [device.copy_time_s(d * s, job.dtype) for s in sizes]  # as megatron_dp scales
    calls = [t + collective(op, s * d, group) for t, s in zip(scale, sizes, strict=True)]
    total = sum(calls)
    exposed = max(beyond(backward, total, slow), calls[-1]) if cfg.overlap_comm else total
    sent = sum(bus_bandwidth_factor(op, n) * s * d for s in sizes)
    after = 0.0
    if sharded:
        gathers = [collective(CollectiveOp.ALL_GATHER, s * e, group) for s in sizes]
        if cfg.overlap_param_gather:
            exposed += max(beyond(forward, sum(gathers), slow), gathers[0])
        else:
            after = sum(gathers)
        sent += sum((n - 1) / n * s * e for s in sizes)
    return exposed, after, sent


def amax_s(
    job: StageJob, collective: Collective, grid: RankGrid, stage: int, kept: Kept
) -> tuple[float, float]:
    """TransformerEngine's amax reductions in one micro-batch's forward and backward of a rank
    (`step.builder`): per FP8 chunk, an all-reduce over its pipeline stage's ranks (`kept`
    once per layout shape: collectives' lines are keyed by the group) and its kernels."""
    cfg = job.cfg
    if cfg.precision is not Precision.FP8 or not cfg.models(Mechanism.FP8_AMAX):
        return 0.0, 0.0
    ranks = (grid.rank(d, stage, t) for d in range(grid.dp) for t in range(grid.tp))
    group = kept(("stage", grid.dp, grid.pp, grid.tp, stage), tuple(sorted(ranks)))

    def one(nbytes: float) -> float:
        kernels = AMAX_KERNELS * job.device.copy_time_s(nbytes, job.dtype)
        reduce = collective(CollectiveOp.ALL_REDUCE, nbytes, group) if len(group) > 1 else 0.0
        return reduce + kernels if nbytes else 0.0

    forward = sum(one(amax_bytes(chunk, True)) for chunk in job.chunks)
    return forward, sum(one(amax_bytes(chunk, False)) for chunk in job.chunks)
