"""The layouts a cluster allows for one model and global batch, by the frameworks' own rules.

ZeRO stage x offload x tp (within a node) x pp x schedule (1F1B, GPipe, interleaved with v)
x micro-batch (so the accumulation) x recompute x sequence parallelism x pipeline engine,
ZeRO-3 with ZeRO++'s hpZ (over a node) and qwZ, ZeRO-3 as PyTorch FSDP2 runs it, and on
request Megatron-Core's DDP and distributed optimizer with context parallelism (and FP8).
What a framework refuses is not enumerated: `ParallelConfig` and `check_layout` hold the rules
(ZeRO-2/3 not with DeepSpeed's pipeline, offload from ZeRO-1, heads and kv-heads divisible by
tp, layers over pp x v, interleaving's accumulation a multiple of pp, the batch rule).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, replace

from zsim.errors import InputError
from zsim.inputs.scenario import check_layout
from zsim.workload.eager import Elementwise
from zsim.workload.model import ModelKind, ModelSpec
from zsim.workload.parallel import (
    DpEngine,
    Offload,
    ParallelConfig,
    PipelineEngine,
    PipelineSchedule,
    Precision,
    Recompute,
    ZeroKnobs,
    ZeroStage,
)
from zsim.workload.sharding import FsdpSharding, node_shard_size


@dataclass(frozen=True)
class Space:
    """What the search may choose; defaults are everything."""

    stages: tuple[ZeroStage, ...] = tuple(ZeroStage)
    tps: tuple[int, ...] | None = None  # None: every width within a node
    pps: tuple[int, ...] | None = None  # None: every depth
    offloads: tuple[Offload, ...] = tuple(Offload)
    # torchtitan's op- and layer-level AC only where asked (a job's own modes, not searched)
    recomputes: tuple[Recompute, ...] = tuple(
        r for r in Recompute if r not in ("selective-op", "selective-layer")
    )
    virtual_stages: tuple[int, ...] = (2, 3, 4)
    max_micro_batch: int = 16
    precision: Precision = Precision.BF16
    flash_attention: bool = True
    # how the job's framework runs a block's norms, RoPE and activation (zsim.workload.eager)
    elementwise: Elementwise = Elementwise.FUSED
    zero_plus_plus: bool = True  # ZeRO-3 with ZeRO++'s hpZ and qwZ too
    # whose data parallelism: DeepSpeed's (and Megatron's pipelines); PyTorch FSDP2's (ZeRO-3's
    # layouts as FSDP runs them: full, grad-op, hybrid) on request, until its closed form and
    # its local validation cover more than 1x2 (docs/fsdp-semantics.md)
    engines: tuple[DpEngine, ...] = (DpEngine.DEEPSPEED,)
    # with Megatron-Core's engine: its context-parallel sizes (each sequence split over cp)
    cps: tuple[int, ...] = (1,)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _allowed(value: int, choices: tuple[int, ...] | None) -> bool:
    return choices is None or value in choices


def _pipelines(pp: int, accum: int, space: Space) -> Iterator[dict[str, object]]:
    """(engine, schedule, v) choices for a pipeline of pp stages."""
    if pp == 1:
        yield {}
        return
    yield {"pipeline_engine": PipelineEngine.DEEPSPEED}
    megatron = PipelineEngine.MEGATRON
    yield {"pipeline_engine": megatron, "pp_schedule": PipelineSchedule.ONE_F_ONE_B}
    if accum % pp == 0:
        for v in space.virtual_stages:
            yield {
                "pipeline_engine": megatron,
                "pp_schedule": PipelineSchedule.INTERLEAVED,
                "virtual_stages": v,
            }


def _memory(zero: ZeroStage, space: Space) -> Iterator[tuple[ZeroStage, Offload]]:
    for offload in space.offloads:
        if offload is Offload.NONE or (
            zero >= ZeroStage.OPTIMIZER
            and (offload is Offload.OPTIMIZER or zero is ZeroStage.PARAMETERS)
        ):
            yield zero, offload


def layouts(
    model: ModelSpec, world: int, gpus_per_node: int, global_batch: int, space: Space = Space()
) -> Iterator[ParallelConfig]:
    """Every layout of `model` on `world` GPUs with this global batch that the frameworks
    accept (tensor parallelism inside a node)."""
    widths = [t for t in _divisors(gpus_per_node) if world % t == 0 and _allowed(t, space.tps)]
    if model.kind is not ModelKind.TRANSFORMER:
        widths = [1]
    for tp, cp in itertools.product(widths, _context(model, world, space)):
        depths = _divisors(world // (tp * cp))
        for pp in (p for p in depths if p <= model.layers and _allowed(p, space.pps)):
            dp = world // (tp * pp * cp)
            if global_batch % dp:
                continue
            per_rank = global_batch // dp
            micro_batches = [b for b in _divisors(per_rank) if b <= space.max_micro_batch]
            zeros = [z for z in space.stages if pp == 1 or z <= ZeroStage.OPTIMIZER]
            for micro, zero, recompute in itertools.product(micro_batches, zeros, space.recomputes):
                accum = per_rank // micro
                for sp in (False, True) if tp > 1 else (False,):
                    for (stage, offload), pipe in itertools.product(
                        _memory(zero, space), list(_pipelines(pp, accum, space))
                    ):
                        sizes: dict[str, object] = {"dp": dp, "tp": tp, "pp": pp}
                        sizes |= {"micro_batch": micro}
                        sizes |= {"grad_accum": accum, "zero_stage": stage, "offload": offload}
                        yield from _megatron(model, sizes | {"cp": cp}, recompute, sp, pipe, space)
                        found = None if cp > 1 else _valid(model, sizes, recompute, sp, pipe, space)
                        if found is None:
                            continue
                        if DpEngine.DEEPSPEED in space.engines:
                            yield found
                            yield from _zero_plus_plus(found, gpus_per_node, space)
                        yield from _fsdp(found, gpus_per_node, space)


def _context(model: ModelSpec, world: int, space: Space) -> tuple[int, ...]:
    """The context-parallel sizes to search (only those asked for): Megatron-Core's, splitting
    each sequence into 2 x cp chunks (1 without its engine)."""
    if DpEngine.MEGATRON not in space.engines:
        return (1,)
    splits = [c for c in space.cps if c == 1 or model.seq_len % (2 * c) == 0]
    return tuple(sorted({c for c in splits if world % c == 0}))


def _megatron(
    model: ModelSpec,
    sizes: dict[str, object],
    recompute: Recompute,
    sequence_parallel: bool,
    pipe: dict[str, object],
    space: Space,
) -> Iterator[ParallelConfig]:
    """The layout as Megatron-Core runs it: its DDP (ZeRO-0) or distributed optimizer (ZeRO-1)
    with --overlap-grad-reduce and, for the latter, --overlap-param-gather."""
    if DpEngine.MEGATRON not in space.engines or pipe.get("pipeline_engine") == "deepspeed":
        return
    one = sizes["zero_stage"] is ZeroStage.OPTIMIZER
    megatron = {"dp_engine": DpEngine.MEGATRON, "overlap_param_gather": one}
    knobs = {"knobs": ZeroKnobs(overlap_comm=True)}
    found = _valid(model, sizes | megatron | knobs, recompute, sequence_parallel, pipe, space)
    if found is not None:
        yield found


def _zero_plus_plus(
    cfg: ParallelConfig, gpus_per_node: int, space: Space
) -> Iterator[ParallelConfig]:
    """ZeRO-3's ZeRO++ variants: qwZ, and across nodes every combination of hpZ over a node,
    qwZ and qgZ (each is its own ds_config key; DeepSpeed builds hpZ and qgZ groups from
    global ranks: data parallelism only)."""
    if not space.zero_plus_plus or cfg.zero_stage is not ZeroStage.PARAMETERS or cfg.dp == 1:
        return
    k, nodes = cfg.knobs, cfg.dp > gpus_per_node and cfg.dp % gpus_per_node == 0
    choices = [replace(k, quantized_weights=True)]
    if cfg.tp == cfg.pp == 1 and nodes:
        hpz = (1, gpus_per_node)
        choices = [
            replace(k, hpz_partition_size=h, quantized_weights=w, quantized_gradients=g)
            for h, w, g in itertools.product(hpz, (False, True), (False, True))
            if (h, w, g) != (1, False, False)  # plain ZeRO-3: the layout itself
        ]
    for knobs in choices:
        yield replace(cfg, knobs=knobs)


def _fsdp(cfg: ParallelConfig, gpus_per_node: int, space: Space) -> Iterator[ParallelConfig]:
    """ZeRO-3's layouts as PyTorch FSDP2 runs them: FULL_SHARD, SHARD_GRAD_OP and, across
    nodes, HYBRID_SHARD within a node's data-parallel ranks (FSDP without PP or offload)."""
    plain = cfg.knobs == ZeroKnobs() and cfg.offload is Offload.NONE and cfg.pp == 1
    wanted = DpEngine.FSDP in space.engines and cfg.zero_stage is ZeroStage.PARAMETERS
    if not wanted or cfg.dp == 1 or not plain:
        return
    fsdp = {"dp_engine": DpEngine.FSDP}
    for sharding in (FsdpSharding.FULL, FsdpSharding.GRAD_OP):
        yield replace(cfg, **fsdp, fsdp_sharding=sharding)  # type: ignore[arg-type]
    node = node_shard_size(gpus_per_node, cfg.tp, cfg.dp)  # a node's data-parallel ranks
    if 1 < node < cfg.dp and cfg.dp % node == 0:
        hybrid = {"fsdp_sharding": FsdpSharding.HYBRID, "fsdp_shard_size": node}
        yield replace(cfg, **fsdp, **hybrid)  # type: ignore[arg-type]


def _valid(
    model: ModelSpec,
    fields: dict[str, object],
    recompute: Recompute,
    sequence_parallel: bool,
    pipe: dict[str, object],
    space: Space,
) -> ParallelConfig | None:
    try:
        cfg = ParallelConfig(
            **fields,  # type: ignore[arg-type]
            **pipe,  # type: ignore[arg-type]
            recompute=recompute,
            sequence_parallel=sequence_parallel,
            precision=space.precision,
            flash_attention=space.flash_attention and model.kind is ModelKind.TRANSFORMER,
            elementwise=space.elementwise,
        )
        check_layout(model, cfg)
    except InputError:
        return None
    return cfg
