"""Models of the network being trained: layers and parameter tensors, from the shapes a
Megatron-style implementation creates.

A model is a sequence of layers (embedding, transformer blocks, head; or plain linear layers for
the seeds' toy MLP). Its kernels, FLOPs and saved activations per micro-batch are in
`zsim.workload.shapes`; its presets in `zsim.workload.model_presets`. Every number is derived
from tensor shapes, so the tests can check them against published formulas (Narayanan et al.
2021 for FLOPs, Korthikanti et al. 2022 for activations) instead of against this code.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from enum import StrEnum

from zsim.errors import positive_int, require

WORD_EMBEDDING = "wte.weight"  # the word embedding's parameter, which a tied LM head reads


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
    """One parameter tensor; `tp_sharded` tensors are split across tensor-parallel ranks.
    `shape`: a matrix's (rows, columns) as torch holds it, unsharded; () for a vector."""

    name: str
    numel: int
    tp_sharded: bool
    shape: tuple[int, ...] = ()

    def per_rank(self, tp: int) -> int:
        """Elements one tensor-parallel rank holds (sharded tensors rounded up)."""
        return math.ceil(self.numel / tp) if self.tp_sharded else self.numel


class AttentionKernel(StrEnum):
    """The fused attention kernel a job runs (with flash attention)."""

    FLASH2 = "flash2"  # FlashAttention-2 (flash-attn, PyTorch SDPA's flash backend)
    TRITON = "triton"  # flash-attn's Triton kernel, llm-foundry's `attn_impl: triton`


@dataclass(frozen=True)
class AttentionShape:
    """What a fused attention kernel's speed depends on (zsim.cluster.flash_rates)."""

    seq: int
    head_dim: int
    causal: bool = True
    kernel: AttentionKernel = AttentionKernel.FLASH2
    backward: bool = False  # the backward pass (2.5x the forward's FLOPs)


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
    attention: AttentionShape | None = None  # a fused attention kernel's shape
    kernels: int = 1  # launches (a bandwidth-bound op run eagerly takes several)
    grad: tuple[float, int] | None = None  # its backward's bytes and kernels, where not 1.5x
    fp8: bool = False  # a GEMM TransformerEngine runs in FP8 (zsim.workload.fp8)


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
    rotary: bool = False  # RoPE (Su et al. 2021) on q and k in every block
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
        """The modules in forward order (built once per model)."""
        return _layers_of(self)

    def _build_layers(self) -> tuple[Layer, ...]:
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
        tensors = [ParamTensor("linear.weight", h * h, True, (h, h))]
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
        tensors = [ParamTensor(f"{name}.weight", n_in * n_out, True, (n_out, n_in))]
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
        v, h, s = self.vocab, self.hidden, self.seq_len
        tensors = [ParamTensor(WORD_EMBEDDING, v * h, True, (v, h))]
        if self.learned_positions:
            tensors.append(ParamTensor("wpe.weight", s * h, False, (s, h)))
        return Layer("embedding", LayerKind.EMBEDDING, tuple(tensors))

    def _head(self) -> Layer:
        tensors = self._norm("ln_f")
        if not self.tied_embeddings:
            shape = (self.vocab, self.hidden)
            tensors.append(ParamTensor("lm_head.weight", self.vocab * self.hidden, True, shape))
        return Layer("head", LayerKind.HEAD, tuple(tensors))


@functools.lru_cache(maxsize=64)  # a sweep asks for the same few models' layers many times
def _layers_of(model: ModelSpec) -> tuple[Layer, ...]:
    return model._build_layers()


def modules_of(module: str) -> tuple[str, ...]:
    return tuple(module.split(",")) if module else ()


def module_of(tensor: ParamTensor) -> str:
    """The submodule a parameter belongs to ("qkv" for "qkv.weight")."""
    return tensor.name.split(".")[0]
