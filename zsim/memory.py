"""The memory ledger of one GPU: bytes by category for a model, a layout and a ZeRO stage.

Model states follow the ZeRO paper's account (Rajbhandari et al. 2020, and the seeds): with
mixed precision and Adam every parameter costs 2 bytes of 16-bit weights, 2 of 16-bit gradients
and 12 of optimizer state (fp32 master, momentum, variance) = 16 bytes; stage k partitions the
first k of (optimizer, gradients, parameters) across the Nd data-parallel ranks. TP divides the
sharded tensors by t; PP gives each stage its layers. Activations come from `ModelSpec`'s tensor
account (Korthikanti et al. 2022) times the micro-batches a pipeline stage keeps in flight.
DeepSpeed's communication buffers (gradient buckets, ZeRO-3 gathered parameters) and the fp32
gradient partition its optimizer step builds count too, outside the model states. PyTorch
FSDP's ledger (fp32 shards, unsharded units) is `zsim.step.fsdp`'s.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, fields, replace

from zsim.cluster.device import DeviceProfile
from zsim.step import fsdp, megatron_dp, zero3
from zsim.workload import fp8
from zsim.workload.layout import (
    DEFAULT_SPLIT,
    RECOMPUTED,
    StageSplit,
    layer_ac_checkpoints,
    rank_layers,
    stage_layers,
)
from zsim.workload.model import Layer, LayerKind, ModelKind, ModelSpec
from zsim.workload.parallel import (
    STAGE0_ALLREDUCE_BUCKET_NUMEL,
    DpEngine,
    Offload,
    ParallelConfig,
    PipelineSchedule,
    Precision,
    Recompute,
    ZeroStage,
)
from zsim.workload.shapes import (
    Shard,
    layer_input_bytes,
    loss_saved_bytes,
    sac_kept_bytes,
    saved_tensors,
)

FSDP = DpEngine.FSDP
# Bytes per parameter of each model state (the seeds' table 2.1).
FP32_BYTES = 4
ADAM_MOMENTS = 2  # exp_avg and exp_avg_sq, fp32 each


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of each model state before partitioning."""

    parameters: int
    gradients: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer


def state_bytes(precision: Precision, stage: ZeroStage) -> StateBytes:
    """16-bit training keeps an fp32 master copy in the optimizer (2 + 2 + 12 = 16 bytes).

    fp32 training has no separate master in plain DP (4 + 4 + 8), but DeepSpeed's ZeRO-1/2/3
    optimizers always build an fp32 copy of their partition (`single_partition_of_fp32_groups`
    in stage_1_and_2.py, `fp32_partitioned_groups_flat` in stage3.py), so there the optimizer
    partition holds master + m + v = 12 bytes.
    """
    p = precision.bytes
    master = FP32_BYTES if precision.mixed or stage >= ZeroStage.OPTIMIZER else 0
    return StateBytes(parameters=p, gradients=p, optimizer=master + ADAM_MOMENTS * FP32_BYTES)


@dataclass(frozen=True)
class MemoryLedger:
    """Bytes on one device (and offloaded to its host), by category."""

    parameters: float
    gradients: float
    optimizer_states: float
    activations: float | None  # None when the model is known by parameter count only
    comm_buffers: float
    step_buffers: float  # built for the optimizer step and freed after it
    host_offloaded: float

    @property
    def model_states(self) -> float:
        return self.parameters + self.gradients + self.optimizer_states

    @property
    def device_total(self) -> float:
        return self.model_states + (self.activations or 0.0) + self.comm_buffers + self.step_buffers

    def as_dict(self) -> dict[str, float | None]:
        out: dict[str, float | None] = {f.name: getattr(self, f.name) for f in fields(self)}
        out["model_states"] = self.model_states
        out["device_total"] = self.device_total
        return out


# ---- the ledger ---------------------------------------------------------------------------


def overflow_bytes(ledger: MemoryLedger, device: DeviceProfile) -> float:
    """How far `ledger` is over what the device holds, or over its share of the host's DRAM
    when it offloads (where the preset gives one); <= 0 fits."""
    over = ledger.device_total - device.usable_bytes
    if device.host_memory_bytes > 0:
        over = max(over, ledger.host_offloaded - device.host_memory_bytes)
    return over


