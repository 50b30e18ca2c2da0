"""Megatron-Core's context parallelism: the sequence split over `cp` ranks.

Megatron-Core (`--context-parallel-size`) hands each of the cp ranks of a group two of the
sequence's 2 x cp equal chunks, i and 2 cp - 1 - i, so that under the causal mask every rank
attends to as much as every other (`get_batch_on_this_cp_rank`, megatron/training/utils.py).
Every other op sees s / cp tokens. Attention runs in TransformerEngine's
`AttnFuncWithCPAndKVP2P` (transformer_engine/pytorch/attention.py): cp steps per layer; step 0
attends the rank's queries to its own keys and values (causal, s / cp long), each later step
to the keys and values received from the previous rank of the ring, of which the mask leaves
half: all queries against the first half of an earlier rank's chunks, or the second half of
the queries against all of a later rank's. So a rank does 1 / cp of the causal attention's
FLOPs. Before each step the next step's keys and values are sent to the next rank and received
from the previous one, on a stream of their own, beside the step's attention; the backward
sends the keys and values and their gradients the same way. Each step's partial output (and in
the backward its q, k, v gradients) is merged into the rank's result (`merge_bytes`).

The ranks of a context-parallel group share their parameters: Megatron reduces gradients and
shards its distributed optimizer over data x context parallel ranks
(`get_data_parallel_group(with_context_parallel=True)`), its rank order `tp-cp-dp-pp` puts a
group's ranks next to each other after TP. zsim so lays a cp x dp job out as dp x cp
data-parallel ranks whose consecutive blocks of cp are the context-parallel groups.
"""

from __future__ import annotations

from zsim.errors import require
from zsim.workload.model import AttentionKernel, AttentionShape, ComputeOp, ModelSpec, OpKind


def check_model(model: ModelSpec, cp: int) -> None:
    """The sequence must split into 2 x cp equal chunks."""
    if cp > 1:
        fits = model.seq_len % (2 * cp) == 0
        allowed = f"one with seq_len={model.seq_len} a multiple of 2 x cp (2 x cp equal chunks)"
        require(fits, "cp", cp, allowed)


def kv_exchange_bytes(model: ModelSpec, micro_batch: int, tp: int, cp: int, dtype: int) -> float:
    """One ring step's message in the forward: the rank's keys and values, (s / cp) tokens of
    kv_heads / tp heads each (the backward sends these and their gradients, twice as much)."""
    tokens = micro_batch * model.seq_len / cp
    return 2.0 * tokens * model.n_kv_heads * model.head_dim / tp * dtype


COPY_BYTES, ADD_BYTES = 4.0, 6.0
"""Bytes an element of a bf16 copy (read, write) and of an in-place add (two reads, a write)."""


def merge_bytes(elements: float, cp: int) -> float:
    """TE's merging of cp steps' partial results into one tensor of `elements` (bf16): the
    first step's copied (`flash_attn_fwd_out_correction_init`; `dq.copy_`), each later one's
    added (`flash_attn_fwd_out_correction`; `dq.add_`, `dk.add_`, `dv.add_`), on the slowest
    rank of the ring (the last: every step merges whole, not half)."""
    return elements * (COPY_BYTES + ADD_BYTES * (cp - 1))


def attention_ops(
    b: int, s: int, heads: int, kv_heads: float, hd: int, cp: int, d: int, kernel: AttentionKernel
) -> list[ComputeOp]:
    """A rank's fused attention over its `s` tokens (a shard's heads): one kernel, or TE's cp
    steps, its own chunks under the causal mask, then half of each other rank's keys without
    it, at the rate of the rank's s tokens (the figures' shapes are square, a ring step's
    s x s / 2), and the merging of their results."""

    def flash(name: str, keys: int, causal: bool) -> ComputeOp:
        flops = 4.0 * b * heads * s * keys * hd  # as if unmasked (model FLOPs)
        moved = 2.0 * b * heads * hd * (s + keys) * d  # q, k, v read, the output written
        shape = AttentionShape(s, hd, causal, kernel=kernel)
        return ComputeOp(name, OpKind.ATTENTION, flops, moved, attention=shape)

    ops = [flash("flash_attention", s, True)]
    if cp == 1:
        return ops
    ops += [flash(f"cp_attention_{i}", s // 2, False) for i in range(1, cp)]
    q, kv = b * s * heads * hd, 2 * b * s * kv_heads * hd
    grad = (merge_bytes(q + kv, cp) * d / 2, 3 * cp)
    moved = merge_bytes(q, cp) * d / 2
    return [*ops, ComputeOp("cp_merge", OpKind.MEMORY, 0.0, moved, kernels=cp, grad=grad)]
