"""ZeRO-3's data-parallel terms in the planner's closed form, ZeRO++'s hpZ and qwZ included.

Per micro-step the compute waits for each module's own (blocking) fetch whole, as nothing is
ahead of it to hide behind (DeepSpeed's coordinator fetches a module that is not yet available
and waits: the forward's first module, the embedding, at least), for the prefetches beyond the
forward they run behind, and for the backward's prefetches and reduce-scatters beyond the
backward: the reduce-scatters start when the first bucket is full, after the prefetches on one
NCCL stream (an mpu) or on one group's links, beside them otherwise (two communicators, hpZ's
prefetches inside the node: `_backward_comm_end`). Each gather and each reduce-scatter (one
per flush of the IPG bucket, `zero_reduce.flush_sizes`) pays its own latency, as in the
simulation: at a thousand ranks a call's ring latency is milliseconds. With hpZ only the
first forward after a step gathers over every data-parallel rank; every later gather runs in
the rank's secondary group of h consecutive ranks (its parameters' secondary partition exists
from their first release to the step: `zsim.step.zero3`). qwZ gathers int8 values and fp32
scales, paying a quantize on the gather stream and a dequantize on the compute stream at the
device's copy rate.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from zsim.cluster.device import DeviceProfile
from zsim.network.collective import CollectiveOp
from zsim.plan.sm_terms import beyond
from zsim.step.zero3 import module_trace, quantizer_groups, replay
from zsim.step.zero_reduce import flush_sizes
from zsim.workload.layout import rank_chunks
from zsim.workload.model import ModelSpec
from zsim.workload.parallel import ParallelConfig

Collective = Callable[[CollectiveOp, float, tuple[int, ...]], float]
Sizes = tuple[float, ...]  # elements of each call
Counted = tuple[tuple[float, int], ...]  # (elements, calls) by size


@dataclass(frozen=True)
class Gathered:
    """Elements a micro-step's forward and backward gather (each call padded to dp), and the
    calls among them that are a module's own blocking fetch (`zsim.step.zero3.Gather`)."""

    forward: float
    backward: float
    forward_blocking: Sizes = ()
    backward_blocking: Sizes = ()
    # the prefetches of each side and the backward's bucket flushes
    forward_prefetches: Counted = ()
    backward_prefetches: Counted = ()
    flushes: Counted = ()
    # coalesced calls (more than one parameter) and their parameters, forward then backward,
    # and the rank's parameter tensors: what the host walks the ranks for (`zero3_host_terms`)
    coalesced: tuple[int, int, int, int] = (0, 0, 0, 0)
    tensors: int = 0


