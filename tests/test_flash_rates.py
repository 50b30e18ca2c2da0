"""Fused attention's speed by mask, kernel and shape, against the flash-attention README's
benchmark figures (Dao-AILab/flash-attention `assets/flash2_a100_fwd_bwd_benchmark.png`,
`flash2_h100_fwd_bwd_benchmark.png`: forward + backward TFLOP/s printed on the bars, a causal
pass counted as half the FLOPs) and the Azure guide's FlashAttention-2 rows the presets take.
"""

import math

import pytest

from zsim.cli import main
from zsim.cluster.flash_rates import figure_tflops, time_scale
from zsim.errors import InputError
from zsim.inputs import presets
from zsim.workload.model import AttentionShape, OpKind
from zsim.workload.model_presets import preset
from zsim.workload.parallel import ParallelConfig
from zsim.workload.shapes import Shard, backward_ops, forward_ops


@pytest.mark.parametrize(
    ("gpu", "family", "anchor", "azure"),
    [("a100-80gb", "a100", (64, 8192), 179.5), ("h100-sxm", "h100", (128, 8192), 327.9)],
)
def test_the_presets_azure_rows_agree_with_the_figures(gpu, family, anchor, azure):
    """Two sources, one kernel and shape (non-causal FA2): within 3 %."""
    rates = presets.gpu(gpu).rates["bf16"]
    assert (rates.flash_family, rates.flash_anchor) == (family, anchor)
    assert figure_tflops(family, "flash2", False, *anchor) == pytest.approx(azure, rel=0.03)


def test_a_causal_pass_takes_half_the_flops_at_the_causal_rate():
    # A100, head dim 64, 8k: non-causal 175, causal 165 TFLOP/s (figure 4a, 4c)
    shape = AttentionShape(8192, 64, causal=True)
    assert time_scale("a100", (64, 8192), shape) == pytest.approx(0.5 * 175 / 165)
    assert time_scale("a100", (64, 8192), AttentionShape(8192, 64, causal=False)) == 1.0


def test_the_triton_kernel_at_2k_with_head_dim_128():
    # causal Triton 68 TFLOP/s (figure 4d) against the anchor's 175
    shape = AttentionShape(2048, 128, kernel="triton")
    assert time_scale("a100", (64, 8192), shape) == pytest.approx(0.5 * 175 / 68)


def test_between_the_figures_points_log2_of_the_sequence_and_linear_in_head_dim():
    # 3k lies log2(1.5) of the way from 2k to 4k; head dim 96 halfway from 64 to 128
    w = math.log2(1.5)
    at64 = 140 + (156 - 140) * w  # causal FA2 A100, head dim 64: 2k 140, 4k 156
    at128 = 155 + (173 - 155) * w  # head dim 128: 2k 155, 4k 173
    assert figure_tflops("a100", "flash2", True, 96, 3072) == pytest.approx((at64 + at128) / 2)
    assert figure_tflops("a100", "flash2", True, 128, 65536) == 189  # held at 16k's


def test_a_flash_attention_pass_costs_what_the_figure_says():
    model = preset("gpt-1.3b")  # 16 heads of 128, s 2048: causal FA2 155 TFLOP/s on A100
    op = next(
        x
        for x in forward_ops(model, model.layer_list()[1], Shard(1, flash_attention=True))
        if x.kind is OpKind.ATTENTION
    )
    rates = presets.gpu("a100-80gb").rates["fp16"]
    expected = rates.gemm_overhead_s + op.flops * (0.5 * 175 / 155) / rates.attention_flops_per_s
    assert rates.op_time_s(op) == pytest.approx(expected)


def test_the_triton_kernel_has_no_h100_rate():
    with pytest.raises(InputError, match="attention_kernel"):
        time_scale("h100", (128, 8192), AttentionShape(2048, 128, kernel="triton"))


def test_a_kernel_without_flash_attention_is_refused(capsys):
    with pytest.raises(InputError, match="attention_kernel"):
        ParallelConfig(attention_kernel="triton")
    assert main(["run", "--topology", "1x8-dgx-h100", "--flash-attention",
                 "--attention-kernel", "triton"]) == 2  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "attention_kernel='triton'" in err[0]


# The FlashAttention-3 paper's forward figure (flash-attention `assets/flash3_fp16_fwd.png`,
# H100 80GB SXM5): FlashAttention-2's forward-only TFLOP/s; with the README's forward +
# backward figure (figure 5) at the same shapes.
@pytest.mark.parametrize(
    ("causal", "head_dim", "seq", "forward", "both"),
    [
        (False, 64, 512, 282, 215),
        (False, 128, 4096, 368, 326),
        (True, 64, 16384, 299, 284),
        (True, 128, 2048, 298, 265),
    ],
)
def test_on_h100_each_pass_takes_its_own_figures_rate(causal, head_dim, seq, forward, both):
    """The forward at the forward figure's rate; forward and backward together at the
    forward + backward figure's (so the backward runs at what the two leave); 4 FLOPs per
    query, key and head dim forward, 2.5x that backward."""
    fwd = AttentionShape(seq, head_dim, causal)
    bwd = AttentionShape(seq, head_dim, causal, backward=True)
    anchor = figure_tflops("h100", "flash2", False, 128, 8192)  # the preset's shape: 335
    half = 0.5 if causal else 1.0
    assert time_scale("h100", (128, 8192), fwd) == pytest.approx(half * anchor / forward)
    together = time_scale("h100", (128, 8192), fwd) + 2.5 * time_scale("h100", (128, 8192), bwd)
    assert together == pytest.approx(3.5 * half * anchor / both)


def test_without_a_forward_figure_both_passes_take_the_combined_rate():
    """The A100 (and the Triton kernel): no forward-only figure in reach."""
    fwd = AttentionShape(4096, 128, True)
    bwd = AttentionShape(4096, 128, True, backward=True)
    assert time_scale("a100", (64, 8192), fwd) == time_scale("a100", (64, 8192), bwd)


def test_a_backward_pass_carries_its_shape_as_a_backward():
    model = preset("llama-7b")
    ops = forward_ops(model, model.layer_list()[1], Shard(1, flash_attention=True))
    (bwd,) = (op for op in backward_ops(ops) if op.kind is OpKind.ATTENTION)
    assert bwd.attention is not None
    assert bwd.attention.backward
