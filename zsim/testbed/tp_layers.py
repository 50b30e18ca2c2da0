"""Megatron-style tensor-parallel decoder layers on torch.distributed (needs torch).

One rank's shard of each layer, as Megatron-LM's `tensor_parallel/layers.py` splits it:
qkv and fc1 column-parallel (their input's gradient all-reduced in the backward while the
weight gradient is computed: Megatron-Core's `LinearWithGradAccumulationAndAsyncCommunication`
with `allreduce_dgrad`, tp > 1 and no sequence parallelism), proj and fc2 row-parallel (their
output all-reduced in the forward, `reduce_from_tensor_model_parallel_region`; the bias added
after the reduce, on every rank), the word embedding vocab-parallel (rows outside a rank's
range looked up as zero, the output all-reduced), the logits column-parallel over the
vocabulary (the same linear, its weight the embedding's rows) with Megatron's vocab-parallel
cross-entropy (`cross_entropy.py`: all-reduces of the row maximum, of the target's logit and
of the exponentials' sum, none in its backward). Norms, biases of row-parallel layers and
position embeddings are replicated. No sequence parallelism.

With `group=None` a shard runs with no collective at all: calibration times the compute of one
rank's shard alone, and the collectives are measured separately.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from zsim.testbed.attention import causal_attention
from zsim.workload.model import ModelSpec

Group = Any  # a torch.distributed process group, or None for a compute-only shard


def _all_reduce(x: torch.Tensor, group: Group, op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(x, op=op, group=group)
    return x


def _apply(function: type[torch.autograd.Function], *args: Any) -> torch.Tensor:
    """`Function.apply`, typed (torch leaves it untyped)."""
    out: torch.Tensor = function.apply(*args)  # type: ignore[no-untyped-call]
    return out


class _ColumnParallelLinear(torch.autograd.Function):
    """y = x W^T + b on a shard of W's rows; backward: the input gradient's all-reduce is
    issued asynchronously, the weight and bias gradients computed, then the all-reduce waited
    for (Megatron-Core `LinearWithGradAccumulationAndAsyncCommunication.backward`)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group: Group
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.has_bias = group, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, None]:
        x, weight = ctx.saved_tensors
        grad_input = grad.matmul(weight)
        handle = None
        if ctx.group is not None:
            handle = dist.all_reduce(grad_input, group=ctx.group, async_op=True)
        grad_2d, x_2d = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
        grad_weight = grad_2d.t().matmul(x_2d)
        grad_bias = grad_2d.sum(dim=0) if ctx.has_bias else None
        if handle is not None:
            handle.wait()
        return grad_input, grad_weight, grad_bias, None


def column_parallel(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group: Group
) -> torch.Tensor:
    return _apply(_ColumnParallelLinear, x, weight, bias, group)


