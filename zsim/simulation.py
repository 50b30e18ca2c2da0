"""`simulate`: one training step of a scenario on a topology -> a `Report`."""

from __future__ import annotations

import gc
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import simpy

from zsim.cluster.calibrated import apply_profile
from zsim.cluster.device import DeviceProfile
from zsim.cluster.fabric import Backend
from zsim.cluster.grid import RankGrid
from zsim.cluster.topology import Topology, without_nccl_effects
from zsim.errors import require
from zsim.memory import MemoryLedger, overflow_bytes, peak_ledger
from zsim.network.communicator import Communicator
from zsim.step.builder import build_program
from zsim.step.engine import Engine
from zsim.step.fixed_tp import tp_fixed_time
from zsim.step.fold import find_fold, fold_result, fold_times, short_config
from zsim.step.sm_hold import SmHold
from zsim.step.spans import EngineResult, Fold, FusedPass, Span
from zsim.step.trace import RankTimes, rank_times, rank_times_and_window
from zsim.workload.context_parallel import check_model
from zsim.workload.layout import layer_ac_blocks
from zsim.workload.mechanisms import Mechanism
from zsim.workload.model import ModelSpec
from zsim.workload.parallel import ParallelConfig, Recompute
from zsim.workload.shapes import Shard, forward_flops, forward_ops, sac_replay


@dataclass(frozen=True)
class Report:
    """What a planner reads about one step. Rates are per step; bytes per GPU."""

    step_time_s: float
    samples_per_s: float
    tokens_per_s: float
    model_tflops_per_gpu: float
    mfu: float
    hfu: float
    stages: tuple[RankTimes, ...]  # one per pipeline stage (its first rank)
    critical: RankTimes  # the rank that sets the step: its parts sum to the step time
    traffic_bytes_per_gpu: dict[str, float]  # by communication category, mean over GPUs
    link_traffic_bytes: dict[str, float]  # by link class, whole cluster, over its directed links
    memory: MemoryLedger
    memory_pipeline_stage: int
    fits: bool
    engine: EngineResult = field(repr=False)

    @property
    def compute_s(self) -> float:
        return self.critical.compute_s

    @property
    def exposed_comm_s(self) -> float:
        return self.critical.exposed_comm_s

    @property
    def bubble_s(self) -> float:
        return self.critical.idle_s

    def as_dict(self) -> dict[str, Any]:
        return {
            "step_time_s": self.step_time_s,
            "samples_per_s": self.samples_per_s,
            "tokens_per_s": self.tokens_per_s,
            "model_tflops_per_gpu": self.model_tflops_per_gpu,
            "mfu": self.mfu,
            "hfu": self.hfu,
            "compute_s": self.compute_s,
            "exposed_comm_s": self.exposed_comm_s,
            "bubble_s": self.bubble_s,
            "critical_rank": self.critical.rank,
            "exposed_by_category_s": self.critical.exposed_by_category,
            "stages": [s.__dict__ for s in self.stages],
            "traffic_bytes_per_gpu": self.traffic_bytes_per_gpu,
            "link_traffic_bytes": self.link_traffic_bytes,
            "memory_bytes": self.memory.as_dict(),
            "memory_pipeline_stage": self.memory_pipeline_stage,
            "fits": self.fits,
        }


