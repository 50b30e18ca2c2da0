"""Which layers a pipeline rank holds, and which kernels one layer runs in each pass.

Shared by the memory ledger, the schedule and the ZeRO-3 coordinator, so all three see the
same placement and the same recompute policy.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache, lru_cache
from typing import NamedTuple

from zsim.errors import InputError, require
from zsim.workload.model import (
    WORD_EMBEDDING,
    ComputeOp,
    Layer,
    LayerKind,
    ModelKind,
    ModelSpec,
)
from zsim.workload.parallel import ParallelConfig, Recompute
from zsim.workload.pipe_partition import Balancer, PartitionMethod, balanced_bounds
from zsim.workload.shapes import Shard, backward_ops, forward_ops, sac_replay

RECOMPUTED = (LayerKind.BLOCK, LayerKind.LINEAR)  # what full recompute checkpoints
# selective recompute replays attention's core (Korthikanti et al. 2022, section 5)
SELECTIVE_OPS = ("attn_scores", "softmax_dropout", "attn_values")


class StageSplit(NamedTuple):
    """How a pipeline's stages divide the model: DeepSpeed's partition method and balancer,
    and the TP degree its "parameters" method weighs layers at (1 for the other methods, so
    that layouts differing only in tp share their splits)."""

    method: PartitionMethod = PartitionMethod.UNIFORM
    balancer: Balancer = Balancer.DP
    tp: int = 1

    @classmethod
    def of(cls, cfg: ParallelConfig) -> StageSplit:
        weighed = cfg.pp_partition is PartitionMethod.PARAMETERS
        return cls(cfg.pp_partition, cfg.pp_balancer, cfg.tp if weighed else 1)


DEFAULT_SPLIT = StageSplit()


@lru_cache(maxsize=8192)  # a planner asks for the same splits of one model thousands of times
def stage_layers(
    model: ModelSpec, stages: int, stage: int, split: StageSplit = DEFAULT_SPLIT
) -> tuple[Layer, ...]:
    """The modules of one (virtual) pipeline stage, in forward order: the embedding first, the
    head last, the blocks between split by `split`'s method (zsim.workload.pipe_partition).

    With tied embeddings the stage holding the head also holds a copy of the word embedding
    for the output projection, as Megatron and DeepSpeed's TiedLayerSpec do (its gradient is
    all-reduced with the first stage's copy).
    """
    layers = model.layer_list()
    if stages == 1:
        return layers
    if split.method is PartitionMethod.UNIFORM:
        chosen = _uniform_stage(layers, stages, stage)
    else:
        weights = _weights(model, layers, split)
        bounds = balanced_bounds(weights, stages, split.balancer)
        chosen = list(layers[bounds[stage] : bounds[stage + 1]])
    kinds = {x.kind for x in chosen}
    if LayerKind.HEAD in kinds and LayerKind.EMBEDDING not in kinds and _tied(model):
        embedding = next(x for x in layers if x.kind is LayerKind.EMBEDDING)
        word = tuple(t for t in embedding.tensors if t.name == WORD_EMBEDDING)
        chosen.append(Layer("word_embedding_copy", LayerKind.TIED_COPY, word))
    return tuple(chosen)


def _tied(model: ModelSpec) -> bool:
    return model.tied_embeddings and model.kind is ModelKind.TRANSFORMER


def _uniform_stage(layers: tuple[Layer, ...], stages: int, stage: int) -> list[Layer]:
    blocks = [x for x in layers if x.kind in RECOMPUTED]
    first, last = uniform_bounds(len(blocks), stages, stage)
    chosen = list(blocks[first:last])
    if stage == 0:
        chosen = [x for x in layers if x.kind is LayerKind.EMBEDDING] + chosen
    if stage == stages - 1:
        chosen += [x for x in layers if x.kind is LayerKind.HEAD]
    return chosen


def _weights(model: ModelSpec, layers: tuple[Layer, ...], split: StageSplit) -> list[int]:
    """Each module's weight in DeepSpeed's balance. GPTModelPipe's output layer is the tied
    embedding again (its final norm, weighing 0, is folded into zsim's head here)."""
    if split.method is PartitionMethod.PARAMETERS:  # what one TP rank builds of each layer
        embedding = next((x for x in layers if x.kind is LayerKind.EMBEDDING), None)
        tied_head = embedding.params(split.tp) if embedding and _tied(model) else 0
        head = {LayerKind.HEAD: tied_head}
        return [x.params(split.tp) + head.get(x.kind, 0) for x in layers]
    units = set(RECOMPUTED)  # the blocks (an MLP's layers)
    if split.method is PartitionMethod.TRANSFORMER_EMBEDDING:
        units |= {LayerKind.EMBEDDING, LayerKind.HEAD}
    return [int(x.kind in units) for x in layers]


def uniform_bounds(items: int, parts: int, part: int) -> tuple[int, int]:
    """[first, last) of `part` when `items` are split as evenly as possible, the first
    `items % parts` parts taking one more (DeepSpeed's `partition_uniform`)."""
    size, extra = divmod(items, parts)
    first = part * size + min(part, extra)
    return first, first + size + (1 if part < extra else 0)


def rank_chunks(model: ModelSpec, cfg: ParallelConfig, stage: int) -> list[tuple[Layer, ...]]:
    """The model chunks of pipeline rank `stage`: virtual stages c * pp + stage."""
    v = cfg.virtual_stages
    split = StageSplit.of(cfg)
    return [stage_layers(model, cfg.pp * v, c * cfg.pp + stage, split) for c in range(v)]


def rank_layers(model: ModelSpec, cfg: ParallelConfig, stage: int) -> tuple[Layer, ...]:
    return tuple(x for chunk in rank_chunks(model, cfg, stage) for x in chunk)


@dataclass(frozen=True)
class Passes:
    """A layer's kernels: its forward, what backward replays first, and its backward."""

    forward: tuple[ComputeOp, ...]
    replay: tuple[ComputeOp, ...]
    backward: tuple[ComputeOp, ...]


@cache
def layer_passes(model: ModelSpec, cfg: ParallelConfig, layer: Layer) -> Passes:
    fwd = forward_ops(model, layer, Shard.of(cfg))
    replay: tuple[ComputeOp, ...] = ()
    if cfg.recompute is Recompute.FULL and layer.kind in RECOMPUTED:
        replay = fwd
    elif cfg.recompute is Recompute.SELECTIVE and layer.kind is LayerKind.BLOCK:
        replay = tuple(op for op in fwd if op.name in SELECTIVE_OPS)
    elif cfg.recompute is Recompute.SELECTIVE_OP and layer.kind is LayerKind.BLOCK:
        replay = sac_replay(model, Shard.of(cfg))
    elif cfg.recompute is Recompute.SELECTIVE_LAYER and layer in layer_ac_blocks(model):
        replay = fwd
    return Passes(fwd, replay, backward_ops(tuple(reversed(fwd))))


LAYER_AC_EVERY = 2
"""torchtitan's selective layer AC checkpoints every this-many-th block: its
`selective_ac_option` default "2" (`torchtitan/config_manager.py`, 395a526)."""


def layer_ac_checkpoints(count: int) -> bool:
    """Whether torchtitan's layer AC checkpoints the block it counts `count`:
    `checkpoint_wrapper` counts the blocks from 1 as it wraps them in order and checkpoints a
    block whose count is a multiple of the option (`parallelize_llama.py`); the others keep
    every activation."""
    return count % LAYER_AC_EVERY == 0


@cache
def layer_ac_blocks(model: ModelSpec) -> frozenset[Layer]:
    """The blocks torchtitan's layer AC wraps (one pipeline stage: in model order)."""
    blocks = [x for x in model.layer_list() if x.kind is LayerKind.BLOCK]
    return frozenset(b for i, b in enumerate(blocks, start=1) if layer_ac_checkpoints(i))


def check_split(model: ModelSpec, cfg: ParallelConfig) -> None:
    """Refuse splits DeepSpeed cannot run: a "type:" method finds no transformer layer in a
    model without blocks, and Megatron-DeepSpeed's pipeline "fails unless each stage has at
    least one transformer layer" (its GPTModelPipe's comment)."""
    split = StageSplit.of(cfg)
    if cfg.pp == 1 or split.method is PartitionMethod.UNIFORM:
        return
    typed = split.method is not PartitionMethod.PARAMETERS
    allowed = "uniform or parameters for a model without transformer blocks"
    require(
        not typed or model.kind is ModelKind.TRANSFORMER, "pp_partition", str(split.method), allowed
    )
    for stage in range(cfg.pp):
        held = stage_layers(model, cfg.pp, stage, split)
        if not any(x.kind in RECOMPUTED for x in held):
            raise InputError(
                "pp_partition",
                f"{split.method} ({split.balancer})",
                f"a split that leaves each stage a block (stage {stage} holds none)",
            )


def stage_blocks(model: ModelSpec, cfg: ParallelConfig) -> tuple[int, ...]:
    """The blocks each pipeline rank holds (DeepSpeed prints the same at start-up)."""
    return tuple(
        sum(x.kind in RECOMPUTED for x in rank_layers(model, cfg, stage)) for stage in range(cfg.pp)
    )
