"""Megatron's tensor parallelism: where a layer communicates, and how much.

Forward: row-parallel outputs (proj, fc2) are all-reduced (reduce-scattered with sequence
parallelism), the vocab-parallel embedding output too; the vocab-parallel cross-entropy
all-reduces three fp32 values per token after the logits. Backward: the input gradients of
column-parallel GEMMs (qkv, fc1, logits) are all-reduced, overlapped with the weight-gradient
GEMM that follows (Megatron-LM's `--async-tensor-model-parallel-allreduce`, since cf7efd4,
2021-08-30). Before it, and in BigScience's Megatron-DeepSpeed (BLOOM), the all-reduce is the
backward of `copy_to_tensor_model_parallel_region`, an autograd node after the linear's: a
blocking call after both GEMMs (`async_tp_allreduce` False). With sequence parallelism the
inputs of column-parallel GEMMs are all-gathered first (Korthikanti et al. 2022, section
4.2.2), and gathered again in the backward for the weight gradient, beside the input-gradient
GEMM (Megatron-Core
`LinearWithGradAccumulationAndAsyncCommunication.backward`: an async all-gather, waited for
after the dgrad GEMM is issued).

With `--tp-comm-overlap` (Megatron-Core on TransformerEngine's userbuffers, sequence parallel
only) the block's collectives overlap its GEMMs by TE's default methods
(`transformer_engine/pytorch/module/base.py` `initialize_ub`, NVIDIA/TransformerEngine
d0067d0): "ring_exchange" for the all-gathers before qkv and fc1 and before the dgrad GEMMs of
proj and fc2 (tp splits: each chunk's GEMM runs while the next chunk arrives, so the last
chunk's GEMM waits for the whole gather); "pipeline" for the reduce-scatters after proj and
fc2 (4 splits: a chunk is reduce-scattered while the next is computed); "bulk" for the
backward's input gather and dgrad reduce-scatter (beside the other GEMM, as without it).
The SMs TE's kernels take from the GEMMs beside them: `zsim.workload.te_overlap`.
"""

from __future__ import annotations

from zsim.network.collective import CollectiveOp
from zsim.workload.cross_entropy import megatron_model
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
    """Each TP collective's buffer (nccl-tests' size): the whole activation, b s h elements
    (of the rank's s / cp tokens with context parallelism)."""
    return float(cfg.micro_batch * model.seq_len / cfg.cp * model.hidden * cfg.precision.bytes)


CROSS_ENTROPY_ALL_REDUCES = 3
"""Megatron's vocab-parallel cross-entropy (`tensor_parallel/cross_entropy.py`,
`_VocabParallelCrossEntropy.forward`) all-reduces over the TP group the logits' row maximum
(MAX), the target's logit and the exponentials' sum (SUM): three blocking calls after the
logits GEMM, none in its backward."""


def cross_entropy_bytes(model: ModelSpec, cfg: ParallelConfig) -> float:
    """Each of the cross-entropy's all-reduces: one fp32 value per token of the micro-batch
    (the whole sequence: the logits are computed on it with sequence parallelism too; the
    rank's s / cp tokens with context parallelism)."""
    return float(cfg.micro_batch * model.seq_len / cfg.cp * 4)


RING_EXCHANGED_AFTER = frozenset({"ln1", "ln2", "residual2_bwd", "residual1_bwd"})
"""All-gather points whose next GEMM (qkv, fc1, fc2_dgrad, proj_dgrad) TE ring-exchanges."""

PIPELINED = frozenset({"proj", "fc2"})
"""Forward GEMMs whose reduce-scatter TE pipelines with them."""

PIPELINE_SPLITS = 4
"""TE's `num_splits` for the "pipeline" method (tp for "ring_exchange")."""


def gathered_before(cfg: ParallelConfig, forward: bool) -> frozenset[str]:
    """Backward ops that first all-gather their gradient with sequence parallelism: the
    embedding's, whose forward reduce-scattered its output into the sequence-parallel region
    (`reduce_scatter_to_sequence_parallel_region`; its backward gathers)."""
    if forward or cfg.tp == 1 or not cfg.sequence_parallel:
        return frozenset()
    return frozenset({"embedding_lookup_bwd"})


def regathered(cfg: ParallelConfig, forward: bool) -> frozenset[str]:
    """Backward dgrad GEMMs beside which sequence parallelism re-gathers the layer input."""
    if forward or cfg.tp == 1 or not cfg.sequence_parallel:
        return frozenset()
    return frozenset({"qkv_dgrad", "fc1_dgrad", "logits_dgrad"})


def pass_key(c: ParallelConfig) -> tuple[object, ...]:
    """What a layer's pass time depends on (the planner keeps its templates by it)."""
    tensor_parallel = (c.tp, c.sequence_parallel, c.async_tp_allreduce)
    overlap = (c.tp_comm_overlap, c.tp_overlap_sms)
    kernels = (c.flash_attention, c.attention_kernel, c.elementwise, megatron_model(c))  # loss
    return (*tensor_parallel, *overlap, c.micro_batch, c.recompute, *kernels, c.precision, c.cp)
