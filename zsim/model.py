"""Models of the network being trained: parameters, FLOPs and activation bytes from tensor shapes.

A model is a sequence of layers (embedding, transformer blocks, head; or plain linear layers for
the seeds' toy MLP). Every number here is derived from the shapes of the tensors a Megatron-style
implementation creates, so the tests can check them against published formulas (Narayanan et al.
2021 for FLOPs, Korthikanti et al. 2022 for activations) instead of against this code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import StrEnum

from zsim.errors import InputError, positive_int, require


class ModelKind(StrEnum):
    TRANSFORMER = "transformer"  # GPT / Llama style decoder
    MLP = "mlp"  # a stack of Linear(width, width) layers (the seeds' toy model)
    PARAMS_ONLY = "params"  # only a parameter count: enough for the ledger of model states


class LayerKind(StrEnum):
    EMBEDDING = "embedding"
    BLOCK = "block"
    HEAD = "head"
    LINEAR = "linear"
    TIED_COPY = "tied_copy"  # the last pipeline stage's copy of a tied word embedding


class OpKind(StrEnum):
    GEMM = "gemm"  # dense matmul: compute-bound at large shapes
    ATTENTION = "attention"  # fused (flash) attention kernel
    MEMORY = "memory"  # norms, softmax, activations, dropout, residual adds: bandwidth-bound


@dataclass(frozen=True)
class ParamTensor:
    """One parameter tensor; `tp_sharded` tensors are split across tensor-parallel ranks."""

    name: str
    numel: int
    tp_sharded: bool

    def per_rank(self, tp: int) -> int:
        """Elements one tensor-parallel rank holds (sharded tensors rounded up)."""
        return math.ceil(self.numel / tp) if self.tp_sharded else self.numel


@dataclass(frozen=True)
class ComputeOp:
    """One kernel: FLOPs and bytes moved; GEMMs also carry (m, n, k) x batch for efficiency."""

    name: str
    kind: OpKind
    flops: float
    bytes_moved: float
    gemm_shape: tuple[int, int, int] = (0, 0, 0)
    gemm_batch: int = 1
    modules: tuple[str, ...] = ()  # submodules whose parameters it reads (ZeRO-3 gathers them)


@dataclass(frozen=True)
class Layer:
    """A module as ZeRO-3 sees it: the unit of parameter gathering and of pipeline assignment."""

    name: str
    kind: LayerKind
    tensors: tuple[ParamTensor, ...]

    def params(self, tp: int = 1) -> int:
        """Parameters held by one tensor-parallel rank (sharded tensors rounded up)."""
        return sum(t.per_rank(tp) for t in self.tensors)


@dataclass(frozen=True)
class ModelSpec:
    """A model's shape. For PARAMS_ONLY, only `params_override` is meaningful."""

    name: str
    kind: ModelKind
    layers: int
    hidden: int
    heads: int = 1
    ffn_hidden: int = 0
    seq_len: int = 1
    vocab: int = 0
    kv_heads: int = 0  # 0 means = heads (multi-head attention); fewer means GQA
    tied_embeddings: bool = True
    gated_mlp: bool = False  # SwiGLU (three matrices) instead of GeLU (two)
    rmsnorm: bool = False  # RMSNorm (weight only) instead of LayerNorm (weight and bias)
    bias: bool = True
    learned_positions: bool = True
    dropout: bool = True
    params_override: int = 0

    def __post_init__(self) -> None:
        if self.kind is ModelKind.PARAMS_ONLY:
            require(self.params_override > 0, "params", self.params_override, "a positive count")
            return
        for field in ("layers", "hidden", "heads", "seq_len"):
            positive_int(field, getattr(self, field))
        if self.kind is ModelKind.TRANSFORMER:
            positive_int("vocab", self.vocab)
            positive_int("ffn_hidden", self.ffn_hidden)
            require(
                self.hidden % self.heads == 0,
                "heads",
                self.heads,
                f"a divisor of hidden={self.hidden}",
            )
            require(
                self.heads % self.n_kv_heads == 0,
                "kv_heads",
                self.kv_heads,
                f"a divisor of heads={self.heads}",
            )

    @property
    def n_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    # ---- parameters -------------------------------------------------------------------------

    def layer_list(self) -> tuple[Layer, ...]:
        """The modules in forward order."""
        if self.kind is ModelKind.PARAMS_ONLY:
            return (
                Layer("params", LayerKind.LINEAR, (ParamTensor("w", self.params_override, True),)),
            )
        if self.kind is ModelKind.MLP:
            return tuple(self._linear_layer(i) for i in range(self.layers))
        blocks = tuple(self._block(i) for i in range(self.layers))
        return (self._embedding(), *blocks, self._head())

    def total_params(self) -> int:
        return sum(layer.params() for layer in self.layer_list())

    def _linear_layer(self, i: int) -> Layer:
        h = self.hidden
        tensors = [ParamTensor("linear.weight", h * h, True)]
        if self.bias:
            tensors.append(ParamTensor("linear.bias", h, True))
        return Layer(f"linear{i}", LayerKind.LINEAR, tuple(tensors))

    def _norm(self, name: str) -> list[ParamTensor]:
        h = self.hidden
        tensors = [ParamTensor(f"{name}.weight", h, False)]
        if not self.rmsnorm:
            tensors.append(ParamTensor(f"{name}.bias", h, False))
        return tensors

    def _dense(self, name: str, n_in: int, n_out: int, bias_sharded: bool) -> list[ParamTensor]:
        """A Megatron linear: column-parallel biases are sharded, row-parallel biases are not."""
        tensors = [ParamTensor(f"{name}.weight", n_in * n_out, True)]
        if self.bias:
            tensors.append(ParamTensor(f"{name}.bias", n_out, bias_sharded))
        return tensors

    def _block(self, i: int) -> Layer:
        h, f = self.hidden, self.ffn_hidden
        qkv_out = h + 2 * self.n_kv_heads * self.head_dim
        tensors = [
            *self._norm("ln1"),
            *self._dense("qkv", h, qkv_out, bias_sharded=True),
            *self._dense("proj", h, h, bias_sharded=False),
            *self._norm("ln2"),
            *self._dense("fc1", h, f * (2 if self.gated_mlp else 1), bias_sharded=True),
            *self._dense("fc2", f, h, bias_sharded=False),
        ]
        return Layer(f"block{i}", LayerKind.BLOCK, tuple(tensors))

    def _embedding(self) -> Layer:
        tensors = [ParamTensor("wte.weight", self.vocab * self.hidden, True)]
        if self.learned_positions:
            tensors.append(ParamTensor("wpe.weight", self.seq_len * self.hidden, False))
        return Layer("embedding", LayerKind.EMBEDDING, tuple(tensors))

    def _head(self) -> Layer:
        tensors = self._norm("ln_f")
        if not self.tied_embeddings:
            tensors.append(ParamTensor("lm_head.weight", self.vocab * self.hidden, True))
        return Layer("head", LayerKind.HEAD, tuple(tensors))

    # ---- compute ----------------------------------------------------------------------------

    def forward_ops(
        self,
        layer: Layer,
        micro_batch: int,
        tp: int = 1,
        seq_parallel: bool = False,
        flash_attention: bool = False,
        dtype_bytes: int = 2,
    ) -> tuple[ComputeOp, ...]:
        """The kernels of one layer's forward pass on one tensor-parallel rank."""
        shape = _Shape(self, micro_batch, tp, seq_parallel, dtype_bytes)
        if layer.kind is LayerKind.TIED_COPY:
            return ()  # used by the head's logits GEMM, which the head already counts
        if layer.kind is LayerKind.LINEAR:
            return shape.linear()
        if layer.kind is LayerKind.EMBEDDING:
            return shape.embedding()
        if layer.kind is LayerKind.HEAD:
            return shape.head()
        return shape.block(flash_attention)

    def backward_ops(self, forward: tuple[ComputeOp, ...]) -> tuple[ComputeOp, ...]:
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
                out.append(
                    replace(
                        op,
                        name=f"{op.name}_bwd",
                        flops=2.5 * op.flops,
                        bytes_moved=2.0 * op.bytes_moved,
                    )
                )
            else:
                out.append(replace(op, name=f"{op.name}_bwd", bytes_moved=1.5 * op.bytes_moved))
        return tuple(out)

    def forward_flops(self, micro_batch: int = 1) -> float:
        """Model FLOPs of one forward pass over `micro_batch` sequences (no TP, no recompute)."""
        return sum(
            op.flops for layer in self.layer_list() for op in self.forward_ops(layer, micro_batch)
        )

    def training_flops_per_token(self) -> float:
        """Model FLOPs per token of one training step: forward + backward (2x forward)."""
        return 3 * self.forward_flops(1) / self.seq_len

    # ---- activations ------------------------------------------------------------------------

    def saved_tensors(
        self,
        layer: Layer,
        micro_batch: int,
        tp: int = 1,
        seq_parallel: bool = False,
        flash_attention: bool = False,
        dtype_bytes: int = 2,
    ) -> dict[str, float]:
        """Bytes of each tensor one layer saves for backward, per micro-batch, on one TP rank."""
        shape = _Shape(self, micro_batch, tp, seq_parallel, dtype_bytes)
        return shape.saved(layer.kind, flash_attention)

    def activation_bytes(
        self,
        layer: Layer,
        micro_batch: int,
        tp: int = 1,
        seq_parallel: bool = False,
        flash_attention: bool = False,
        dtype_bytes: int = 2,
    ) -> int:
        """Bytes of tensors one layer saves for backward, per micro-batch, on one TP rank."""
        saved = self.saved_tensors(
            layer, micro_batch, tp, seq_parallel, flash_attention, dtype_bytes
        )
        return int(sum(saved.values()))

    def loss_saved_bytes(self, micro_batch: int, dtype_bytes: int = 2) -> int:
        """What the loss saves for backward, on the last pipeline stage: the seeds' MSE loss
        keeps its prediction and its target (cross-entropy's logits are the head's)."""
        if self.kind is not ModelKind.MLP:
            return 0
        shape = _Shape(self, micro_batch, 1, False, dtype_bytes)
        return int(2 * shape.tokens * self.hidden * dtype_bytes)

    def layer_input_bytes(
        self, micro_batch: int, tp: int = 1, seq_parallel: bool = False, dtype_bytes: int = 2
    ) -> int:
        """The one tensor a fully recomputed layer keeps: its input (also a pipeline message)."""
        shape = _Shape(self, micro_batch, tp, seq_parallel, dtype_bytes)
        return int(shape.tokens * self.hidden * dtype_bytes / shape.sp)


