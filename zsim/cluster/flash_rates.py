"""Fused attention kernels' speed by mask, head dimension and sequence length.

A GPU preset's attention rate is one measurement: FlashAttention-2, forward + backward,
without a causal mask, at one head dimension and sequence length (the Azure guide's row).
Training runs causal attention, at other shapes, and some with other kernels. The
flash-attention README's benchmark figures (Dao-AILab/flash-attention `assets/
flash2_a100_fwd_bwd_benchmark.png`, `flash2_h100_fwd_bwd_benchmark.png`; the
FlashAttention-2 paper's figures 4-5) print each kernel's forward + backward TFLOP/s on its
bars at batch 16k / seqlen, hidden 2,048, counting a causal pass as half the FLOPs. A pass of
another shape, mask or kernel takes the preset's time scaled by the ratio of those rates
(`docs/constants.md`); the A100 figure's "FlashAttention Triton" is the kernel llm-foundry
vendored (`attn_impl: triton`). The H100 figure has no Triton kernel.

Forward and backward apart: the FlashAttention-3 paper's forward figure (Shah et al. 2024,
the same repository's `assets/flash3_fp16_fwd.png`; same batch x seqlen 16k, hidden 2,048)
prints FlashAttention-2's forward-only rate on the H100 SXM5 at the same shapes and masks.
Its backward rate is what the two figures leave: a forward + backward of F FLOPs forward takes
3.5 F / fwd_bwd = F / fwd + 2.5 F / bwd. Where no forward figure exists (the A100, the Triton
kernel) both passes take the forward + backward rate.
"""

from __future__ import annotations

import math
from functools import lru_cache

from zsim.errors import InputError
from zsim.workload.model import AttentionShape

SEQ_POINTS = (512, 1024, 2048, 4096, 8192, 16384)
Figure = dict[tuple[str, str, bool, int], tuple[float, ...]]
"""(GPU family, kernel, causal, head dim) -> TFLOP/s at SEQ_POINTS, read off a figure."""

# forward + backward (A100 FA2 non-causal 128 at 512: the bar's height, its label hidden by
# the legend)
FWD_BWD_TFLOPS: Figure = {
    ("a100", "flash2", False, 64): (132, 153, 162, 171, 175, 176),
    ("a100", "flash2", False, 128): (151, 173, 187, 196, 201, 203),
    ("a100", "flash2", True, 64): (88, 119, 140, 156, 165, 171),
    ("a100", "flash2", True, 128): (99, 133, 155, 173, 182, 189),
    ("a100", "triton", False, 64): (90, 102, 98, 98, 100, 100),
    ("a100", "triton", False, 128): (78, 85, 90, 93, 95, 95),
    ("a100", "triton", True, 64): (59, 75, 79, 76, 79, 80),
    ("a100", "triton", True, 128): (50, 61, 68, 74, 78, 80),
    ("h100", "flash2", False, 64): (215, 254, 274, 288, 294, 296),
    ("h100", "flash2", False, 128): (248, 294, 320, 326, 335, 338),
    ("h100", "flash2", True, 64): (141, 192, 232, 257, 273, 284),
    ("h100", "flash2", True, 128): (163, 221, 265, 294, 308, 328),
}
# FlashAttention-2 forward only, H100 SXM5 (the FA3 paper's forward figure, panels a-d)
FWD_TFLOPS: Figure = {
    ("h100", "flash2", False, 64): (282, 306, 318, 321, 322, 324),
    ("h100", "flash2", False, 128): (309, 350, 362, 368, 370, 370),
    ("h100", "flash2", True, 64): (180, 229, 262, 284, 295, 299),
    ("h100", "flash2", True, 128): (191, 260, 298, 319, 333, 335),
}
HEAD_DIMS = (64, 128)


FAMILIES = {"a100": "a100", "h100": "h100", "h200": "h100"}
"""The figure each GPU takes: the H200 is the H100 SXM5's GH100 die with HBM3e."""


def family_of(gpu_match: str) -> str:
    """The figure a GPU's rates come from ("" where none: its rate is used as measured)."""
    text = gpu_match.lower()
    return next((f for name, f in FAMILIES.items() if name in text), "")


def _interpolate(table: Figure, key: tuple[str, str, bool], head_dim: int, seq: int) -> float:
    """Between a figure's points: linear in log2 of the sequence and in the head dimension,
    held at the ends (the rates level off)."""
    rows = [table[(*key, d)] for d in HEAD_DIMS]
    x = min(max(math.log2(seq / SEQ_POINTS[0]), 0.0), len(SEQ_POINTS) - 1.0)
    i = min(int(x), len(SEQ_POINTS) - 2)
    at_seq = [row[i] + (row[i + 1] - row[i]) * (x - i) for row in rows]
    w = min(max((head_dim - HEAD_DIMS[0]) / (HEAD_DIMS[1] - HEAD_DIMS[0]), 0.0), 1.0)
    return at_seq[0] + (at_seq[1] - at_seq[0]) * w


def figure_tflops(family: str, kernel: str, causal: bool, head_dim: int, seq: int) -> float:
    """A kernel's forward + backward rate at a shape."""
    if any((family, kernel, causal, d) not in FWD_BWD_TFLOPS for d in HEAD_DIMS):
        kernels = sorted({k for f, k, _, _ in FWD_BWD_TFLOPS if f == family})
        allowed = f"one with a rate on {family}: {', '.join(kernels)}"
        raise InputError("attention_kernel", str(kernel), allowed)
    return _interpolate(FWD_BWD_TFLOPS, (family, kernel, causal), head_dim, seq)


def pass_tflops(family: str, shape: AttentionShape) -> float:
    """The rate of one pass: the forward figure's, or the backward's from the two figures;
    the forward + backward rate where there is no forward figure."""
    key = (family, str(shape.kernel), shape.causal)
    both = figure_tflops(*key, shape.head_dim, shape.seq)
    if (*key, HEAD_DIMS[0]) not in FWD_TFLOPS:
        return both
    forward = _interpolate(FWD_TFLOPS, key, shape.head_dim, shape.seq)
    return 2.5 / (3.5 / both - 1.0 / forward) if shape.backward else forward


@lru_cache(maxsize=4096)  # a step asks for the same few shapes many times
def time_scale(family: str, anchor: tuple[int, int], shape: AttentionShape) -> float:
    """A pass's time over the time the preset's rate gives its non-causal FLOPs: half the
    FLOPs when causal, at the figures' rate for its pass, kernel and shape over the anchor's
    forward + backward rate (the shape the preset's rate was measured at: FlashAttention-2,
    non-causal, both passes)."""
    measured = figure_tflops(family, "flash2", False, *anchor)
    return (0.5 if shape.causal else 1.0) * measured / pass_tflops(family, shape)
