"""PyTorch modules built from a `ModelSpec`, for calibration and validation runs (needs torch).

The modules create exactly the parameter tensors `ModelSpec.layer_list()` describes (a test
checks the counts), so what is measured is what is simulated. Attention is written out (no
fused kernel) unless `flash` is set, matching the op list of `ModelSpec.forward_ops`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from zsim.testbed import tp_layers
from zsim.testbed.attention import causal_attention
from zsim.workload.model import LayerKind, ModelKind, ModelSpec


def flush_subnormals(device: str) -> None:
    """On a CPU rank, compute subnormal floats as zero (x86's FTZ/DAZ), as a GPU runs them at
    full speed. An Intel core takes a microcode assist per subnormal operand: the head's
    backward GEMMs, fed random hidden states, read 2.1-2.2 s with 20 % subnormal gradients
    where they take 46-54 ms flushed (512 x 8192 x 768, one thread, an Intel Xeon with AMX,
    2026-12-05); the AMD EPYC the earlier profiles ran on shows no such cost."""
    if device == "cpu":
        torch.set_flush_denormal(True)


class Block(nn.Module):
    """A pre-LN GPT block (GeLU MLP) or a Llama block (RMSNorm, SwiGLU, no biases)."""

    def __init__(self, spec: ModelSpec, flash: bool = False) -> None:
        super().__init__()
        h, f = spec.hidden, spec.ffn_hidden
        self.spec, self.flash = spec, flash
        norm = nn.RMSNorm if spec.rmsnorm else nn.LayerNorm
        self.ln1 = norm(h)
        self.qkv = nn.Linear(h, h + 2 * spec.n_kv_heads * spec.head_dim, bias=spec.bias)
        self.proj = nn.Linear(h, h, bias=spec.bias)
        self.ln2 = norm(h)
        self.fc1 = nn.Linear(h, f * (2 if spec.gated_mlp else 1), bias=spec.bias)
        self.fc2 = nn.Linear(f, h, bias=spec.bias)
        self.p = 0.1 if spec.dropout else 0.0

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        s = self.spec
        y = causal_attention(
            self.qkv(x), s.heads, s.n_kv_heads, s.head_dim, self.p, self.training, self.flash
        )
        return self.proj(y)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        if self.spec.gated_mlp:
            gate, up = self.fc1(x).chunk(2, dim=-1)
            return self.fc2(F.silu(gate) * up)
        return self.fc2(F.gelu(self.fc1(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + F.dropout(self.attention(self.ln1(x)), self.p, self.training)
        return x + F.dropout(self.mlp(self.ln2(x)), self.p, self.training)


class Embedding(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.wte = nn.Embedding(spec.vocab, spec.hidden)
        self.wpe = nn.Embedding(spec.seq_len, spec.hidden) if spec.learned_positions else None
        self.p = 0.1 if spec.dropout else 0.0

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        return F.dropout(x, self.p, self.training)


class Head(nn.Module):
    def __init__(self, spec: ModelSpec, embedding: Embedding) -> None:
        super().__init__()
        self.ln_f = (nn.RMSNorm if spec.rmsnorm else nn.LayerNorm)(spec.hidden)
        self.lm_head = (
            None if spec.tied_embeddings else nn.Linear(spec.hidden, spec.vocab, bias=False)
        )
        self._tied = [embedding]  # a list so the tied module is not registered twice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln_f(x)
        weight = self._tied[0].wte.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(x, weight).float()


class Decoder(nn.Module):
    """Embedding, blocks, head; forward returns the mean cross-entropy for (idx, targets)."""

    def __init__(self, spec: ModelSpec, flash: bool = False) -> None:
        super().__init__()
        self.embedding = Embedding(spec)
        self.blocks = nn.ModuleList(Block(spec, flash) for _ in range(spec.layers))
        self.head = Head(spec, self.embedding)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embedding(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class ToyMLP(nn.Module):
    """The seeds' Net: nn.Sequential(*[nn.Linear(d, d) for _ in range(layers)]), MSE loss."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        d = spec.hidden
        self.net = nn.Sequential(*[nn.Linear(d, d, bias=spec.bias) for _ in range(spec.layers)])

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.net(x), y)


def build(spec: ModelSpec, flash: bool = False) -> nn.Module:
    if spec.kind is ModelKind.MLP:
        return ToyMLP(spec)
    if spec.kind is ModelKind.TRANSFORMER:
        return Decoder(spec, flash)
    raise ValueError(f"{spec.name}: a model known only by its parameter count cannot be built")


def batch(
    spec: ModelSpec, micro_batch: int, dtype: torch.dtype = torch.float32, device: Any = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """A random (input, target) micro-batch of the right shapes."""
    if spec.kind is ModelKind.MLP:
        x = torch.randn(micro_batch, spec.hidden, dtype=dtype, device=device)
        return x, torch.randn_like(x)
    idx = torch.randint(0, spec.vocab, (micro_batch, spec.seq_len), device=device)
    return idx, torch.randint(0, spec.vocab, (micro_batch, spec.seq_len), device=device)


def layer_module(spec: ModelSpec, kind: LayerKind, flash: bool = False, tp: int = 1) -> nn.Module:
    """One layer of the model (at tp > 1 one rank's shard of it, compute only), as
    calibration times it."""
    if kind is LayerKind.LINEAR:
        return nn.Linear(spec.hidden, spec.hidden, bias=spec.bias)
    if kind is LayerKind.BLOCK:
        return Block(spec, flash) if tp == 1 else tp_layers.TpBlock(spec, tp, None, flash)
    if kind is LayerKind.EMBEDDING:
        return Embedding(spec)
    if kind is LayerKind.HEAD:
        return Head(spec, Embedding(spec))
    raise ValueError(f"no module for layer kind {kind}")


def embedding_shard(spec: ModelSpec, tp: int) -> nn.Module:
    """The embedding, or one rank's vocab-parallel shard of it (compute only)."""
    return Embedding(spec) if tp == 1 else tp_layers.TpEmbedding(spec, tp, 0, None)


def head_shard(
    spec: ModelSpec, tp: int
) -> tuple[nn.Module, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """The head with its tied embedding (a module holding both) and a closure computing the
    loss from (x, targets); at tp > 1 one rank's shard, compute only."""
    if tp > 1:
        shard = tp_layers.TpEmbedding(spec, tp, 0, None)
        tp_head = tp_layers.TpHead(spec, shard, tp, None)
        return nn.ModuleDict({"embedding": shard, "head": tp_head}), tp_head
    embedding = Embedding(spec)
    head = Head(spec, embedding)

    def loss(x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(head(x).flatten(0, 1), targets.flatten())

    return nn.ModuleDict({"embedding": embedding, "head": head}), loss
