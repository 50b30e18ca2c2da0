"""TransformerEngine's FP8 under Megatron-Core (`zsim.workload.fp8`) against its rules: which
GEMMs run in FP8 and at which rate, the casts around them, the FP8 weight copies, and where
FP8 is refused. Expected values from TE's design (its linear modules, `cast_transpose`) and
the GPU presets' spec sheets, not from zsim's outputs."""

from dataclasses import replace

import pytest

from zsim.cluster.device import LayerTime, layer_time_key
from zsim.errors import InputError
from zsim.inputs import presets
from zsim.memory import ledger
from zsim.simulation import simulate
from zsim.step.job import StageJob
from zsim.step.kernels import LayerKernels
from zsim.workload.layout import layer_passes
from zsim.workload.model import LayerKind, OpKind
from zsim.workload.model_presets import preset, with_overrides
from zsim.workload.parallel import ParallelConfig
from zsim.workload.shapes import Shard, forward_ops

LLAMA = with_overrides(preset("llama-7b"), layers=2, seq_len=2048)
BLOCK = next(x for x in LLAMA.layer_list() if x.kind is LayerKind.BLOCK)
H100 = presets.gpu("h100-sxm")


def _cfg(**kw) -> ParallelConfig:
    base = {"dp": 8, "zero_stage": 1, "precision": "fp8", "dp_engine": "megatron"}
    return ParallelConfig(**(base | {"flash_attention": True} | kw))


def test_the_blocks_linears_run_in_fp8_and_nothing_else():
    ops = forward_ops(LLAMA, BLOCK, Shard(1, fp8=True, flash_attention=True))
    fp8 = {op.name for op in ops if op.fp8}
    assert fp8 == {"qkv", "proj", "fc1", "fc2"}
    head = next(x for x in LLAMA.layer_list() if x.kind is LayerKind.HEAD)
    assert not any(op.fp8 for op in forward_ops(LLAMA, head, Shard(1, fp8=True)))


def test_an_fp8_gemm_takes_the_fp8_rate():
    # the preset's FP8 peak is twice its bf16 peak (1979 / 989.4 TFLOP/s, the datasheet); the
    # two dtypes' efficiencies stand as mamf-finder measured them on the H100 (BF16 794.5 / 989,
    # FP8 1402.6 / 1979): a large GEMM's time falls by their ratio, but for the fixed cost
    ops = forward_ops(LLAMA, BLOCK, Shard(8, fp8=True))
    gemm = next(op for op in ops if op.name == "fc1")
    bf16 = H100.op_time_s(replace(gemm, fp8=False), "bf16")
    fp8 = H100.op_time_s(gemm, "bf16")
    fixed = H100.rates_for("bf16").gemm_overhead_s
    achieved = (989.4 * 794.5 / 989) / (1979 * 1402.6 / 1979)
    assert (fp8 - fixed) == pytest.approx((bf16 - fixed) * achieved, rel=0.02)


def test_casts_read_bf16_and_write_fp8_and_its_transpose():
    # around fc2 (input tokens x ffn, output tokens x hidden): 4 bytes an element of its
    # input forward, of its output's gradient backward
    tokens, h, f = 2048, 4096, 11008
    passes = layer_passes(LLAMA, _cfg(micro_batch=1), BLOCK)
    forward = {op.name: op for op in passes.forward}
    backward = {op.name: op for op in passes.backward}
    assert forward["fc2_cast_in"].bytes_moved == 4 * tokens * f
    assert forward["fc2_cast_grad"].bytes_moved == 0
    assert backward["fc2_cast_grad_bwd"].bytes_moved == 4 * tokens * h
    assert backward["fc2_cast_in_bwd"].bytes_moved == 0
    # the output's gradient is cast before the GEMM's own backward needs it
    names = [op.name for op in passes.backward]
    assert names.index("fc2_cast_grad_bwd") < names.index("fc2_dgrad")


def test_fp8_weight_copies_add_two_bytes_a_block_parameter():
    bf16, fp8 = ledger(LLAMA, _cfg(precision="bf16")), ledger(LLAMA, _cfg())
    # the linears' weights of a Llama block (no biases, norms not TE's copies): qkv h x 3h,
    # proj h x h, fc1 h x 2f (gated), fc2 f x h
    h, f = 4096, 11008
    weights = 2 * (3 * h * h + h * h + 2 * h * f + f * h)
    assert fp8.parameters - bf16.parameters == pytest.approx(2 * weights)
    assert fp8.activations == bf16.activations  # kept in bf16 (TE's FP8 saves: not modelled)


