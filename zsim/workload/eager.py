"""What a transformer block's bandwidth-bound ops cost when PyTorch runs them one op at a
time (eager), as torchtitan's Llama block writes them, against one kernel per chain of ops
(Megatron's and TransformerEngine's fused kernels, or torch.compile).

Each op is given by the bytes its kernels read plus write per element of the tensor it works
on, and how many kernels that takes, forward and backward: the ops the source calls (its
`RMSNorm`, `apply_rotary_emb`, `repeat_kv`, `FeedForward`'s `silu(w1(x)) * w3(x)`, one tensor
fed to separate linears) and the kernels autograd runs for their backward (PyTorch's
derivative formulas). `tests/test_eager_kernels.py` runs the same ops under a dispatch mode
that counts every kernel's tensors and checks these numbers against it, in bf16 and fp32.
A norm's weight, which does not scale with the tokens, is left out.
The attention output's `.transpose(1, 2).contiguous()` copies nothing: SDPA's flash kernel
returns a transposed view of a (batch, seq, heads, head_dim) buffer. A GPT-2 style block
(PyTorch's LayerNorm and GELU, one kernel each way; one fused qkv linear) costs the same eager
or fused.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

FP32 = 4  # bytes: the eager RMSNorm and RoPE compute in float32


class Elementwise(StrEnum):
    """How a job runs a block's bandwidth-bound ops."""

    FUSED = "fused"  # one kernel per chain: Megatron's fused kernels, TE, torch.compile
    EAGER = "eager"  # one kernel per PyTorch op (torchtitan without compile, norm_type rmsnorm)
    # eager, but the norm in one Triton kernel (torchtitan's norm_type fused_rmsnorm)
    EAGER_FUSED_NORM = "eager-fused-norm"

    @property
    def eager(self) -> bool:
        return self is not Elementwise.FUSED

    @property
    def eager_norm(self) -> bool:
        return self is Elementwise.EAGER


@dataclass(frozen=True)
class Kernels:
    """An op's bytes (read + written) per element and its kernel launches, both passes."""

    fwd_bytes: float
    fwd_kernels: int
    bwd_bytes: float
    bwd_kernels: int


def _cast(d: int) -> tuple[int, int]:
    """A `.float()` (or `.type_as(x)` back): bytes per element and kernels; none in fp32."""
    return (d + FP32, 1) if d != FP32 else (0, 0)


def rmsnorm(d: int) -> Kernels:
    """torchtitan's `RMSNorm`: `(x.float() * rsqrt(x.float().pow(2).mean(-1) + eps)).type_as(x)
    * weight`. Forward: the cast, pow, mean, mul, the cast back and the weight's mul (plus
    two kernels over one value per row). Backward: the weight's mul and its gradient (mul and
    sum), the cast, the two gradients of the normalising mul (mul; mul and sum), mean's
    expansion, pow's (pow, two muls), their sum, the cast back (plus three row-sized ones)."""
    c, k = _cast(d)
    fwd = 2 * c + 8 + 4 + 8 + 2 * d
    bwd = 3 * d + 2 * d + d + 2 * c + 12 + 8 + 4 + FP32 + 8 + 8 + 12 + 12
    return Kernels(fwd, 2 * k + 6, bwd, 2 * k + 14)


def rope(d: int, rows: int) -> Kernels:
    """torchtitan's `apply_rotary_emb`, per element of q or k: cast to fp32, multiply as complex
    numbers by the frequencies, cast back; its backward the same three and a copy of the
    frequencies' conjugate. The complex64 frequencies (4 bytes per element of one row of
    `head_dim`) are shared by the `rows` (sequences x heads) they multiply."""
    c, k = _cast(d)
    freqs = FP32 / rows
    return Kernels(2 * c + 8 + freqs, 2 * k + 1, 2 * c + 8 + 3 * freqs, 2 * k + 2)


def repeat_kv(d: int, n_rep: int) -> Kernels:
    """`repeat_kv` for grouped-query attention, per element of k or v: expand and reshape copy
    it `n_rep` times; its backward sums the copies."""
    moved = d * (1 + n_rep)
    return Kernels(moved, 1, moved, 1)


def gradient_sum(d: int, fan_out: int) -> Kernels:
    """A tensor read by `fan_out` separate linears (the norm's output by wq, wk, wv; by w1 and
    w3): nothing forward; backward autograd adds their input gradients, `fan_out - 1` adds."""
    return Kernels(0, 0, 3 * d * (fan_out - 1), fan_out - 1)


def swiglu(d: int) -> Kernels:
    """`silu(w1(x)) * w3(x)` per element of the hidden: silu and mul; backward two muls and
    silu's backward."""
    return Kernels(5 * d, 2, 9 * d, 3)


def fused_rope(d: int) -> Kernels:
    """One kernel that reads q (or k) and writes it rotated, forward and backward (TE's fused
    RoPE, or what torch.compile makes of the eager code)."""
    return Kernels(2 * d, 1, 2 * d, 1)
