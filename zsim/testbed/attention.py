"""Causal self-attention from a fused qkv projection, shared by the whole model's blocks
(`torchmodels.Block`) and one rank's TP shard of them (`tp_layers.TpBlock`), which differ only
in how many heads they hold (needs torch)."""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F


def causal_attention(
    qkv: torch.Tensor,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dropout_p: float,
    training: bool,
    flash: bool,
) -> torch.Tensor:
    """[b, t, (heads + 2 kv_heads) head_dim] -> [b, t, heads head_dim]: grouped-query heads
    repeated to the query heads, then fused attention (`flash`) or written out (scores, causal
    mask, softmax, dropout, values), matching the op list of `ModelSpec.forward_ops`."""
    b, t, _ = qkv.shape
    kv = kv_heads * head_dim
    q, k, v = torch.split(qkv, [heads * head_dim, kv, kv], dim=-1)
    q = q.view(b, t, heads, head_dim).transpose(1, 2)
    k = k.view(b, t, kv_heads, head_dim).transpose(1, 2)
    v = v.view(b, t, kv_heads, head_dim).transpose(1, 2)
    if kv_heads != heads:
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
    if flash:
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout_p if training else 0.0, is_causal=True
        )
    else:
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(head_dim)
        mask = torch.ones(t, t, dtype=torch.bool, device=qkv.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
        y = F.dropout(scores.softmax(-1), dropout_p, training) @ v
    return y.transpose(1, 2).reshape(b, t, heads * head_dim)