def test_fp8_speeds_up_a_step_and_counts_mfu_against_the_bf16_peak():
    topo = presets.topology("1x8-dgx-h100")
    bf16 = simulate(LLAMA, _cfg(precision="bf16", micro_batch=4), topo, H100)
    fp8 = simulate(LLAMA, _cfg(micro_batch=4), topo, H100)
    assert fp8.step_time_s < bf16.step_time_s
    # the same model FLOPs over the same 16-bit peak: MFU in proportion to the speed
    assert fp8.mfu / bf16.mfu == pytest.approx(bf16.step_time_s / fp8.step_time_s)


def test_refused_outside_megatron_core_and_on_a_gpu_without_fp8():
    with pytest.raises(InputError, match="dp_engine"):
        _cfg(dp_engine="deepspeed")
    a100 = presets.gpu("a100-80gb")
    with pytest.raises(InputError, match="precision"):
        simulate(LLAMA, _cfg(micro_batch=4), presets.topology("1x8-dgx-a100"), a100)


def test_no_fp8_op_without_fp8():
    ops = forward_ops(LLAMA, BLOCK, Shard(1, flash_attention=True))
    assert not any(op.fp8 for op in ops)
    assert not any(op.kind is OpKind.MEMORY and "cast" in op.name for op in ops)


def test_a_profiles_16_bit_layer_times_do_not_stand_for_fp8():
    # a calibrated profile's block time was measured in bf16: it times a bf16 job's block,
    # not an FP8 one's
    key = layer_time_key(LLAMA, LayerKind.BLOCK, 1, "bf16", 1, True)
    profile = replace(H100, layer_times={key: LayerTime(1.0, 2.0)})
    for precision, timed in (("bf16", True), ("fp8", False)):
        job = StageJob.of(LLAMA, _cfg(precision=precision, micro_batch=1), profile, 0, False)
        assert (LayerKernels(job, None).measured(BLOCK) is not None) is timed


def test_delayed_scalings_amaxes_are_three_and_two_per_gemm():
    # TE module/base.py: `num_gemms * 3` FP8 tensors forward, `* 2` backward, fp32 amaxes;
    # a block's TE modules run qkv, proj, fc1 and fc2: 4 GEMMs
    from zsim.workload.fp8 import amax_bytes

    blocks = [x for x in LLAMA.layer_list() if x.kind is LayerKind.BLOCK]
    assert amax_bytes(blocks, True) == len(blocks) * 4 * 3 * 4
    assert amax_bytes(blocks, False) == len(blocks) * 4 * 2 * 4
    head = [x for x in LLAMA.layer_list() if x.kind is LayerKind.HEAD]
    assert amax_bytes(head, True) == 0  # Megatron-Core's output layer is not a TE module


def test_each_chunk_reduces_its_amaxes_over_its_stage_after_forward_and_backward():
    # Megatron-Core: one fp8_autocast per model chunk's TransformerBlock (delayed scaling),
    # over get_amax_reduction_group(with_context_parallel=True): the stage's tp x dp x cp
    # ranks; TE all-reduces at the region's end (forward) and after its first module's
    # backward, blocking (async_op=False): 2 x micro-batches x chunks per rank
    from zsim.cluster.grid import RankGrid
    from zsim.step.builder import build_program
    from zsim.step.groups import RankGroups
    from zsim.step.program import Group, Stream

    model = with_overrides(preset("llama-7b"), layers=8, seq_len=2048)
    cfg = _cfg(
        dp=2,
        tp=2,
        pp=2,
        cp=2,
        pp_schedule="interleaved",
        virtual_stages=2,
        pipeline_engine="megatron",
        grad_accum=4,
        sequence_parallel=True,
    )
    program = build_program(model, cfg, H100, stage=1)
    reduces = [t for t in program.tasks if t.name.endswith("amax_reduce")]
    assert len(reduces) == 2 * cfg.grad_accum * cfg.virtual_stages
    assert {t.stream for t in reduces} == {Stream.COMPUTE}
    assert {t.comm.group for t in reduces} == {Group.STAGE}
    grid = RankGrid(dp=cfg.dp_cp, pp=cfg.pp, tp=cfg.tp)
    stage = RankGroups(grid, None, full=True, block=1).group_of(grid.rank(1, 1, 1), Group.STAGE)
    assert stage == tuple(sorted(grid.rank(d, 1, t) for d in range(4) for t in range(2)))
    for off in (_cfg(precision="bf16"), replace(cfg, without=frozenset({"fp8-amax"}))):
        tasks = build_program(model, off, H100, stage=0).tasks
        assert not any("amax" in t.name for t in tasks)
