"""What one micro-batch of a model costs on one rank: its kernels (FLOPs, bytes moved) and
the tensors it saves for backward, from tensor shapes; the single home of these formulas.

`Shard` is how much of a micro-batch one rank sees: its sequences, its tensor-parallel slice
(with or without sequence parallelism), the attention kernel and the element size.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from zsim.workload import context_parallel, eager, fp8
from zsim.workload.cross_entropy import megatron_loss_bytes, megatron_model
from zsim.workload.eager import Elementwise
from zsim.workload.mechanisms import Mechanism
from zsim.workload.model import (
    AttentionKernel,
    ComputeOp,
    Layer,
    LayerKind,
    ModelKind,
    ModelSpec,
    OpKind,
    modules_of,
)
from zsim.workload.parallel import ParallelConfig, Precision


@dataclass(frozen=True)
class Shard:
    """One rank's share of a micro-batch."""

    micro_batch: int
    tp: int = 1
    sequence_parallel: bool = False
    flash_attention: bool = False
    dtype_bytes: int = 2
    attention_kernel: AttentionKernel = AttentionKernel.FLASH2
    elementwise: Elementwise = Elementwise.FUSED
    cp: int = 1  # context-parallel ranks: this one sees s / cp tokens of each sequence
    fp8: bool = False  # the blocks' linears in FP8 (zsim.workload.fp8)
    megatron_loss: bool = False  # Megatron's cross-entropy passes (zsim.workload.cross_entropy)

    @classmethod
    def of(cls, cfg: ParallelConfig) -> Shard:
        """The shard every rank of a layout computes on."""
        fused = cfg.elementwise is Elementwise.FUSED or not cfg.models(Mechanism.EAGER_OPS)
        return cls(
            cfg.micro_batch,
            cfg.tp,
            cfg.sequence_parallel,
            cfg.flash_attention,
            cfg.precision.bytes,
            cfg.attention_kernel,
            Elementwise.FUSED if fused else cfg.elementwise,
            cfg.cp,
            cfg.precision is Precision.FP8,
            megatron_model(cfg),
        )


def forward_ops(model: ModelSpec, layer: Layer, shard: Shard) -> tuple[ComputeOp, ...]:
    """The kernels of one layer's forward pass on one tensor-parallel rank."""
    shape = _Shapes(model, shard)
    if layer.kind is LayerKind.TIED_COPY:
        return ()  # used by the head's logits GEMM, which the head already counts
    if layer.kind is LayerKind.LINEAR:
        return shape.linear()
    if layer.kind is LayerKind.EMBEDDING:
        return shape.embedding()
    if layer.kind is LayerKind.HEAD:
        return shape.head()
    return shape.block(shard.flash_attention)


def backward_ops(forward: tuple[ComputeOp, ...]) -> tuple[ComputeOp, ...]:
    """The kernels of the backward pass of `forward`.

    A GEMM C = AB has two backward GEMMs of the same FLOPs: dA = dC B^T and dB = A^T dC.
    Flash attention's backward does 5 matmuls to the forward's 2 (Dao 2023): 2.5x.
    A bandwidth-bound kernel reads the output gradient and its saved input and writes the
    input gradient: 3 tensors for the forward's 2, so 1.5x the bytes.
    """
    out: list[ComputeOp] = []
    for op in forward:
        if op.kind is OpKind.GEMM:
            m, n, k = op.gemm_shape
            out.append(replace(op, name=f"{op.name}_dgrad", gemm_shape=(m, k, n)))
            out.append(replace(op, name=f"{op.name}_wgrad", gemm_shape=(k, n, m)))
        elif op.kind is OpKind.ATTENTION:
            shape = op.attention and replace(op.attention, backward=True)
            out.append(
                replace(
                    op,
                    name=f"{op.name}_bwd",
                    flops=2.5 * op.flops,
                    bytes_moved=2.0 * op.bytes_moved,
                    attention=shape,
                )
            )
        elif op.grad is not None:  # an eager op's own backward kernels (zsim.workload.eager)
            moved, kernels = op.grad
            out.append(
                replace(op, name=f"{op.name}_bwd", bytes_moved=moved, kernels=kernels, grad=None)
            )
        else:
            out.append(replace(op, name=f"{op.name}_bwd", bytes_moved=1.5 * op.bytes_moved))
    return tuple(out)


def forward_flops(model: ModelSpec, micro_batch: int = 1) -> float:
    """Model FLOPs of one forward pass over `micro_batch` sequences (no TP, no recompute)."""
    shard = Shard(micro_batch)
    return sum(op.flops for layer in model.layer_list() for op in forward_ops(model, layer, shard))


def training_flops_per_token(model: ModelSpec) -> float:
    """Model FLOPs per token of one training step: forward + backward (2x forward)."""
    return 3 * forward_flops(model, 1) / model.seq_len


