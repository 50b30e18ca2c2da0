"""Which layers a pipeline rank holds, and which kernels one layer runs in each pass.

Shared by the memory ledger, the schedule and the ZeRO-3 coordinator, so all three see the
same placement and the same recompute policy.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache, lru_cache

from zsim.workload.model import (
    WORD_EMBEDDING,
    ComputeOp,
    Layer,
    LayerKind,
    ModelKind,
    ModelSpec,
)
from zsim.workload.parallel import ParallelConfig, Recompute
from zsim.workload.shapes import Shard, backward_ops, forward_ops

RECOMPUTED = (LayerKind.BLOCK, LayerKind.LINEAR)  # what full recompute checkpoints
# selective recompute replays attention's core (Korthikanti et al. 2022, section 5)
SELECTIVE_OPS = ("attn_scores", "softmax_dropout", "attn_values")


@lru_cache(maxsize=8192)  # a planner asks for the same splits of one model thousands of times
def stage_layers(model: ModelSpec, stages: int, stage: int) -> tuple[Layer, ...]:
    """The modules of one (virtual) pipeline stage: blocks split evenly, embedding first,
    head last.

    With tied embeddings the last stage holds a copy of the word embedding for the output
    projection, as Megatron does (its gradient is all-reduced with the first stage's copy).
    """
    layers = model.layer_list()
    if stages == 1:
        return layers
    blocks = [x for x in layers if x.kind in (LayerKind.BLOCK, LayerKind.LINEAR)]
    first, last = uniform_bounds(len(blocks), stages, stage)
    chosen = list(blocks[first:last])
    if stage == 0:
        chosen = [x for x in layers if x.kind is LayerKind.EMBEDDING] + chosen
    if stage == stages - 1:
        chosen += [x for x in layers if x.kind is LayerKind.HEAD]
        if model.tied_embeddings and model.kind is ModelKind.TRANSFORMER:
            embedding = next(x for x in layers if x.kind is LayerKind.EMBEDDING)
            word = tuple(t for t in embedding.tensors if t.name == WORD_EMBEDDING)
            chosen.append(Layer("word_embedding_copy", LayerKind.TIED_COPY, word))
    return tuple(chosen)


def uniform_bounds(items: int, parts: int, part: int) -> tuple[int, int]:
    """[first, last) of `part` when `items` are split as evenly as possible, the first
    `items % parts` parts taking one more (DeepSpeed's `partition_uniform`)."""
    size, extra = divmod(items, parts)
    first = part * size + min(part, extra)
    return first, first + size + (1 if part < extra else 0)


def rank_chunks(model: ModelSpec, cfg: ParallelConfig, stage: int) -> list[tuple[Layer, ...]]:
    """The model chunks of pipeline rank `stage`: virtual stages c * pp + stage."""
    v = cfg.virtual_stages
    return [stage_layers(model, cfg.pp * v, c * cfg.pp + stage) for c in range(v)]


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
    return Passes(fwd, replay, backward_ops(tuple(reversed(fwd))))
