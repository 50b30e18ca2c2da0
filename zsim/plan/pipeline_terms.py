"""A pipeline's fill, drain and sends in the planner's closed form, as `zsim.step.pipeline`
schedules them."""

from __future__ import annotations

from zsim.step.job import StageJob
from zsim.step.pipeline import megatron_blocks, partition_copies_s
from zsim.workload.parallel import ParallelConfig, PipelineEngine, PipelineSchedule


def bubble_s(
    cfg: ParallelConfig, slowest: float, total: float, send: float, partitioned: float
) -> float:
    """Fill and drain, and the sends: on the critical path in the fill and drain; in the
    steady state blocking sends (DeepSpeed's, Megatron's 1F1B: `megatron_blocks`) add to
    every micro-batch, with DeepSpeed's TP partitioning (`partitioned`, per micro-batch);
    sends beside compute in 1F1B (an ablation) only where a stage's 2 sends per micro-batch
    take its link longer than its compute, but with interleaving every step's input is the
    output of the neighbour's step just before it (`pipeline_order`: consecutive stages run a
    micro-batch's chunk one step apart), so each of its 2 v sends per micro-batch is waited
    for. `slowest`: the slowest stage's forward and backward of one micro-batch; `total`:
    every stage's; `send`: one message."""
    if cfg.pp_schedule is PipelineSchedule.INTERLEAVED:
        fill = (cfg.pp - 1) * slowest / cfg.virtual_stages
    else:
        fill = total - slowest
    sends = 2 * (cfg.pp - 1) * send
    m = cfg.grad_accum
    if cfg.pipeline_engine is PipelineEngine.DEEPSPEED:
        sends += 2 * (m - 1) * send + m * partitioned  # blocking p2p on the compute stream
    elif megatron_blocks(cfg):
        sends += 2 * (m - 1) * send
    elif cfg.pp_schedule is PipelineSchedule.INTERLEAVED:
        sends += m * 2 * cfg.virtual_stages * send
    else:
        sends += m * max(0.0, 2 * send - slowest)
    return fill + sends


def partitioned_s(job: StageJob, gather_s: float) -> float:
    """DeepSpeed's partitioned messages on a middle stage, per micro-batch: three `full()`s
    (an all-gather over TP, `gather_s`, and its copies) and two partitions; at pp 2 each
    stage does two and one (`partition_copies_s`)."""
    full_copies, part_copy = partition_copies_s(job)
    fulls = 3 if job.cfg.pp > 2 else 2
    return fulls * (gather_s + full_copies) + (fulls - 1) * part_copy