def zero3_terms(
    cfg: ParallelConfig,
    device: DeviceProfile,
    collective_s: Collective,
    groups: tuple[tuple[int, ...], tuple[int, ...]],
    sizes: tuple[float, float],
    gathered: Gathered,
    passes: tuple[float, float],
    averaged: tuple[float, float, float] | None = None,
    slows: tuple[float, float] = (1.0, 1.0),
) -> tuple[float, float]:
    """(exposed seconds, bytes one GPU sends) of a step's ZeRO-3 collectives: `groups` are the
    data-parallel group and the one later gathers use (itself without hpZ); `sizes` the rank's
    parameters and their padded count (what the reduce-scatters take); `gathered` what a
    micro-step's forward and backward gather (DeepSpeed's coordinator, replayed: a model
    within `stage3_max_reuse_distance` stays gathered into its backward); `passes` a
    micro-step's forward and backward; `averaged` the (seconds, bytes sent, seconds across
    the nodes) of a micro-step's averaging where not the reduce-scatters (qgZ: `qgz_terms`);
    `slows` a pass beside each group's collectives over alone (`sm_terms`)."""
    (forward, backward), params, ahead = passes, sizes[0], gathered.forward
    m, dtype = cfg.grad_accum, str(cfg.precision)
    (everyone, later), (slow, slow_later) = groups, slows
    gather = functools.partial(_gather_s, cfg, device, collective_s)  # (group, numel)

    def waited(group: tuple[int, ...], calls: Sizes, prefetches: Counted) -> tuple[float, float]:
        """(seconds of the blocking fetches, of the prefetches: each call its own latency)."""
        blocking = sum(gather(group, numel) for numel in calls)
        return blocking, sum(k * gather(group, numel) for numel, k in prefetches)

    behind, forward_calls = gathered.backward, gathered.forward_prefetches
    first_b, again_b, back_b = (
        _gather_bytes(cfg, len(g), x)
        for g, x in ((everyone, ahead), (later, ahead), (later, behind))
    )
    first_wait, first_s = waited(everyone, gathered.forward_blocking, forward_calls)
    again_wait, again_s = waited(later, gathered.forward_blocking, forward_calls)
    back_wait, back_s = waited(later, gathered.backward_blocking, gathered.backward_prefetches)
    if averaged is None:
        scatter, scattered, buckets = _reduce_scatters(
            cfg, device, collective_s, everyone, sizes, gathered.flushes
        )
        across = scatter
    else:
        (scatter, scattered, across), buckets = (
            averaged,
            max(1, math.ceil(params / cfg.knobs.reduce_bucket_size)),
        )
    # beyond the backward they overlap, the last bucket's in any case (stage3.py synchronizes)
    shared = across if later is everyone else 0.0  # on the gathers' links (hpZ: inside nodes)
    ends = _backward_comm_end(cfg, backward, (back_s, scatter, shared), params)
    both = back_s + scatter  # the backward's gathers (hpZ: in the node) and its reductions
    slow_back = (back_s * slow_later + scatter * slow) / both if both else slow
    tail = back_wait + max(beyond(backward, ends, slow_back), scatter / buckets)
    first = first_wait + beyond(forward, first_s, slow)
    exposed = first + tail + (m - 1) * (again_wait + beyond(forward, again_s, slow_later) + tail)
    if cfg.knobs.quantized_weights:  # each gather's dequantize, on the compute stream
        exposed += m * device.copy_time_s(1.5 * (ahead + behind), dtype)
    sent = first_b + (m - 1) * again_b + m * (back_b + scattered)
    return exposed, sent


def _reduce_scatters(
    cfg: ParallelConfig,
    device: DeviceProfile,
    collective_s: Collective,
    group: tuple[int, ...],
    sizes: tuple[float, float],
    flushes: Counted,
) -> tuple[float, float, int]:
    """(seconds, bytes one GPU sends, calls) of a micro-step's reduce-scatters: one per flush
    of the IPG bucket (`flushes`; without them one of everything), each paying its latency,
    and the buckets' copies beside them on the reduction stream."""
    (params, padded), d, n = sizes, cfg.precision.bytes, len(group)
    flushes = flushes or ((padded, 1),)
    rs = CollectiveOp.REDUCE_SCATTER
    seconds = sum(k * collective_s(rs, numel * d, group) for numel, k in flushes)
    seconds += device.copy_time_s(4 * d * params, str(cfg.precision))
    return seconds, (n - 1) / n * padded * d, sum(k for _, k in flushes)


def _backward_comm_end(
    cfg: ParallelConfig, backward: float, calls: tuple[float, float, float], params: float
) -> float:
    """When a micro-step's backward gathers and gradient reductions end, from its start
    (`calls`: the gathers' seconds, the reductions', and those of the reductions that cross
    the gathers' links). The reductions begin once the first bucket is full (its share of the
    backward, gradients arriving evenly: DeepSpeed's IPG bucket); on one NCCL stream (an mpu)
    after the gathers; on two communicators beside them, sharing the links they share."""
    gathers, reductions, shared = calls
    filled = backward * min(1.0, cfg.knobs.reduce_bucket_size / max(params, 1.0))
    if cfg.one_dp_group:
        return max(gathers, filled) + reductions
    return max(gathers + shared, filled + reductions)


def _gather_s(
    cfg: ParallelConfig,
    device: DeviceProfile,
    collective_s: Collective,
    group: tuple[int, ...],
    numel: float,
) -> float:
    """Seconds of gathering `numel` elements in `group` (qwZ: int8 values and fp32 scales,
    after quantizing the rank's shard)."""
    n, d, dtype = len(group), cfg.precision.bytes, str(cfg.precision)
    if numel <= 0:
        return 0.0
    if not cfg.knobs.quantized_weights:
        return collective_s(CollectiveOp.ALL_GATHER, numel * d, group)
    seconds = device.copy_time_s(1.5 * numel / n, dtype)  # quantize the rank's shard
    seconds += collective_s(CollectiveOp.ALL_GATHER, numel, group)
    return seconds + collective_s(CollectiveOp.ALL_GATHER, _scale_bytes(n, numel), group)