def _mods(module: str) -> tuple[str, ...]:
    return tuple(module.split(",")) if module else ()


def module_of(tensor: ParamTensor) -> str:
    """The submodule a parameter belongs to ("qkv" for "qkv.weight")."""
    return tensor.name.split(".")[0]


class _Shape:
    """Tensor shapes of one micro-batch on one TP rank; the single home of FLOP/byte formulas."""

    def __init__(self, model: ModelSpec, micro_batch: int, tp: int, sp: bool, dtype_bytes: int):
        self.m = model
        self.b = micro_batch
        self.s = model.seq_len
        self.tokens = micro_batch * model.seq_len
        self.tp = tp
        self.sp = tp if sp else 1  # sequence parallel splits the replicated sbh tensors by tp
        self.d = dtype_bytes

    def gemm(
        self, name: str, m: int, n: int, k: int, batch: int = 1, module: str = ""
    ) -> ComputeOp:
        """C[m,n] = A[m,k] B[k,n]: 2mnk FLOPs, reads A and B, writes C."""
        flops = 2.0 * m * n * k * batch
        moved = float(batch * (m * k + k * n + m * n) * self.d)
        return ComputeOp(name, OpKind.GEMM, flops, moved, (m, n, k), batch, _mods(module))

    def memory(
        self, name: str, elements: float, passes: float = 2.0, module: str = ""
    ) -> ComputeOp:
        """A bandwidth-bound kernel touching `elements` values `passes` times (read + write)."""
        return ComputeOp(
            name, OpKind.MEMORY, 0.0, elements * passes * self.d, modules=_mods(module)
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
            # cross-entropy on fp32 logits: softmax reads and writes the vocab-sized tensor
            ComputeOp("cross_entropy", OpKind.MEMORY, 0.0, 3.0 * self.tokens * v * 4),
        )

    def block(self, flash: bool) -> tuple[ComputeOp, ...]:
        m, t, tok = self.m, self.tp, self.tokens
        h, f, hd = m.hidden, m.ffn_hidden, m.head_dim
        heads = m.heads // t
        qkv_out = (h + 2 * m.n_kv_heads * hd) // t
        fc1_out = f * (2 if m.gated_mlp else 1) // t
        sbh_rep = tok * h / self.sp  # replicated across TP unless sequence parallel
        ops = [
            self.memory("ln1", sbh_rep, module="ln1"),
            self.gemm("qkv", tok, qkv_out, h, module="qkv"),
        ]
        if flash:
            ops.append(
                ComputeOp(
                    "flash_attention",
                    OpKind.ATTENTION,
                    4.0 * self.b * heads * self.s**2 * hd,
                    4.0 * tok * heads * hd * self.d,
                )
            )
        else:
            scores = self.b * heads * self.s * self.s
            ops += [
                self.gemm("attn_scores", self.s, self.s, hd, batch=self.b * heads),
                self.memory("softmax_dropout", scores, passes=3.0 if m.dropout else 2.0),
                self.gemm("attn_values", self.s, hd, self.s, batch=self.b * heads),
            ]
        ops += [
            self.gemm("proj", tok, h, h // t, module="proj"),
            self.memory("residual1", sbh_rep, passes=4.0 if m.dropout else 3.0),
            self.memory("ln2", sbh_rep, module="ln2"),
            self.gemm("fc1", tok, fc1_out, h, module="fc1"),
            self.memory("activation", tok * f / t, passes=3.0 if m.gated_mlp else 2.0),
            self.gemm("fc2", tok, h, f // t, module="fc2"),
            self.memory("residual2", sbh_rep, passes=4.0 if m.dropout else 3.0),
        ]
        return tuple(ops)

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


# ---- presets -------------------------------------------------------------------------------


def _gpt(name: str, layers: int, hidden: int, heads: int, seq_len: int = 2048) -> ModelSpec:
    """GPT-3 family shapes (Brown et al. 2020, table 2.1): GeLU MLP of 4h, tied embeddings."""
    return ModelSpec(
        name, ModelKind.TRANSFORMER, layers, hidden, heads, 4 * hidden, seq_len, vocab=50257
    )


def _llama(
    name: str,
    layers: int,
    hidden: int,
    heads: int,
    ffn: int,
    kv_heads: int = 0,
    seq_len: int = 2048,
) -> ModelSpec:
    """Llama shapes (Touvron et al. 2023): SwiGLU, RMSNorm, no biases, RoPE, untied head."""
    return ModelSpec(
        name,
        ModelKind.TRANSFORMER,
        layers,
        hidden,
        heads,
        ffn,
        seq_len,
        vocab=32000,
        kv_heads=kv_heads,
        tied_embeddings=False,
        gated_mlp=True,
        rmsnorm=True,
        bias=False,
        learned_positions=False,
        dropout=False,
    )


PRESETS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        _gpt("gpt-125m", 12, 768, 12),
        _gpt("gpt-350m", 24, 1024, 16),
        _gpt("gpt-760m", 24, 1536, 16),
        _gpt("gpt-1.3b", 24, 2048, 16),
        _gpt("gpt-2.7b", 32, 2560, 32),
        _gpt("gpt-6.7b", 32, 4096, 32),
        _gpt("gpt-13b", 40, 5120, 40),
        _gpt("gpt-30b", 48, 7168, 56),
        _gpt("gpt-175b", 96, 12288, 96),
        _llama("llama-7b", 32, 4096, 32, 11008),
        _llama("llama-13b", 40, 5120, 40, 13824),
        _llama("llama-70b", 80, 8192, 64, 28672, kv_heads=8, seq_len=4096),
        # The seeds' experiment: nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(8)])
        ModelSpec("toy-mlp", ModelKind.MLP, layers=8, hidden=4096),
    )
}


def preset(name: str) -> ModelSpec:
    if name not in PRESETS:
        raise InputError("model", name, "one of " + ", ".join(PRESETS))
    return PRESETS[name]


def from_params(params: float) -> ModelSpec:
    """A model known only by its parameter count (e.g. `--params 7.5e9`)."""
    require(
        isinstance(params, int | float) and params >= 1 and float(params).is_integer(),
        "params",
        params,
        "a positive whole number of parameters, e.g. 7.5e9",
    )
    return ModelSpec(
        f"{params:.3g}-params",
        ModelKind.PARAMS_ONLY,
        layers=1,
        hidden=1,
        params_override=int(params),
    )


def with_overrides(base: ModelSpec, **overrides: int) -> ModelSpec:
    """A preset with some shape fields replaced (ffn follows hidden unless given)."""
    given = {k: v for k, v in overrides.items() if v is not None}
    if "hidden" in given and "ffn_hidden" not in given and base.kind is ModelKind.TRANSFORMER:
        given["ffn_hidden"] = base.ffn_hidden * given["hidden"] // base.hidden
    name = base.name if not given else "custom"
    return replace(base, name=name, **given)  # type: ignore[arg-type]