def step_flops(model: ModelSpec, cfg: ParallelConfig) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of one step over all GPUs: forward + backward (2x), and
    for hardware FLOPs the recomputed forward too (Narayanan et al. 2021, section 5.1)."""
    forward = forward_flops(model, cfg.micro_batch) * cfg.grad_accum * cfg.dp
    replay = forward if cfg.recompute is Recompute.FULL else 0.0
    if cfg.recompute is Recompute.SELECTIVE_OP:  # the replayed matmuls of every block
        per_block = sum(op.flops for op in sac_replay(model, Shard(cfg.micro_batch)))
        replay = per_block * model.layers * cfg.grad_accum * cfg.dp
    if cfg.recompute is Recompute.SELECTIVE_LAYER:  # the forward of every checkpointed block
        shard = Shard(cfg.micro_batch)
        ops = [op for b in layer_ac_blocks(model) for op in forward_ops(model, b, shard)]
        replay = sum(op.flops for op in ops) * cfg.grad_accum * cfg.dp
    return 3 * forward, 3 * forward + replay


def _rank_times(
    result: EngineResult, ranks: Iterable[int], fold: Fold | None = None
) -> dict[int, RankTimes]:
    """Each rank's times; with a fold, in the short step with the fold's periods added."""
    by_rank: dict[int, list[Span]] = {}
    for span in result.loop_spans:
        by_rank.setdefault(span.rank, []).append(span)
    passes: dict[int, list[FusedPass]] = {}
    for fused in result.loop_passes:
        passes.setdefault(fused.rank, []).append(fused)
    blocks = {block.rank: block for block in result.blocks}
    step = result.end_s
    times = {}
    for r in ranks:
        own, own_passes, block = by_rank.get(r, []), passes.get(r, []), blocks.get(r)
        if fold is None:
            times[r] = rank_times(own, own_passes, r, step, block)
        else:
            short, window = rank_times_and_window(own, own_passes, r, step, fold.window, block)
            times[r] = fold_times(short, window, fold, step)
    return times


def _run(
    model: ModelSpec,
    parallel: ParallelConfig,
    topology: Topology,
    device: DeviceProfile,
    full: bool,
    slow: dict[int, float],
) -> tuple[Engine, EngineResult]:
    """The engine's run of `parallel`'s step, and the engine (a fold reads its task times)."""
    grid = RankGrid(dp=parallel.dp_cp, pp=parallel.pp, tp=parallel.tp)
    gloo = topology.fabric.backend is Backend.GLOO
    comms = Communicator(simpy.Environment(), topology)
    # a straggler's passes are not the template's, and a fused pass times its collectives as
    # TP's (context parallelism exchanges on other groups): no fused passes then
    tp_time = None if slow or parallel.cp > 1 else tp_fixed_time(grid, comms)
    node = topology.gpus_per_node
    programs = [
        build_program(model, parallel, device, s, gloo, tp_time, node) for s in range(parallel.pp)
    ]
    block = _dp_block(parallel, node)
    sms = None
    if not gloo and device.sm_count and parallel.models(Mechanism.NCCL_SMS):
        sms = SmHold(topology, device.sm_count)
    engine = Engine(
        programs, grid, comms, full=full, slowdown=slow, block=block, cp=parallel.cp, sms=sms
    )
    return engine, engine.run()


def critical_rank(times: Iterable[RankTimes], step_s: float) -> RankTimes:
    """The rank that sets the step: among those whose work ends with it, the busiest (the
    last pipeline stage to finish; in data parallelism, where all end together, a straggler)."""
    ranks = list(times)
    last = max(t.end_s for t in ranks)
    finishing = [t for t in ranks if t.end_s >= last - 1e-12 * max(step_s, 1e-300)]
    return max(finishing, key=lambda t: (t.compute_s + t.exposed_comm_s, -t.rank))


def check_stragglers(stragglers: Mapping[int, float], world: int, full: bool) -> None:
    """Stragglers need every rank simulated; each is a rank of the job, slowed by >= 1x."""
    if not stragglers:
        return
    rank, factor = next(iter(stragglers.items()))
    require(full, "straggler", f"{rank}:{factor}", "--full (a straggler breaks the symmetry)")
    for rank, factor in stragglers.items():
        require(0 <= rank < world, "straggler", rank, f"a rank in 0..{world - 1}")
        require(1.0 <= factor < float("inf"), "straggler", factor, "a slowdown factor >= 1")


def _dp_block(parallel: ParallelConfig, node_gpus: int) -> int:
    """The consecutive data-parallel ranks the engine groups: hpZ's or FSDP's hybrid shard,
    or qgZ's node (DeepSpeed groups it by `device_count()`, so an hpZ group beside it must be
    the node too for one block to serve both)."""
    block = parallel.dp_block
    if not parallel.qgz_nodes(node_gpus):
        return block
    require(
        block in (1, node_gpus),
        "zero_hpz_partition_size",
        block,
        f"1 or the {node_gpus} GPUs of a node with qgZ (zsim groups both by one block)",
    )
    return node_gpus


@contextmanager
def _no_cycle_collection() -> Iterator[None]:
    """A step makes hundreds of thousands of tasks, spans and events that live until it ends:
    the cycle collector's passes over them free nothing and cost a large pipeline 10-15 % of
    its run (its peak memory is the same without them). Python's own collector runs after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def simulate(
    model: ModelSpec,
    parallel: ParallelConfig,
    topology: Topology,
    device: DeviceProfile,
    *,
    full: bool = False,
    stragglers: Mapping[int, float] | None = None,
    fold: bool = True,
) -> Report:
    """Simulate one step. `full` simulates every rank instead of one per pipeline stage;
    `stragglers` (rank -> factor, with `full`) runs those ranks' kernels that much slower.
    `fold`: a long 1F1B pipeline's steady state is simulated once and repeated
    (`zsim.step.fold`); its spans are then those of the short step (off for a trace)."""
    product, values = parallel.sizes()
    require(
        parallel.world_size == topology.world_size,
        product,
        parallel.world_size,
        f"the {topology.world_size} GPUs of {topology.name} ({values})",
    )
    check_model(model, parallel.cp)  # Python callers skip the CLI's check_layout
    slow = dict(stragglers or {})
    check_stragglers(slow, parallel.world_size, full)
    with _no_cycle_collection():
        return _simulate(model, parallel, topology, device, full, slow, fold)