def saved_tensors(model: ModelSpec, layer: Layer, shard: Shard) -> dict[str, float]:
    """Bytes of each tensor one layer saves for backward, per micro-batch, on one TP rank."""
    return _Shapes(model, shard).saved(layer.kind, shard.flash_attention)


def activation_bytes(model: ModelSpec, layer: Layer, shard: Shard) -> int:
    """Bytes of tensors one layer saves for backward, per micro-batch, on one TP rank."""
    return int(sum(saved_tensors(model, layer, shard).values()))


def sac_replay(model: ModelSpec, shard: Shard) -> tuple[ComputeOp, ...]:
    """What a block replays in backward under torchtitan's op-level selective AC."""
    return _Shapes(model, shard).sac_replay()


def sac_kept_bytes(model: ModelSpec, shard: Shard) -> float:
    """Bytes a block keeps per micro-batch under torchtitan's op-level selective AC."""
    return _Shapes(model, shard).sac_kept()


def loss_saved_bytes(model: ModelSpec, micro_batch: int, dtype_bytes: int = 2) -> int:
    """What the loss saves for backward, on the last pipeline stage: the seeds' MSE loss
    keeps its prediction and its target (cross-entropy's logits are the head's)."""
    if model.kind is not ModelKind.MLP:
        return 0
    shape = _Shapes(model, Shard(micro_batch, dtype_bytes=dtype_bytes))
    return int(2 * shape.tokens * model.hidden * dtype_bytes)


def layer_input_bytes(model: ModelSpec, shard: Shard) -> int:
    """The one tensor a fully recomputed layer keeps: its input (also a pipeline message)."""
    shape = _Shapes(model, shard)
    return int(shape.tokens * model.hidden * shard.dtype_bytes / shape.sp)


