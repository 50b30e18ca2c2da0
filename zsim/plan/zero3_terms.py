"""ZeRO-3's data-parallel terms in the planner's closed form, ZeRO++'s hpZ and qwZ included.

Per micro-step the compute waits for the gathers beyond the forward they prefetch behind, and
for the gathers and reduce-scatters (one NCCL stream where one group serves both) beyond the
backward. With hpZ only the first forward after a step gathers over every data-parallel rank;
every later gather runs in the rank's secondary group of h consecutive ranks (its parameters'
secondary partition exists from their first release to the step: `zsim.step.zero3`). qwZ
gathers int8 values and fp32 scales, paying a quantize on the gather stream and a dequantize
on the compute stream at the device's copy rate.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from zsim.cluster.device import DeviceProfile
from zsim.network.collective import CollectiveOp
from zsim.step.zero3 import quantizer_groups
from zsim.workload.parallel import ParallelConfig

Collective = Callable[[CollectiveOp, float, tuple[int, ...]], float]


def zero3_terms(
    cfg: ParallelConfig,
    device: DeviceProfile,
    collective_s: Collective,
    groups: tuple[tuple[int, ...], tuple[int, ...]],
    sizes: tuple[float, float, float, float],
    passes: tuple[float, float],
) -> tuple[float, float]:
    """(exposed seconds, bytes one GPU sends) of a step's ZeRO-3 collectives: `groups` are the
    data-parallel group and the one later gathers use (itself without hpZ); `sizes` the rank's
    parameters, their padded count (what the reduce-scatters take) and the elements a
    micro-step's forward and backward gather (DeepSpeed's coordinator, replayed: a model
    within `stage3_max_reuse_distance` stays gathered into its backward); `passes` a
    micro-step's forward and backward."""
    (forward, backward), (params, padded, ahead, behind) = passes, sizes
    d, m = cfg.precision.bytes, cfg.grad_accum
    dtype, quantized = str(cfg.precision), cfg.knobs.quantized_weights
    everyone, later = groups

    def gather(group: tuple[int, ...], numel: float) -> tuple[float, float]:
        """(seconds, bytes sent) of gathering `numel` elements in `group`."""
        n = len(group)
        if numel <= 0:
            return 0.0, 0.0
        if not quantized:
            seconds = collective_s(CollectiveOp.ALL_GATHER, numel * d, group)
            return seconds, (n - 1) / n * numel * d
        scales = n * 4 * quantizer_groups(numel / n)
        seconds = device.copy_time_s(1.5 * numel / n, dtype)  # quantize the rank's shard
        seconds += collective_s(CollectiveOp.ALL_GATHER, numel, group)
        seconds += collective_s(CollectiveOp.ALL_GATHER, scales, group)
        return seconds, (n - 1) / n * (numel + scales)

    first_s, first_b = gather(everyone, ahead)
    again_s, again_b = gather(later, ahead)
    back_s, back_b = gather(later, behind)
    n = len(everyone)
    scatter = collective_s(CollectiveOp.REDUCE_SCATTER, padded * d, everyone)
    # the buckets' copies run beside the reduce-scatters, on the reduction stream
    scatter += device.copy_time_s(4 * d * params, dtype)
    # beyond the backward they overlap, and the last bucket's reduce-scatter in any case: the
    # backward ends by waiting for it (stage3.py synchronizes the device there)
    buckets = max(1, math.ceil(params / cfg.knobs.reduce_bucket_size))
    tail = max(back_s + scatter - backward, scatter / buckets)
    exposed = max(0.0, first_s - forward) + tail + (m - 1) * (max(0.0, again_s - forward) + tail)
    if quantized:  # each gather's dequantize, on the compute stream
        exposed += m * device.copy_time_s(1.5 * (ahead + behind), dtype)
    sent = first_b + (m - 1) * again_b + m * (back_b + (n - 1) / n * padded * d)
    return exposed, sent