def model_state_bytes(params: float, cfg: ParallelConfig) -> tuple[float, float, float, float]:
    """(parameters, gradients, optimizer, offloaded-to-host) bytes on one rank for `params`
    parameters held by its TP/PP slice."""
    if cfg.dp_engine is DpEngine.FSDP:
        return (*fsdp.model_state_bytes(params, cfg), 0.0)
    per = state_bytes(cfg.precision, cfg.zero_stage)
    nd = cfg.dp_cp
    stage = cfg.zero_stage
    p = params * per.parameters / (nd if stage >= ZeroStage.PARAMETERS else 1)
    g = params * per.gradients / (nd if stage >= ZeroStage.GRADIENTS else 1)
    if cfg.dp_engine is DpEngine.MEGATRON:
        g = params * megatron_dp.grad_bytes(cfg)  # Megatron-Core's main_grad buffer
    o = params * per.optimizer / (nd if stage >= ZeroStage.OPTIMIZER else 1)
    if stage is ZeroStage.PARAMETERS and cfg.knobs.hpz_partition_size > 1:
        # ZeRO++'s hpZ: a secondary partition over h ranks, in the parameters' dtype, where
        # the parameters live (partition_parameters.py `_partition_param_sec`)
        p += params * per.parameters / cfg.knobs.hpz_partition_size
    host = 0.0
    if cfg.offload is not Offload.NONE:
        # ZeRO-Offload: master, m, v and an fp32 gradient partition live on the host; ZeRO-3
        # also keeps its gradient partitions there (stage3.py: `grad_partitions_flat_buffer` on
        # `self.device`, the CPU with offload_optimizer), ZeRO-1/2 on the GPU
        host += o + params * FP32_BYTES / nd
        o = 0.0
        if stage is ZeroStage.PARAMETERS:
            g = 0.0
    if cfg.offload is Offload.OPTIMIZER_PARAMS:
        host += p
        p = 0.0
    return p, g, o, host


def in_flight_micro_batches(cfg: ParallelConfig, pipeline_stage: int = 0) -> float:
    """Micro-batches whose activations a pipeline stage holds at its peak.

    GPipe keeps all m. 1F1B and interleaved 1F1B keep their warm-up micro-batches plus one:
    Megatron's `forward_backward_pipelining_with_interleaving` warms up (p-r-1)*2 + (v-1)*p
    chunk micro-batches on rank r, each 1/v of the stage's layers, which is p - r for v = 1
    (Narayanan et al. 2021) and p (1 + (p-1)/(p v)) on the first stage (Korthikanti et al.
    2022, section 4.2.3). Never more than the m micro-batches of the step.
    """
    p, m, v, r = cfg.pp, cfg.grad_accum, cfg.virtual_stages, pipeline_stage
    if p == 1:
        return 1.0
    if cfg.pp_schedule is PipelineSchedule.GPIPE:
        return float(m)
    warmup_chunks = (p - r - 1) * (2 if v > 1 else 1) + (v - 1) * p
    return min((warmup_chunks + 1) / v, float(m))


_SELECTIVE_DROPS = ("softmax_output", "softmax_dropout_mask", "dropped_softmax")


def activation_bytes(model: ModelSpec, cfg: ParallelConfig, pipeline_stage: int = 0) -> float:
    """Activations of one pipeline stage at its peak (see `in_flight_micro_batches`)."""
    shard = Shard.of(cfg)
    selective = cfg.recompute is Recompute.SELECTIVE
    split = (cfg.pp, cfg.virtual_stages, pipeline_stage, StageSplit.of(cfg))
    per_layer = list(_stage_saved(model, split, shard, selective))
    if pipeline_stage == cfg.pp - 1:
        loss = loss_saved_bytes(model, cfg.micro_batch, cfg.precision.bytes)
        per_layer.append((LayerKind.HEAD, loss))  # kept under full recompute too
    replays = _replayed(per_layer, cfg.recompute)
    if any(replays):  # each replayed layer keeps what its checkpoint saves
        full = cfg.recompute is not Recompute.SELECTIVE_OP
        kept = layer_input_bytes(model, shard) if full else sac_kept_bytes(model, shard)
        recomputable = [b for (_, b), r in zip(per_layer, replays, strict=True) if r]
        others = sum(b for (_, b), r in zip(per_layer, replays, strict=True) if not r)
        stored = kept * len(recomputable) + others
        # during backward one layer is replayed and its full activations exist at once
        working = max(recomputable, default=0.0)
        in_flight = in_flight_micro_batches(cfg, pipeline_stage)
        return stored * in_flight + working
    return sum(b for _, b in per_layer) * in_flight_micro_batches(cfg, pipeline_stage)


