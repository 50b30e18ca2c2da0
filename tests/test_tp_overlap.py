"""Megatron's TP collectives beside the GEMMs, against the algorithms in its source: the
backward's re-gathered input with sequence parallelism (Megatron-Core
`LinearWithGradAccumulationAndAsyncCommunication.backward`) and TransformerEngine's default
userbuffer overlaps with --tp-comm-overlap (`module/base.py initialize_ub`: ring_exchange in tp
splits before qkv/fc1, pipeline in 4 splits after proj/fc2). Each pass time is worked by hand
from the ops' times, with collectives that take a time proportional to their bytes."""

from dataclasses import replace

import pytest

from zsim.inputs import presets
from zsim.simulation import simulate
from zsim.step.job import StageJob
from zsim.step.kernels import LayerKernels
from zsim.step.tensor_parallel import tp_bytes
from zsim.workload.layout import layer_passes
from zsim.workload.model_presets import preset
from zsim.workload.parallel import ParallelConfig

A100 = presets.gpu("a100-80gb")
MODEL = preset("gpt-1.3b")
BLOCK = next(x for x in MODEL.layer_list() if str(x.kind) == "block")


def _forward(cfg: ParallelConfig, per_byte: float) -> tuple[float, dict[str, float], float]:
    """(pass time, each op's time, one full collective's time)."""
    job = StageJob.of(MODEL, cfg, A100, 0, False)
    kernels = LayerKernels(job, lambda comm: comm.nbytes * per_byte)
    _, end = kernels.pass_template(BLOCK, True)
    ops = {op.name: A100.op_time_s(op, job.dtype) for op in layer_passes(MODEL, cfg, BLOCK).forward}
    return end, ops, tp_bytes(MODEL, cfg) * per_byte


@pytest.mark.parametrize("per_byte", [1e-13, 1e-11])  # collectives short, then long
def test_tp_comm_overlap_forward_by_hand(per_byte):
    cfg = ParallelConfig(tp=8, sequence_parallel=True, micro_batch=4, tp_comm_overlap=True)
    end, t, c = _forward(cfg, per_byte)
    tp = 8

    def ring(gemm: float) -> float:  # all but the last chunk beside the gather
        return max(gemm * (tp - 1) / tp, c) + gemm / tp

    def pipeline(gemm: float) -> float:  # 4 chunks: 3 reduce-scattered beside the GEMM
        gemm *= 108 / (108 - 16)  # on the SMs TE's 16 leave of the A100's 108 (TE >= 2.0)
        return max(gemm, gemm / 4 + 3 * c / 4) + c / 4

    attention = t["attn_scores"] + t["softmax_dropout"] + t["attn_values"]
    expected = (
        t["ln1"] + ring(t["qkv"]) + attention + pipeline(t["proj"])
        + t["residual1"] + t["ln2"] + ring(t["fc1"]) + t["activation"]
        + pipeline(t["fc2"]) + t["residual2"]
    )  # fmt: skip
    assert end == pytest.approx(expected, rel=1e-9)
    # without the overlap every collective is on the compute stream
    plain, t, c = _forward(replace(cfg, tp_comm_overlap=False), per_byte)
    assert plain == pytest.approx(sum(t.values()) + 4 * c, rel=1e-9)


def test_sequence_parallel_backward_gathers_the_input_again():
    # per block and micro-batch: forward 2 all-gathers + 2 reduce-scatters, backward 2
    # gathers of the grad output + 2 reduce-scatters + 2 re-gathers of the input = 10
    # collectives of b s h elements, each moving (tp - 1) / tp of it per rank
    cfg = ParallelConfig(tp=8, sequence_parallel=True, micro_batch=4, precision="bf16")
    report = simulate(MODEL, cfg, presets.topology("1x8-dgx-a100"), A100)
    per_block = 10 * tp_bytes(MODEL, cfg) * 7 / 8
    blocks = MODEL.layers * per_block
    # the rest: the embedding's reduce-scatter and, in the backward, its gather; the head's
    # input gather, and in the backward its re-gather and its dgrad's reduce-scatter
    head = 5 * tp_bytes(MODEL, cfg) * 7 / 8
    # and the vocab-parallel cross-entropy's three all-reduces of one fp32 per token: a ring
    # all-reduce moves 2 (tp - 1) / tp of its buffer per rank, and at 32 KB NCCL's tuner picks
    # LL, whose 8-byte lines carry 4 bytes of data (src/include/device.h): twice the bytes
    loss = 3 * cfg.micro_batch * MODEL.seq_len * 4 * 2 * 7 / 8 * 2
    total = blocks + head + loss
    assert report.traffic_bytes_per_gpu["tp_comm"] == pytest.approx(total, rel=1e-6)


