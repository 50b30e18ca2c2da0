"""TransformerEngine's FP8 training as Megatron-Core runs it (`--fp8-format`, delayed scaling).

Under `fp8_autocast` TE's linear modules (Megatron-Core's `TELayerNormColumnParallelLinear`,
`TERowParallelLinear`: a block's qkv, proj, fc1 and fc2) run their three GEMMs in FP8; the
output layer (Megatron-Core's own `ColumnParallelLinear`), the attention kernel and every
bandwidth-bound op stay in bf16, as do the parameters, the gradients, the optimizer and the
activations zsim keeps. An FP8 GEMM is costed at the GPU's FP8 rate (its preset's FP8 peak x
the efficiency of the FP8 cuBLASLt rows on Hopper; a GPU without an FP8 peak refuses fp8).

Around each FP8 GEMM (transformer_engine/pytorch/module/linear.py, layernorm_linear.py): its
input is cast to FP8 in the forward and the gradient of its output in the backward, each with
its transpose, since Hopper's FP8 GEMMs take only the TN layout (`cast_transpose`,
transformer_engine/common/transpose/cast_transpose.cu): a pass reading 2 bytes and writing
1 + 1 an element. Each weight keeps an FP8 copy and its transpose (`Float8Tensor`), cast once
a step (Megatron passes `is_first_microbatch`, so TE reuses it over the micro-batches).

With sequence parallelism, the inputs of qkv and fc1 are cast on the rank's shard, before TE
gathers them. Not modelled: the casts TE fuses into the kernel before them (the norm's output
written in FP8 by LayerNormLinear, the activation's by LayerNormMLP): each cast here is a pass
of its own, an upper bound; those all-gathers moving FP8 (costed in bf16); the once-a-step
weight casts (a pass over the weights, small beside a step's GEMMs).

Delayed scaling's amax reductions (`amax_bytes`): TE reduces the amaxes of every FP8 tensor of
an `fp8_autocast` region across its group when the region ends (`quantization.py`
`autocast_exit` -> `reduce_and_update_fp8_tensors`: `torch.cat`, a blocking all-reduce MAX,
`fused_amax_and_scale_update_after_reduction`), and those of the backward once the region's
first module has run its backward (`linear.py`, `layernorm_linear.py`). Megatron-Core wraps each
model chunk's TransformerBlock in one region with delayed scaling, its default recipe
(`transformer_block.py`), over the tensor x data x context-parallel ranks of its pipeline stage
(`fp8_utils.get_fp8_context`: `get_amax_reduction_group(with_context_parallel=True)`): two
small blocking all-reduces per chunk and micro-batch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from zsim.workload.model import ComputeOp, Layer, LayerKind, OpKind

FP8_GEMMS = frozenset({"qkv", "proj", "fc1", "fc2"})
"""A block's GEMMs TE runs in FP8 (its linear modules; the logits' output layer is not one)."""

CAST_TRANSPOSE_BYTES = 4.0
"""Bytes a cast to FP8 with its transpose moves per element: bf16 read, FP8 and FP8^T written."""

FP8_WEIGHT_BYTES = 2.0
"""Bytes per parameter of TE's FP8 weight copy and its transpose, beside the bf16 parameter."""

AMAX_TENSORS = {True: 3, False: 2}
"""FP8 tensors a GEMM scales, forward (input, weight, output) and backward (the output's and
the input's gradients): TE `module/base.py` (`num_gemms * 3 if fwd else num_gemms * 2`)."""

AMAX_KERNELS = 2
"""Kernels around each reduction: the amaxes' `torch.cat` and the fused scale update."""


def around(gemm: ComputeOp, gathered: int = 1) -> list[ComputeOp]:
    """An FP8 GEMM between its casts: of its input before it (forward only) and of its output's
    gradient after it (backward only: reversed, it comes before the GEMM's own backward). An
    input sequence parallelism gathers from `gathered` ranks is cast on the rank's shard,
    before the gather (TE's LayerNormLinear)."""
    m, n, k = gemm.gemm_shape
    cast = CAST_TRANSPOSE_BYTES * m * k / gathered
    into = ComputeOp(f"{gemm.name}_cast_in", OpKind.MEMORY, 0.0, cast, grad=(0.0, 0))
    grad = (CAST_TRANSPOSE_BYTES * m * n, 1)
    out = ComputeOp(f"{gemm.name}_cast_grad", OpKind.MEMORY, 0.0, 0.0, kernels=0, grad=grad)
    return [into, replace(gemm, fp8=True), out]


def weight_params(layers: Iterable[Layer], tp: int) -> int:
    """Elements of the FP8 GEMMs' weights among `layers` on one TP rank (TE copies these)."""
    weights = {f"{name}.weight" for name in FP8_GEMMS}
    blocks = (x for x in layers if x.kind is LayerKind.BLOCK)
    return sum(t.per_rank(tp) for x in blocks for t in x.tensors if t.name in weights)


def amax_bytes(layers: Iterable[Layer], forward: bool) -> float:
    """The fp32 amaxes one FP8 region (a chunk's blocks) reduces after its forward or its
    backward: one per FP8 tensor of its GEMMs (0 without an FP8 GEMM)."""
    blocks = sum(1 for x in layers if x.kind is LayerKind.BLOCK)
    return 4.0 * AMAX_TENSORS[forward] * len(FP8_GEMMS) * blocks