def _replayed(per_layer: list[tuple[LayerKind, float]], recompute: Recompute) -> list[bool]:
    """Which of a stage's layers backward replays: full recompute every block (and an MLP's
    layers), torchtitan's op-level AC every block, its layer AC the blocks it checkpoints
    (`layout.layer_ac_checkpoints`; one pipeline stage, so counted in model order)."""
    if recompute is Recompute.SELECTIVE_LAYER:
        count = itertools.count(1)
        return [k is LayerKind.BLOCK and layer_ac_checkpoints(next(count)) for k, _ in per_layer]
    kinds = {Recompute.FULL: RECOMPUTED, Recompute.SELECTIVE_OP: (LayerKind.BLOCK,)}
    return [k in kinds.get(recompute, ()) for k, _ in per_layer]


@functools.lru_cache(maxsize=8192)  # a planner's layouts share few (split, shard) pairs
def _stage_saved(
    model: ModelSpec, split: tuple[int, int, int, StageSplit], shard: Shard, selective: bool
) -> tuple[tuple[LayerKind, float], ...]:
    """What each layer of a (pp, virtual stages, stage, split) rank saves for its backward
    (selective recompute drops attention's core)."""
    pp, virtual, stage, how = split
    out = []
    for layer in (
        x for c in range(virtual) for x in stage_layers(model, pp * virtual, c * pp + stage, how)
    ):
        saved = saved_tensors(model, layer, shard)
        if selective and layer.kind is LayerKind.BLOCK:
            saved = {k: v for k, v in saved.items() if k not in _SELECTIVE_DROPS}
        out.append((layer.kind, sum(saved.values())))
    return tuple(out)


@functools.lru_cache(maxsize=4096)
def stage_params(
    model: ModelSpec, pp: int, virtual: int, stage: int, tp: int, split: StageSplit = DEFAULT_SPLIT
) -> int:
    """Parameters one TP rank of a pipeline stage holds."""
    chunks = (stage_layers(model, pp * virtual, c * pp + stage, split) for c in range(virtual))
    return sum(x.params(tp) for chunk in chunks for x in chunk)


def comm_buffer_bytes(
    model: ModelSpec, cfg: ParallelConfig, layers: tuple[Layer, ...], params: float
) -> float:
    """DeepSpeed's communication buffers on one rank, at the end of a backward.

    Measured on DeepSpeed 0.19 (held tensors, byte-exact):
    - stage 0 flattens each all-reduce bucket (up to `STAGE0_ALLREDUCE_BUCKET_NUMEL`) into a
      copy, over one data-parallel rank too (the engine has no shortcut for it);
    - stages 1-2 allocate the whole IPG bucket, reduce_bucket_size elements whatever the model
      size (two with overlap_comm), during backward (`setup_buckets`);
    - stage 3 keeps one such bucket from initialisation on, and the parameters its coordinator
      keeps gathered: with the default reuse distance the whole model (under 1e9 elements) is
      gathered by the end of a forward (replayed by `zsim.step.zero3`).
    """
    if cfg.dp_engine is DpEngine.FSDP:
        return fsdp.buffer_bytes(cfg, layers, model.tied_embeddings)
    b = cfg.precision.bytes
    stage = cfg.zero_stage
    if stage is ZeroStage.NONE:
        return min(STAGE0_ALLREDUCE_BUCKET_NUMEL, params) * b
    bucket = cfg.knobs.reduce_bucket_size * b
    if stage is ZeroStage.PARAMETERS:
        return bucket + zero3_gathered_numel(model, cfg, layers) * b
    if not cfg.knobs.contiguous_gradients:
        return 0.0
    return bucket * (2 if cfg.overlap_comm else 1)


STAGE3_SUB_GROUP_SIZE = 1_000_000_000  # sub_group_size's default, deepspeed/runtime/zero/config.py


def step_buffer_bytes(params: float, cfg: ParallelConfig) -> float:
    """The fp32 gradient partition a ZeRO optimizer step builds for its master weights.

    Stage 3 flattens each sub-group's gradient partition into a new fp32 tensor, even in fp32
    training (`_prepare_fp32_grad_for_sub_group`, stage3.py), one sub-group at a time; stages
    1-2 convert the flat 16-bit partition with `.to(fp32)`, a copy only in mixed precision
    (`step`, stage_1_and_2.py). Offloaded optimizers build it on the host instead.
    """
    stage = cfg.zero_stage
    if stage is ZeroStage.NONE or cfg.offload is not Offload.NONE or cfg.dp_engine is FSDP:
        return 0.0  # FSDP's Adam updates its fp32 shard in place
    partition = params / cfg.dp_cp
    if stage is ZeroStage.PARAMETERS:
        return min(partition, STAGE3_SUB_GROUP_SIZE) * FP32_BYTES
    return partition * FP32_BYTES if cfg.precision.mixed else 0.0