def _simulate(
    model: ModelSpec,
    parallel: ParallelConfig,
    topology: Topology,
    device: DeviceProfile,
    full: bool,
    slow: dict[int, float],
    fold: bool,
) -> Report:
    topology = without_nccl_effects(
        topology,
        protocols=not parallel.models(Mechanism.NCCL_PROTOCOLS),
        nvlink_rate=not parallel.models(Mechanism.NVLINK_NCCL_RATE),
    )
    topology = apply_profile(topology, device)  # a calibrated profile's links and call latency
    grid = RankGrid(dp=parallel.dp_cp, pp=parallel.pp, tp=parallel.tp)
    stage_ranks = {*(grid.rank(0, s, 0) for s in range(parallel.pp)), *slow}
    short = short_config(parallel) if fold else None
    found = None
    if short is not None:
        engine, result = _run(model, short, topology, device, full, slow)
        found = find_fold(engine, short.grad_accum, parallel.grad_accum - short.grad_accum)
    if found is None:  # not folded: the whole step
        engine, result = _run(model, parallel, topology, device, full, slow)
        times = _rank_times(result, stage_ranks)
    else:
        result = fold_result(engine, result, found)
        times = _rank_times(result, stage_ranks, found)
    step = result.end_s
    stages = tuple(times[grid.rank(0, s, 0)] for s in range(parallel.pp))
    flops, hw_flops = step_flops(model, parallel)
    peak = device.peak_flops.get(str(parallel.precision.compute), 0.0)  # FP8: its bf16 peak
    gpus = parallel.world_size
    pipeline_stage, ledger = peak_ledger(model, parallel)
    return Report(
        step_time_s=step,
        samples_per_s=parallel.global_batch / step,
        tokens_per_s=parallel.global_batch * model.seq_len / step,
        model_tflops_per_gpu=flops / step / gpus / 1e12,
        mfu=flops / step / gpus / peak if peak else 0.0,
        hfu=hw_flops / step / gpus / peak if peak else 0.0,
        stages=stages,
        critical=critical_rank(times.values(), step),
        traffic_bytes_per_gpu=dict(result.traffic_bytes),
        link_traffic_bytes=dict(result.link_bytes),
        memory=ledger,
        memory_pipeline_stage=pipeline_stage,
        fits=overflow_bytes(ledger, device) <= 0,
        engine=result,
    )