class _Shapes:
    """Tensor shapes of one micro-batch on one TP rank; the single home of FLOP/byte formulas."""

    def __init__(self, model: ModelSpec, shard: Shard):
        self.m = model
        self.b = shard.micro_batch
        self.cp = shard.cp
        self.s = model.seq_len // shard.cp  # the rank's tokens of each sequence
        self.tokens = shard.micro_batch * self.s
        self.tp = shard.tp
        # sequence parallel splits the replicated sbh tensors by tp
        self.sp = shard.tp if shard.sequence_parallel else 1
        self.d = shard.dtype_bytes
        self.kernel = shard.attention_kernel
        self.fp8 = shard.fp8
        self.elementwise = shard.elementwise
        self.megatron_loss = shard.megatron_loss

    def gemm(
        self, name: str, m: int, n: int, k: int, batch: int = 1, module: str = ""
    ) -> ComputeOp:
        """C[m,n] = A[m,k] B[k,n]: 2mnk FLOPs, reads A and B, writes C."""
        flops = 2.0 * m * n * k * batch
        moved = float(batch * (m * k + k * n + m * n) * self.d)
        return ComputeOp(name, OpKind.GEMM, flops, moved, (m, n, k), batch, modules_of(module))

    def memory(
        self, name: str, elements: float, passes: float = 2.0, module: str = ""
    ) -> ComputeOp:
        """A bandwidth-bound kernel touching `elements` values `passes` times (read + write)."""
        return ComputeOp(
            name, OpKind.MEMORY, 0.0, elements * passes * self.d, modules=modules_of(module)
        )

    def linear(self) -> tuple[ComputeOp, ...]:
        h = self.m.hidden
        ops = [self.gemm("linear", self.tokens, h // self.tp, h, module="linear")]
        if self.m.bias:
            ops.append(self.memory("bias", self.tokens * h / self.tp, module="linear"))
        return tuple(ops)

    def embedding(self) -> tuple[ComputeOp, ...]:
        sbh = self.tokens * self.m.hidden
        return (
            self.memory(
                "embedding_lookup",
                sbh / self.sp,
                passes=3.0,
                module="wte,wpe" if self.m.learned_positions else "wte",
            ),
        )

    def head(self) -> tuple[ComputeOp, ...]:
        h, v = self.m.hidden, math.ceil(self.m.vocab / self.tp)
        sbh = self.tokens * h
        return (
            self.memory("ln_f", sbh / self.sp, module="ln_f"),
            self.gemm(
                "logits", self.tokens, v, h, module="wte" if self.m.tied_embeddings else "lm_head"
            ),
            self.loss(self.tokens * v),
        )

    def loss(self, logits: float) -> ComputeOp:
        """Cross-entropy over the rank's logits: Megatron's passes (`cross_entropy`), else one
        softmax pass reading and writing fp32 logits (3 x 4 bytes; its backward 1.5x that)."""
        op = ComputeOp("cross_entropy", OpKind.MEMORY, 0.0, 3.0 * logits * 4)
        if not self.megatron_loss:
            return op
        (fwd, kernels), (bwd, back) = megatron_loss_bytes(self.d)
        return replace(op, bytes_moved=fwd * logits, kernels=kernels, grad=(bwd * logits, back))

    def block(self, flash: bool) -> tuple[ComputeOp, ...]:
        m, t, tok = self.m, self.tp, self.tokens
        h, f, hd = m.hidden, m.ffn_hidden, m.head_dim
        heads = m.heads // t
        qkv_out = (h + 2 * m.n_kv_heads * hd) // t
        fc1_out = f * (2 if m.gated_mlp else 1) // t
        sbh_rep = tok * h / self.sp  # replicated across TP unless sequence parallel
        ops = [self.norm("ln1", sbh_rep), *self.linear_gemm("qkv", tok, qkv_out, h)]
        ops += self.rotary_and_repeat()
        if flash:
            ops += self.attention()
        else:
            scores = self.b * heads * self.s * self.s
            ops += [
                self.gemm("attn_scores", self.s, self.s, hd, batch=self.b * heads),
                self.memory("softmax_dropout", scores, passes=3.0 if m.dropout else 2.0),
                self.gemm("attn_values", self.s, hd, self.s, batch=self.b * heads),
            ]
        ops += [
            *self.linear_gemm("proj", tok, h, h // t),
            self.memory("residual1", sbh_rep, passes=4.0 if m.dropout else 3.0),
            self.norm("ln2", sbh_rep),
            *self.linear_gemm("fc1", tok, fc1_out, h),
            *self.activation(tok * f / t),
            *self.linear_gemm("fc2", tok, h, f // t),
            self.memory("residual2", sbh_rep, passes=4.0 if m.dropout else 3.0),
        ]
        return tuple(ops)

    def linear_gemm(self, name: str, m: int, n: int, k: int) -> list[ComputeOp]:
        """A block's linear: in FP8 between TE's casts (`zsim.workload.fp8.around`)."""
        gemm = self.gemm(name, m, n, k, module=name)
        gathered = self.sp if name in ("qkv", "fc1") else 1  # sequence parallel's inputs
        return fp8.around(gemm, gathered) if self.fp8 and name in fp8.FP8_GEMMS else [gemm]

    def attention(self) -> list[ComputeOp]:
        """Fused attention of the rank's queries: whole, or TE's context-parallel steps."""
        m = self.m
        shape = (self.b, self.s, m.heads // self.tp, m.n_kv_heads / self.tp, m.head_dim)
        return context_parallel.attention_ops(*shape, self.cp, self.d, self.kernel)

    def eager_op(
        self, name: str, elements: float, kernels: Callable[[int], eager.Kernels]
    ) -> ComputeOp:
        """A bandwidth-bound op with its own forward and backward kernels (zsim.workload.eager)."""
        k = kernels(self.d)
        grad = (elements * k.bwd_bytes, k.bwd_kernels)
        return ComputeOp(
            name, OpKind.MEMORY, 0.0, elements * k.fwd_bytes, kernels=k.fwd_kernels, grad=grad
        )

    def norm(self, name: str, elements: float) -> ComputeOp:
        """A norm; run eagerly, torchtitan's RMSNorm (PyTorch's LayerNorm is one kernel)."""
        if self.elementwise.eager_norm and self.m.rmsnorm:
            return replace(self.eager_op(name, elements, eager.rmsnorm), modules=modules_of(name))
        return self.memory(name, elements, module=name)

    def rotary_and_repeat(self) -> list[ComputeOp]:
        """RoPE on q and k; run eagerly, grouped-query attention's copies of k and v, and the
        sums of the gradients of the norm's output that reaches the separate wq, wk, wv."""
        m, tok, t = self.m, self.tokens, self.tp
        q, kv = tok * m.hidden / t, tok * m.n_kv_heads * m.head_dim / t
        ops = []
        rotated = (("q", q, m.heads), ("k", kv, m.n_kv_heads)) if m.rotary else ()
        for name, elements, heads in rotated:
            rows = max(1, self.b * heads // t)  # the rows that share RoPE's frequency table
            one_by_one = functools.partial(eager.rope, rows=rows)
            kernels = one_by_one if self.elementwise.eager else eager.fused_rope
            ops.append(self.eager_op(f"rope_{name}", elements, kernels))
        if not self.elementwise.eager:
            return ops
        n_rep = m.heads // m.n_kv_heads
        if n_rep > 1:
            repeat = functools.partial(eager.repeat_kv, n_rep=n_rep)
            ops += [self.eager_op(f"repeat_{x}", kv, repeat) for x in "kv"]
        if m.rotary:  # the Llama family's separate wq, wk, wv (GPT-2 style: one c_attn)
            adds = functools.partial(eager.gradient_sum, fan_out=3)
            ops.append(self.eager_op("qkv_input_grad_sum", tok * m.hidden / self.sp, adds))
        return ops

    def activation(self, elements: float) -> list[ComputeOp]:
        """The MLP's activation; run eagerly, SwiGLU's two ops and the sum of the gradients of
        the norm's output that reaches the separate w1 and w3."""
        if self.elementwise.eager and self.m.gated_mlp:
            adds = functools.partial(eager.gradient_sum, fan_out=2)
            return [
                self.eager_op("activation", elements, eager.swiglu),
                self.eager_op("fc1_input_grad_sum", self.tokens * self.m.hidden / self.sp, adds),
            ]
        return [self.memory("activation", elements, passes=3.0 if self.m.gated_mlp else 2.0)]

    def sac_linears(self) -> list[tuple[str, int, int]]:
        """A torchtitan block's matmuls in call order, (name, out, in) on one rank: wq, wk, wv
        (attention's projections, separate), wo, then w1, w3 (gated) and w2 (its Llama
        `FeedForward`: w2(silu(w1(x)) * w3(x)))."""
        m = self.m
        h, f, kv = m.hidden, m.ffn_hidden, m.n_kv_heads * m.head_dim
        mlp = [("w1", f, h)] + ([("w3", f, h)] if m.gated_mlp else []) + [("w2", h, f)]
        return [("wq", h, h), ("wk", kv, h), ("wv", kv, h), ("wo", h, h), *mlp]

    def sac_replay(self) -> tuple[ComputeOp, ...]:
        """torchtitan's op policy saves the outputs of mm, SDPA and reduce-scatter "except
        every second mm" of each block (its per-block count, from 1), so backward replays the
        even-numbered matmuls and every bandwidth-bound op, not the attention kernel."""
        replayed = [
            self.gemm(f"{name}_replay", self.tokens, out, k)
            for i, (name, out, k) in enumerate(self.sac_linears(), start=1)
            if i % 2 == 0
        ]
        memory = [op for op in self.block(True) if op.kind is OpKind.MEMORY]
        return (*replayed, *memory)

    def sac_kept(self) -> float:
        """The block's input (the checkpoint's) and the outputs its policy saves: the
        odd-numbered matmuls' and the attention kernel's (output and softmax statistics)."""
        m, tok, d = self.m, self.tokens, self.d
        kept = [out for i, (_, out, _) in enumerate(self.sac_linears(), start=1) if i % 2]
        block_input = attention_output = m.hidden
        stats = self.b * m.heads * self.s * 4.0  # fp32 logsumexp per head and query
        return tok * d * (block_input + sum(kept) + attention_output) + stats

    def saved(self, kind: LayerKind, flash: bool) -> dict[str, float]:
        """Tensors kept for backward, in bytes, named after what saves them.

        Follows the accounting of Korthikanti et al. 2022 (section 4.1): GEMM inputs, softmax
        output, dropout masks (1 byte/element), norm inputs, activation-function input.
        """
        m, d, tok, sp, t = self.m, self.d, self.tokens, self.sp, self.tp
        h = m.hidden
        sbh = tok * h
        if kind is LayerKind.TIED_COPY:
            return {}
        if kind is LayerKind.LINEAR:
            return {"linear_input": sbh * d}
        if kind is LayerKind.EMBEDDING:
            return {"embedding_dropout_mask": sbh / sp} if m.dropout else {}
        if kind is LayerKind.HEAD:
            v = math.ceil(m.vocab / t)
            return {
                "ln_f_input": sbh * d / sp,
                "logits_input": sbh * d / sp,
                "fp32_logits": tok * v * 4.0,
            }
        mask = 1.0 if m.dropout else 0.0
        kv_frac = m.n_kv_heads / m.heads
        heads = m.heads // t
        f_out = m.ffn_hidden * (2 if m.gated_mlp else 1)
        saved = {
            "ln1_input": sbh * d / sp,
            "qkv_input": sbh * d / sp,
            "q_k": sbh * d * (1 + kv_frac) / t,
            "v": sbh * d * kv_frac / t,
            "proj_input": sbh * d / t,
            "attn_dropout_mask": sbh * mask / sp,
            "ln2_input": sbh * d / sp,
            "fc1_input": sbh * d / sp,
            "activation_input": tok * f_out * d / t,
            "fc2_input": tok * m.ffn_hidden * d / t,
            "mlp_dropout_mask": sbh * mask / sp,
        }
        if flash:  # flash attention keeps its output and the softmax statistics, not s x s
            saved["attention_softmax_stats"] = self.b * heads * self.s * 4.0
        else:
            scores = self.b * heads * self.s * self.s
            saved["softmax_output"] = scores * d
            saved["softmax_dropout_mask"] = scores * mask
            if m.dropout:
                saved["dropped_softmax"] = scores * d
        return saved