class _ReduceFromTp(torch.autograd.Function):
    """The partial outputs all-reduced over the TP group; identity backward."""

    @staticmethod
    def forward(_ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        return _all_reduce(x.contiguous(), group)

    @staticmethod
    def backward(_ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def reduce_from_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group is None else _apply(_ReduceFromTp, x, group)


def vocab_range(vocab: int, tp: int, rank: int) -> tuple[int, int]:
    """A rank's rows of the vocabulary: ceil(vocab / tp) each, the last one short."""
    per = math.ceil(vocab / tp)
    return rank * per, min(vocab, (rank + 1) * per)


class TpBlock(nn.Module):
    """One rank's shard of a pre-LN GPT / Llama block (`torchmodels.Block` split by tp)."""

    def __init__(self, spec: ModelSpec, tp: int, group: Group, flash: bool = False) -> None:
        super().__init__()
        h, f, t = spec.hidden, spec.ffn_hidden, tp
        self.spec, self.tp, self.group, self.flash = spec, tp, group, flash
        norm = nn.RMSNorm if spec.rmsnorm else nn.LayerNorm
        self.heads, self.kv_heads = spec.heads // t, spec.n_kv_heads // t
        kv = self.kv_heads * spec.head_dim
        self.ln1 = norm(h)
        self.qkv = nn.Linear(h, h // t + 2 * kv, bias=spec.bias)
        self.proj = nn.Linear(h // t, h, bias=False)
        self.proj_bias = nn.Parameter(torch.zeros(h)) if spec.bias else None
        self.ln2 = norm(h)
        self.fc1 = nn.Linear(h, f * (2 if spec.gated_mlp else 1) // t, bias=spec.bias)
        self.fc2 = nn.Linear(f // t, h, bias=False)
        self.fc2_bias = nn.Parameter(torch.zeros(h)) if spec.bias else None
        self.p = 0.1 if spec.dropout else 0.0

    def _row(self, layer: nn.Linear, bias: nn.Parameter | None, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_tp(layer(x), self.group)
        return y if bias is None else y + bias

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        qkv = column_parallel(x, self.qkv.weight, self.qkv.bias, self.group)
        d = self.spec.head_dim
        y = causal_attention(qkv, self.heads, self.kv_heads, d, self.p, self.training, self.flash)
        return self._row(self.proj, self.proj_bias, y)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        y = column_parallel(x, self.fc1.weight, self.fc1.bias, self.group)
        if self.spec.gated_mlp:
            gate, up = y.chunk(2, dim=-1)
            y = F.silu(gate) * up
        else:
            y = F.gelu(y)
        return self._row(self.fc2, self.fc2_bias, y)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + F.dropout(self.attention(self.ln1(x)), self.p, self.training)
        return x + F.dropout(self.mlp(self.ln2(x)), self.p, self.training)


class TpEmbedding(nn.Module):
    """The vocab-parallel word embedding (Megatron's `VocabParallelEmbedding`)."""

    def __init__(self, spec: ModelSpec, tp: int, rank: int, group: Group) -> None:
        super().__init__()
        self.start, self.end = vocab_range(spec.vocab, tp, rank)
        self.group = group
        self.wte = nn.Embedding(math.ceil(spec.vocab / tp), spec.hidden)
        self.wpe = nn.Embedding(spec.seq_len, spec.hidden) if spec.learned_positions else None
        self.p = 0.1 if spec.dropout else 0.0

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        outside = (idx < self.start) | (idx >= self.end)
        local = (idx - self.start).masked_fill(outside, 0)
        x = self.wte(local).masked_fill(outside.unsqueeze(-1), 0.0)
        x = reduce_from_tp(x, self.group)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        return F.dropout(x, self.p, self.training)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Megatron's `_VocabParallelCrossEntropy`: three all-reduces forward, none backward."""

    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, target: torch.Tensor, start: int, group: Group
    ) -> torch.Tensor:
        logits = (
            logits - _all_reduce(logits.max(dim=-1).values, group, dist.ReduceOp.MAX)[..., None]
        )
        outside = (target < start) | (target >= start + logits.shape[-1])
        local = (target - start).masked_fill(outside, 0)
        predicted = logits.gather(-1, local[..., None])[..., 0].masked_fill(outside, 0.0)
        predicted = _all_reduce(predicted, group)
        exp = logits.exp()
        sum_exp = _all_reduce(exp.sum(dim=-1), group)
        softmax = exp.div_(sum_exp[..., None])
        ctx.save_for_backward(softmax, local, outside)
        return (sum_exp.log() - predicted).mean()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, local, outside = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, local[..., None], -(~outside).to(g.dtype)[..., None])
        return g * (grad / local.numel()), None, None, None


class TpHead(nn.Module):
    """Final norm, the logits against this rank's (tied) embedding rows, the vocab-parallel
    cross-entropy; forward returns the mean loss for (x, targets)."""

    def __init__(self, spec: ModelSpec, embedding: TpEmbedding, tp: int, group: Group) -> None:
        super().__init__()
        self.ln_f = (nn.RMSNorm if spec.rmsnorm else nn.LayerNorm)(spec.hidden)
        rows = math.ceil(spec.vocab / tp)
        self.lm_head = None if spec.tied_embeddings else nn.Linear(spec.hidden, rows, bias=False)
        self._tied = [embedding]  # a list so the tied module is not registered twice
        self.group = group

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        embedding = self._tied[0]
        weight = embedding.wte.weight if self.lm_head is None else self.lm_head.weight
        # the last rank's padding rows are no tokens: they stay out of the softmax
        rows = weight[: embedding.end - embedding.start]
        logits = column_parallel(self.ln_f(x), rows, None, self.group).float()
        return _apply(_VocabParallelCrossEntropy, logits, targets, embedding.start, self.group)


class TpDecoder(nn.Module):
    """One rank's shard of `torchmodels.Decoder`."""

    def __init__(self, spec: ModelSpec, tp: int, rank: int, group: Group) -> None:
        super().__init__()
        self.embedding = TpEmbedding(spec, tp, rank, group)
        self.blocks = nn.ModuleList(TpBlock(spec, tp, group) for _ in range(spec.layers))
        self.head = TpHead(spec, self.embedding, tp, group)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embedding(idx)
        for block in self.blocks:
            x = block(x)
        loss: torch.Tensor = self.head(x, targets)
        return loss
