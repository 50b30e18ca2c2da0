"""The planner's fast tier: a step's time in closed form, from the simulator's own parts.

Per layer, the forward and backward times are the fused-pass templates the step builder makes
(`LayerKernels.pass_template`: the same kernel model, Megatron's TP collectives at their
closed-form times); every collective is its plan's closed form (`zsim.network.plans`). What
this tier adds is only how the pieces compose, each rule from the schedule it stands for:

- pipeline: (m + p - 1) passes of the slowest stage for GPipe and 1F1B, the fill and drain
  shortened by v with interleaving (Narayanan et al. 2021, sec. 2.2), plus the sends of the
  fill and drain (and of every micro-batch for DeepSpeed's blocking engine);
- data parallelism: DeepSpeed's reductions per ZeRO stage (`step.zero_reduce`), exposed whole
  on the compute stream, beyond the backward with overlap_comm; ZeRO-3's gathers (and FSDP2's,
  `fsdp_terms`) beyond the compute they prefetch behind, that compute slowed where NCCL's
  kernels hold SMs beside it (`sm_terms`); the norm, Adam, post-step gathers.

Collectives that share links are solved together only beside their replica groups; elsewhere
timed as if alone, so the tier is optimistic there; the simulation ranks its best candidates.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from dataclasses import dataclass

from zsim.cluster.device import ADAM_STEP_BYTES_PER_PARAM, DeviceProfile
from zsim.cluster.fabric import Backend
from zsim.cluster.grid import RankGrid
from zsim.cluster.topology import Topology
from zsim.memory import stage_params
from zsim.network.collective import CollectiveOp
from zsim.plan.fsdp_terms import FsdpGroups, fsdp_groups, fsdp_terms
from zsim.plan.lines import CollectiveLines
from zsim.plan.megatron_terms import amax_s, megatron_terms
from zsim.plan.pipeline_terms import bubble_s, partitioned_s
from zsim.plan.qgz_terms import Averaged, qgz_terms
from zsim.plan.sm_terms import beyond, sm_slow
from zsim.plan.zero3_host_terms import zero3_host_s
from zsim.plan.zero3_terms import GatherSums, zero3_terms
from zsim.step import fsdp
from zsim.step.job import StageJob
from zsim.step.kernels import LayerKernels
from zsim.step.optimizer import step_passes
from zsim.step.pipeline import pipe_partitions
from zsim.step.program import Comm, Group
from zsim.step.tensor_parallel import pass_key
from zsim.step.zero_reduce import one_rank_copies_s, reduction_copy_bytes
from zsim.workload.layout import StageSplit, rank_chunks
from zsim.workload.mechanisms import Mechanism
from zsim.workload.model import Layer, ModelSpec
from zsim.workload.parallel import (
    STAGE0_ALLREDUCE_BUCKET_NUMEL,
    DpEngine,
    Offload,
    ParallelConfig,
    Precision,
    ZeroStage,
)
from zsim.workload.shapes import forward_flops


@dataclass(frozen=True)
class Estimate:
    step_s: float
    compute_s: float  # the slowest stage's passes over all micro-batches
    exposed_comm_s: float  # data-parallel communication not hidden behind compute
    bubble_s: float  # pipeline fill and drain, sends on the critical path
    optimizer_s: float
    tokens_per_s: float
    mfu: float
    dp_traffic_bytes: float  # what one GPU sends in data-parallel collectives per step


@dataclass(frozen=True)
class _Pipeline:
    """A layout's distinct stages (stage, forward, backward, parameters held) at their first
    index, each tail timed once, and the slowest's and all stages' forward plus backward."""

    firsts: tuple[tuple[int, float, float, int], ...]
    slowest: float
    total: float


class Estimator:
    """Closed-form step times for many layouts of one model on one cluster; what layouts share
    (a layer's pass at a TP width and micro-batch, a collective's line) is computed once."""

    def __init__(self, model: ModelSpec, topology: Topology, device: DeviceProfile) -> None:
        self.model, self.topology, self.device = model, topology, device
        lines = CollectiveLines(topology)
        self.comms, self.collective_s, self.latency_s = lines.comms, lines.call_s, lines.latency_s
        self.gloo = topology.fabric.backend is Backend.GLOO
        self._passes: dict[tuple[object, ...], tuple[float, float]] = {}
        self._pipelines: dict[tuple[object, ...], _Pipeline] = {}
        self._grids: dict[tuple[object, ...], RankGrid] = {}
        self._groups: dict[tuple[object, ...], tuple[int, ...]] = {}
        self._sends: dict[tuple[tuple[int, int], ...], tuple[int, int]] = {}
        self._beside: dict[int, tuple[tuple[int, ...], ...]] = {}  # DP group -> its TP peers'
        self._flops: dict[object, float] = {}  # forward FLOPs, message sizes, step passes
        self._stages: dict[tuple[object, ...], tuple[list[tuple[int, Layer]], int]] = {}
        self._gathered = GatherSums(model)
        self._units: dict[tuple[int, int, int], list[fsdp.Unit]] = {}  # by (tp, stage, pp)
        self._fsdp_groups: dict[tuple[int, int], FsdpGroups] = {}  # by (h, id(dp group))
        self._averaged: dict[tuple[object, ...], Averaged] = {}  # qgZ, by DP group

    # ---- pieces ----

    def layer_pass_s(self, c: ParallelConfig, stage: int, layer: Layer) -> tuple[float, float]:
        """(forward, backward with any replay) of one layer, as the builder fuses them."""
        # a model's layers of one kind have one shape (its blocks are alike)
        key: tuple[object, ...] = (layer.kind, len(layer.tensors), *pass_key(c))
        if key not in self._passes:
            job = self.job(c, stage)
            tp_group = self._kept(("tp", c.tp), tuple(range(c.tp)))

            cp_group = self._kept(("cp", c.cp, c.tp), tuple(r * c.tp for r in range(c.cp)))

            def tp_time(comm: Comm) -> float:  # and context parallelism's ring
                group = cp_group if comm.group is Group.CP else tp_group
                return self.collective_s(comm.op, comm.nbytes, group)

            kernels = LayerKernels(job, tp_time)
            forward = kernels.pass_template(layer, True)[1]
            self._passes[key] = (forward, kernels.pass_template(layer, False)[1])
        return self._passes[key]

    # ---- a layout ----

    def estimate(self, cfg: ParallelConfig) -> Estimate:
        grid = self._grid(cfg)
        fp8 = cfg.precision is Precision.FP8  # its amax reductions span the stage's ranks
        kernel = (cfg.pp, cfg.virtual_stages, *pass_key(cfg), cfg.dp_cp if fp8 else 0)
        pipeline = self._pipeline(cfg, kernel)
        compute = cfg.grad_accum * pipeline.slowest
        bubble = self._bubble(cfg, grid, pipeline)
        tails = [self._data_parallel(cfg, grid, *stage) for stage in pipeline.firsts]
        exposed, optimizer = max(t[:2] for t in tails)
        step = compute + bubble + exposed + optimizer
        flops = 3 * self._forward_flops(cfg.micro_batch) * cfg.grad_accum * cfg.dp
        peak = self.device.peak_flops.get(str(cfg.precision.compute), 0.0)
        mfu = flops / step / cfg.world_size / peak if peak else 0.0
        tokens, dp_bytes = cfg.global_batch * self.model.seq_len / step, max(t[2] for t in tails)
        return Estimate(step, compute, exposed, bubble, optimizer, tokens, mfu, dp_bytes)

    def job(self, cfg: ParallelConfig, stage: int) -> StageJob:
        return StageJob.of(self.model, cfg, self.device, stage, self.gloo)

    def _grid(self, cfg: ParallelConfig) -> RankGrid:
        key = ("grid", cfg.dp_cp, cfg.pp, cfg.tp)
        if key not in self._grids:
            self._grids[key] = RankGrid(dp=cfg.dp_cp, pp=cfg.pp, tp=cfg.tp)
        return self._grids[key]

    def _pipeline(self, cfg: ParallelConfig, kernel: tuple[object, ...]) -> _Pipeline:
        """Every stage's passes, kept by `kernel`: the split and what a layer's pass depends
        on."""
        if kernel not in self._pipelines:
            stages = [self._stage(cfg, s) for s in range(cfg.pp)]
            firsts = {stage: s for s, stage in reversed(list(enumerate(stages)))}
            steps = [f + b for f, b, _ in stages]
            distinct = tuple((s, *stage) for stage, s in firsts.items())
            self._pipelines[kernel] = _Pipeline(distinct, max(steps), sum(steps))
        return self._pipelines[kernel]

    def _stage(self, cfg: ParallelConfig, stage: int) -> tuple[float, float, int]:
        """(forward, backward of one micro-batch, parameters held) of a pipeline stage's rank
        (`_pipeline` keeps them, by what decides them)."""
        split = StageSplit.of(cfg)
        key = ("stage", cfg.pp, cfg.virtual_stages, stage, cfg.tp, split)
        if key not in self._stages:  # its layers: one of each kind and shape, and how many
            chunks = rank_chunks(self.model, cfg, stage)
            alike = Counter((x.kind, len(x.tensors)) for chunk in chunks for x in chunk)
            first = {(x.kind, len(x.tensors)): x for chunk in chunks for x in chunk}
            held = stage_params(self.model, cfg.pp, cfg.virtual_stages, stage, cfg.tp, split)
            self._stages[key] = ([(n, first[k]) for k, n in alike.items()], held)
        kinds, held = self._stages[key]
        times = [(n, self.layer_pass_s(cfg, stage, layer)) for n, layer in kinds]
        amax = (0.0, 0.0)  # FP8's amax reductions (TransformerEngine), once per chunk pass
        if cfg.precision is Precision.FP8:
            amax = amax_s(self.job(cfg, stage), self.latency_s, self._grid(cfg), stage, self._kept)
        forward = amax[0] + sum(n * f for n, (f, _) in times)
        return forward, amax[1] + sum(n * b for n, (_, b) in times), held

    def _forward_flops(self, micro_batch: int) -> float:
        if micro_batch not in self._flops:
            self._flops[micro_batch] = forward_flops(self.model, micro_batch)
        return self._flops[micro_batch]

    def _bubble(self, cfg: ParallelConfig, grid: RankGrid, pipeline: _Pipeline) -> float:
        """Pipeline fill and drain, and the sends (`pipeline_terms.bubble_s`)."""
        if cfg.pp == 1:
            return 0.0
        partitioned = 0.0
        if pipe_partitions(cfg) > 1:
            key = ("partitioned", cfg.pp > 2, *pass_key(cfg))
            if key not in self._flops:
                job = self.job(cfg, 0)
                tp_group = self._kept(("tp", cfg.tp), tuple(range(cfg.tp)))
                act = job.activation_bytes()
                gather = self.collective_s(CollectiveOp.ALL_GATHER, act, tp_group)
                self._flops[key] = partitioned_s(job, gather)
            partitioned = self._flops[key]
        return bubble_s(cfg, pipeline.slowest, pipeline.total, self._send_s(cfg, grid), partitioned)

    def _send_s(self, cfg: ParallelConfig, grid: RankGrid) -> float:
        """One activation from stage 0 to 1, beside the same send of every other (dp, tp)
        replica where they share its links (they all send at once)."""
        parts = pipe_partitions(cfg)
        key = ("send", cfg.tp, cfg.cp, cfg.micro_batch, cfg.sequence_parallel, cfg.precision, parts)
        if key not in self._flops:
            self._flops[key] = self.job(cfg, 0).activation_bytes() / parts
        where = ("pair", grid.dp, grid.pp, grid.tp)
        if where not in self._groups:
            dp_tp = [(d, t) for d in range(grid.dp) for t in range(grid.tp)]
            pairs = [(grid.rank(d, 0, t), grid.rank(d, 1, t)) for d, t in dp_tp]
            every = tuple(pairs)  # the same sends in another layout: one line
            if every not in self._sends:
                self._sends[every] = pairs[0]
                self._beside[id(pairs[0])] = tuple(pairs[1:])
            self._groups[where] = self._sends[every]
        pair = self._groups[where]
        return self.collective_s(
            CollectiveOp.SEND_RECV, self._flops[key], pair, self._beside[id(pair)]
        )

    def _data_parallel(
        self,
        cfg: ParallelConfig,
        grid: RankGrid,
        stage: int,
        forward: float,
        backward: float,
        params: int,
    ) -> tuple[float, float, float]:
        """A stage's rank: (exposed data-parallel comm, optimizer and post-step s, bytes sent)."""
        group = self._dp_group(grid, stage)
        d, n = cfg.precision.bytes, cfg.dp_cp
        padded = -(-params // n) * n
        exposed = sent = 0.0
        slow = self._sm_slow(cfg, group)
        if n > 1 and cfg.dp_engine is DpEngine.MEGATRON:
            calls = functools.partial(self.collective_s, beside=self._beside[id(group)])
            job, passes = self.job(cfg, stage), (forward, backward)
            exposed, after, sent = megatron_terms(job, self.device, calls, group, passes, slow)
            shard = params / (cfg.shard_ranks if cfg.zero_stage else 1)  # DDP: every rank all
            return exposed, self._optimizer(cfg, stage, shard) + after, sent
        if n > 1 and cfg.dp_engine is DpEngine.FSDP:
            exposed, sent = self._fsdp(cfg, group, stage, (forward, backward), slow)
        elif n > 1 and cfg.zero_stage is ZeroStage.PARAMETERS:
            peers = self._beside[id(group)]

            def collective(op: CollectiveOp, nbytes: float, members: tuple[int, ...]) -> float:
                return self.collective_s(op, nbytes, members, peers if members is group else ())

            h = cfg.knobs.hpz_partition_size
            later = group if h <= 1 else self._kept(("hpz", h, id(group)), group[:h])
            groups, passes = (group, later), (forward, backward)
            sizes = (float(params), float(padded))
            gathered, averaged = self._gathered.of(cfg, stage), self._qgz(cfg, group)
            slows = (slow, self._sm_slow(cfg, later))
            exposed, sent = zero3_terms(
                cfg, self.device, collective, groups, sizes, gathered, passes, averaged, slows
            )
            ranks, scattered = (len(group), len(later)), averaged is None
            exposed += zero3_host_s(cfg, self.device, self.gloo, gathered, ranks, passes, scattered)
        elif n > 1:
            exposed = self._reduce(cfg, stage, group, params, backward, slow)
            reductions = cfg.grad_accum if cfg.zero_stage is ZeroStage.GRADIENTS else 1
            sent = reductions * 2 * (n - 1) / n * params * d  # all-reduces
        elif cfg.dp_engine is DpEngine.DEEPSPEED:
            exposed = one_rank_copies_s(self.job(cfg, stage))
        shard = params / (cfg.shard_ranks if cfg.zero_stage >= ZeroStage.OPTIMIZER else 1)
        optimizer = self._optimizer(cfg, stage, shard)
        if n > 1 and cfg.zero_stage in (ZeroStage.OPTIMIZER, ZeroStage.GRADIENTS):
            peers = self._beside[id(group)]
            optimizer += self.collective_s(CollectiveOp.ALL_GATHER, padded * d, group, peers)
            sent += (n - 1) / n * padded * d
        return exposed, optimizer, sent

    def _fsdp(
        self,
        cfg: ParallelConfig,
        group: tuple[int, ...],
        stage: int,
        passes: tuple[float, float],
        slow: float,
    ) -> tuple[float, float]:
        """FSDP2's terms (`fsdp_terms`); a hybrid mesh's calls beside every block's, stride's."""
        h = cfg.shard_ranks
        if (h, id(group)) not in self._fsdp_groups:
            found = fsdp_groups(group, self._beside[id(group)], h, self._kept)
            self._fsdp_groups[(h, id(group))] = found
        shard, replicas, beside = self._fsdp_groups[(h, id(group))]
        if (key := (cfg.tp, stage, cfg.pp)) not in self._units:
            layers = [x for chunk in rank_chunks(self.model, cfg, stage) for x in chunk]
            self._units[key] = fsdp.units(layers, cfg.tp)

        def collective(op: CollectiveOp, nbytes: float, members: tuple[int, ...]) -> float:
            return self.collective_s(op, nbytes, members, beside.get(id(members), ()))

        groups, units = (shard, replicas), self._units[key]
        return fsdp_terms(cfg, self.device, collective, groups, units, passes, slow)

    def _qgz(self, cfg: ParallelConfig, group: tuple[int, ...]) -> Averaged | None:
        """qgZ's averaging of the rank's gradients (data parallelism only: one stage)."""
        node, key = self.topology.gpus_per_node, ("qgz", id(group), cfg.precision)
        if not cfg.qgz_nodes(node):
            return None
        if key not in self._averaged:
            job = StageJob.of(self.model, cfg, self.device, 0, self.gloo, node)
            calls, peers = self.collective_s, self._beside[id(group)]
            self._averaged[key] = qgz_terms(job, self.device, calls, peers, group, self._kept)
        return self._averaged[key]

    def _dp_group(self, grid: RankGrid, stage: int) -> tuple[int, ...]:
        """The first pipeline stage's data-parallel group stands for every stage's: their
        groups are alike (one node's GPUs, the next node's, ...), and their collectives'
        lines are then found once per layout shape, not once per stage."""
        del stage
        key = ("dp", grid.dp, grid.pp, grid.tp)
        if key not in self._groups:
            group = tuple(grid.rank(d, 0, 0) for d in range(grid.dp))
            if group not in self._groups:  # the same GPUs in another layout: its lines hold
                self._groups[group] = group
                self._beside[id(group)] = tuple(
                    tuple(grid.rank(d, 0, t) for d in range(grid.dp)) for t in range(1, grid.tp)
                )
            self._groups[key] = self._groups[group]
        return self._groups[key]

    def _kept(self, key: tuple[object, ...], group: tuple[int, ...]) -> tuple[int, ...]:
        """One tuple per group, kept: collective lines are keyed by its id."""
        return self._groups.setdefault(key, group)

    def _reduce(
        self,
        cfg: ParallelConfig,
        stage: int,
        group: tuple[int, ...],
        params: int,
        backward: float,
        slow: float,
    ) -> float:
        """ZeRO 0-2's gradient all-reduces, in their buckets, and what they leave exposed."""
        bucket = cfg.knobs.reduce_bucket_size if cfg.zero_stage else STAGE0_ALLREDUCE_BUCKET_NUMEL
        calls = max(1, math.ceil(params / bucket))
        key = ("reduce", id(group), calls, params, cfg.precision, cfg.zero_stage)
        if key not in self._flops:  # the buckets' all-reduces and their copies
            job, peers = self.job(cfg, stage), self._beside[id(group)]
            size = params / calls * job.element_bytes
            line = self.collective_s(CollectiveOp.ALL_REDUCE, size, group, peers)
            copies = self.device.copy_time_s(reduction_copy_bytes(job), job.dtype)
            self._flops[key] = calls * line + copies
        reduce = self._flops[key]
        every_micro_batch = cfg.zero_stage is ZeroStage.GRADIENTS
        beside = cfg.overlap_comm and cfg.zero_stage is not ZeroStage.NONE
        late = beyond(backward, reduce, slow) if beside else reduce
        exposed = max(late, reduce / calls)  # the last bucket waits either way
        return exposed * (cfg.grad_accum if every_micro_batch else 1)

    def _sm_slow(self, cfg: ParallelConfig, group: tuple[int, ...]) -> float:
        """A pass beside the data-parallel collectives over alone (`sm_terms`): a block's SM
        share (stage 0's: blocks are alike) on the SMs the group's channels leave; kept."""
        if self.gloo or not cfg.models(Mechanism.NCCL_SMS):
            return 1.0
        shape = (cfg.tp, cfg.cp, cfg.sequence_parallel, cfg.micro_batch, cfg.precision)
        key = ("sm", id(group), *shape, cfg.flash_attention, cfg.attention_kernel, cfg.elementwise)
        if key not in self._flops:
            self._flops[key] = sm_slow(self.topology, self.device, self.job(cfg, 0), group)
        return self._flops[key]

    def _optimizer(self, cfg: ParallelConfig, stage: int, shard: float) -> float:
        device = self.device
        if cfg.offload is not Offload.NONE:
            link = device.host_link_bytes_per_s
            rate = device.host_adam_params_per_s or 1e-30
            return shard * 4 / link + shard / rate + shard * cfg.precision.bytes / link
        key = ("step", cfg.zero_stage, cfg.dp_engine, cfg.precision, shard)
        if key not in self._flops:
            prepare = step_passes(self.job(cfg, stage), shard)
            self._flops[key] = device.copy_time_s(prepare, str(cfg.precision.compute))
        return self._flops[key] + shard * ADAM_STEP_BYTES_PER_PARAM / device.optimizer_bytes_per_s
