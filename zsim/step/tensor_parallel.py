"""Megatron's tensor parallelism: where a layer communicates, and how much.

Forward: row-parallel outputs (proj, fc2) are all-reduced (reduce-scattered with sequence
parallelism), the vocab-parallel embedding output too. Backward: the input gradients of
column-parallel GEMMs (qkv, fc1, logits) are all-reduced, overlapped with the weight-gradient
GEMM that follows. With sequence parallelism the inputs of column-parallel GEMMs are
all-gathered first (Korthikanti et al. 2022, section 4.2.2).
"""

from __future__ import annotations

from zsim.network.collective import CollectiveOp
from zsim.workload.model import ModelSpec
from zsim.workload.parallel import ParallelConfig


def tp_points(cfg: ParallelConfig, forward: bool) -> dict[str, CollectiveOp]:
    """The collective Megatron issues after each of these ops of a pass (none without TP)."""
    if cfg.tp == 1:
        return {}
    sp = cfg.sequence_parallel
    reduce = CollectiveOp.REDUCE_SCATTER if sp else CollectiveOp.ALL_REDUCE
    if forward:
        points = {"proj": reduce, "fc2": reduce, "embedding_lookup": reduce}
        if sp:
            points |= {
                "ln1": CollectiveOp.ALL_GATHER,
                "ln2": CollectiveOp.ALL_GATHER,
                "ln_f": CollectiveOp.ALL_GATHER,
            }
        return points
    points = {"qkv_dgrad": reduce, "fc1_dgrad": reduce, "logits_dgrad": reduce}
    if sp:
        points |= {
            "residual2_bwd": CollectiveOp.ALL_GATHER,
            "residual1_bwd": CollectiveOp.ALL_GATHER,
        }
    return points


def tp_bytes(model: ModelSpec, cfg: ParallelConfig) -> float:
    """Each TP collective's buffer (nccl-tests' size): the whole activation, b s h elements."""
    return float(cfg.micro_batch * model.seq_len * model.hidden * cfg.precision.bytes)