def _gather_bytes(cfg: ParallelConfig, n: int, numel: float) -> float:
    """Bytes one of `n` GPUs sends gathering `numel` elements (qwZ: int8 and the scales)."""
    if numel <= 0:
        return 0.0
    if not cfg.knobs.quantized_weights:
        return (n - 1) / n * numel * cfg.precision.bytes
    return (n - 1) / n * (numel + _scale_bytes(n, numel))


def _scale_bytes(n: int, numel: float) -> float:
    """qwZ's fp32 scales of a gather over `n` ranks: one per quantizer group of each shard."""
    return n * 4 * quantizer_groups(numel / n)


class GatherSums:
    """Elements a ZeRO-3 micro-step gathers in its forward and in its backward, and its
    blocking fetches: DeepSpeed's coordinator replayed (`zsim.step.zero3.replay`) once per
    distinct module trace, each call padded to dp."""

    def __init__(self, model: ModelSpec) -> None:
        self.model = model
        self._gathers: dict[tuple[object, ...], list[tuple[int, bool, bool, int]]] = {}
        self._tensors: dict[tuple[object, ...], int] = {}  # the rank's parameter tensors
        self._order: dict[tuple[object, ...], list[int]] = {}  # their sizes, backward order
        self._replays: dict[tuple[object, ...], list[tuple[int, bool, bool, int]]] = {}
        self._sums: dict[tuple[object, ...], Gathered] = {}

    def of(self, cfg: ParallelConfig, stage: int) -> Gathered:
        k = cfg.knobs
        key: tuple[object, ...] = (cfg.pp, stage, cfg.tp, cfg.recompute, cfg.sequence_parallel)
        key += (cfg.flash_attention, k.prefetch_bucket_size, k.param_persistence_threshold)
        key += (k.max_live_parameters, k.max_reuse_distance)
        if key not in self._gathers:  # (elements, in the forward, blocking, tensors) a call
            chunk = rank_chunks(self.model, cfg, stage)[0]
            self._tensors[key] = sum(len(layer.tensors) for layer in chunk)
            backward = [t for layer in reversed(chunk) for t in reversed(layer.tensors)]
            self._order[key] = [t.per_rank(cfg.tp) for t in backward]
            trace = tuple(module_trace(self.model, cfg, chunk))
            replayed = (trace, k)  # recompute and sequence parallelism often leave it alike
            if replayed not in self._replays:
                gathers = replay(trace, k).gathers
                self._replays[replayed] = [
                    (g.numel, trace[g.at].forward, g.blocking, g.tensors) for g in gathers
                ]
            self._gathers[key] = self._replays[replayed]
        padded = (*key, cfg.dp, k.reduce_bucket_size)
        if padded not in self._sums:
            self._sums[padded] = self._summed(key, cfg.dp, k.reduce_bucket_size)
        return self._sums[padded]

    def _summed(self, key: tuple[object, ...], dp: int, bucket: int) -> Gathered:
        """A replayed micro-step's gathers (`_gathers[key]`), each call padded to `dp`."""
        sides = [0.0, 0.0]  # forward, backward
        blocking: tuple[list[float], list[float]] = ([], [])
        prefetches: tuple[Counter[float], Counter[float]] = (Counter(), Counter())
        coalesced = [0, 0, 0, 0]  # calls and tensors, forward then backward

        def padded(numel: int) -> float:  # each rank's shard is ceil(numel / dp) elements
            return float(-(-numel // dp) * dp)

        for numel, forward, waits, tensors in self._gathers[key]:
            elements = padded(numel)
            side = 0 if forward else 1
            sides[side] += elements
            if waits:
                blocking[side].append(elements)
            else:
                prefetches[side][elements] += 1
            if tensors > 1:
                coalesced[2 * side] += 1
                coalesced[2 * side + 1] += tensors
        flushes = Counter(padded(n) for n in flush_sizes(self._order[key], bucket))
        return Gathered(
            sides[0],
            sides[1],
            tuple(blocking[0]),
            tuple(blocking[1]),
            tuple(prefetches[0].items()),
            tuple(prefetches[1].items()),
            tuple(flushes.items()),
            (coalesced[0], coalesced[1], coalesced[2], coalesced[3]),
            self._tensors[key],
        )