def zero3_gathered_numel(model: ModelSpec, cfg: ParallelConfig, layers: tuple[Layer, ...]) -> int:
    """Full (non-persistent) parameters alive at once beyond their partitions, at the peak of
    DeepSpeed's coordinator over a micro-step; unknown (0) for a bare parameter count."""
    if model.kind is ModelKind.PARAMS_ONLY:
        return 0
    # the coordinator's replay depends on the modules' order and sizes, not on the batch or dp
    knobs = replace(cfg.knobs, hpz_partition_size=1)  # gathers, not where they come from
    same = replace(cfg, dp=1, micro_batch=1, grad_accum=1, offload=Offload.NONE, knobs=knobs)
    return _gathered_numel(model, same, layers)


@functools.lru_cache(maxsize=1024)
def _gathered_numel(model: ModelSpec, cfg: ParallelConfig, layers: tuple[Layer, ...]) -> int:
    trace = zero3.module_trace(model, cfg, layers)
    persistent = sum({u.key: u.span - u.numel for u in trace}.values())
    return zero3.replay(trace, cfg.knobs).peak_available_numel - persistent


def zero3_persistent_bytes(cfg: ParallelConfig, layers: tuple[Layer, ...]) -> float:
    """Stage 3 keeps small parameters (<= stage3_param_persistence_threshold elements) whole
    on every rank, beside their partition (`ds_persist`, partition_parameters.py)."""
    threshold = cfg.knobs.param_persistence_threshold
    sizes = _persistent_sizes(layers, cfg.tp, threshold)
    return sum(-(-n // cfg.dp_cp) * cfg.dp_cp for n in sizes) * cfg.precision.bytes


@functools.lru_cache(maxsize=1024)
def _persistent_sizes(layers: tuple[Layer, ...], tp: int, threshold: int) -> tuple[int, ...]:
    sizes = (t.per_rank(tp) for layer in layers for t in layer.tensors)
    return tuple(n for n in sizes if n <= threshold)


def ledger(model: ModelSpec, cfg: ParallelConfig, pipeline_stage: int = 0) -> MemoryLedger:
    """The ledger of one rank of `pipeline_stage`."""
    layers = rank_layers(model, cfg, pipeline_stage)
    split = StageSplit.of(cfg)
    params = stage_params(model, cfg.pp, cfg.virtual_stages, pipeline_stage, cfg.tp, split)
    p, g, o, host = model_state_bytes(params, cfg)
    if cfg.precision is Precision.FP8:  # TE's FP8 weights and their transposes
        p += fp8.weight_params(layers, cfg.tp) * fp8.FP8_WEIGHT_BYTES
    deepspeed3 = cfg.zero_stage is ZeroStage.PARAMETERS and cfg.dp_engine is not FSDP
    if deepspeed3 and model.kind is not ModelKind.PARAMS_ONLY:
        p += zero3_persistent_bytes(cfg, layers)  # FSDP shards every parameter
    acts = (
        None
        if model.kind is ModelKind.PARAMS_ONLY
        else activation_bytes(model, cfg, pipeline_stage)
    )
    comm = comm_buffer_bytes(model, cfg, layers, params)
    return MemoryLedger(p, g, o, acts, comm, step_buffer_bytes(params, cfg), host)


def peak_ledger(model: ModelSpec, cfg: ParallelConfig) -> tuple[int, MemoryLedger]:
    """The pipeline stage with the largest device total (the first of equals), and its
    ledger."""
    candidates = _peak_candidates(model, cfg.pp, cfg.virtual_stages, StageSplit.of(cfg))
    ledgers = {s: ledger(model, cfg, s) for s in candidates}
    worst = max(candidates, key=lambda s: ledgers[s].device_total)
    return worst, ledgers[worst]


@functools.lru_cache(maxsize=1024)
def _peak_candidates(model: ModelSpec, pp: int, virtual: int, split: StageSplit) -> tuple[int, ...]:
    """The stages that can hold the most: stages holding alike layers (a model's middle
    blocks) differ only in the micro-batches in flight, which never grow with the stage's
    index (`in_flight_micro_batches`), so the first of each kind, and the last stage (it also
    keeps the loss's activations)."""
    first: dict[tuple[object, ...], int] = {}
    for stage in range(pp):
        chunks = (stage_layers(model, pp * virtual, c * pp + stage, split) for c in range(virtual))
        alike = tuple((x.kind, x.tensors) for chunk in chunks for x in chunk)
        first.setdefault(alike, stage)
    return tuple(sorted({*first.values(), pp - 1}))