def test_the_overlap_needs_sequence_parallelism():
    from zsim.errors import InputError

    with pytest.raises(InputError, match="tp_comm_overlap"):
        ParallelConfig(tp=8, tp_comm_overlap=True)


def test_vocab_parallel_cross_entropy_all_reduces_three_values_per_token():
    """Megatron's `_VocabParallelCrossEntropy.forward` all-reduces the logits' row maximum, the
    target's logit and the exponentials' sum over the TP group, each one fp32 per token; its
    backward none (the head's backward all-reduces only the logits' input gradient, b s h)."""
    cfg = ParallelConfig(dp=4, tp=2, micro_batch=1)
    model = preset("gpt-125m")
    report = simulate(model, cfg, presets.topology("1x8-nvlink"), A100)
    head = [
        s
        for s in report.engine.all_spans()
        if s.rank == 0 and s.category == "tp_comm" and ".head." in s.name
    ]
    forward = [s.nbytes for s in head if s.name.startswith("F")]
    backward = [s.nbytes for s in head if s.name.startswith("B")]
    assert forward == [model.seq_len * 4] * 3
    assert backward == [model.seq_len * model.hidden * 2]


def _backward(cfg: ParallelConfig, per_byte: float) -> tuple[float, dict[str, float], float]:
    job = StageJob.of(MODEL, cfg, A100, 0, False)
    kernels = LayerKernels(job, lambda comm: comm.nbytes * per_byte)
    _, end = kernels.pass_template(BLOCK, False)
    ops = layer_passes(MODEL, cfg, BLOCK).backward
    return (
        end,
        {op.name: A100.op_time_s(op, job.dtype) for op in ops},
        tp_bytes(MODEL, cfg) * per_byte,
    )


@pytest.mark.parametrize("per_byte", [1e-13, 1e-11])  # all-reduces shorter, then longer
def test_input_gradient_all_reduce_async_or_after_the_weight_gradient(per_byte):
    """Megatron-LM since cf7efd4 (2021-08-30, `--async-tensor-model-parallel-allreduce`):
    the dgrad GEMM, then its all-reduce issued async while the wgrad GEMM runs, waited for
    before the node returns. Before it, and in BigScience's Megatron-DeepSpeed, the
    all-reduce is the backward of `copy_to_tensor_model_parallel_region`, a node after the
    linear's: blocking, after both GEMMs. A block's backward has two (qkv's and fc1's)."""
    cfg = ParallelConfig(tp=8, micro_batch=4)
    end, t, c = _backward(cfg, per_byte)
    hidden = t["qkv_wgrad"] + t["fc1_wgrad"]
    beside = max(t["qkv_wgrad"], c) + max(t["fc1_wgrad"], c)
    assert end == pytest.approx(sum(t.values()) - hidden + beside, rel=1e-9)
    blocking, t, c = _backward(replace(cfg, async_tp_allreduce=False), per_byte)
    assert blocking == pytest.approx(sum(t.values()) + 2 * c, rel=1e-9)


def test_sequence_parallel_reduce_scatters_the_input_gradient_async_either_way():
    """Megatron sets async_tensor_model_parallel_allreduce False with sequence parallelism
    (arguments.py since cfd2e21, 2022-04-28), whose own path reduce-scatters the input
    gradient asynchronously."""
    cfg = ParallelConfig(tp=8, micro_batch=4, sequence_parallel=True)
    on, _, _ = _backward(cfg, 1e-11)
    off, _, _ = _backward(replace(cfg, async_tp_allreduce=False), 1e-11)
    assert off == on
