"""Mechanisms switched off one at a time (`zsim.workload.mechanisms`, `zsim run --without`):
each one's cost against what its source says it does, worked by hand where it can be."""

import json
from dataclasses import replace

import pytest

from tests.golden.scenarios import CAL
from zsim.calibrate.profile import load_profile
from zsim.cli import main
from zsim.errors import InputError
from zsim.inputs import presets
from zsim.simulation import simulate
from zsim.step.job import StageJob
from zsim.workload.mechanisms import MECHANISMS, Mechanism, consulted, parse_mechanisms
from zsim.workload.model import ModelKind, ModelSpec
from zsim.workload.model_presets import preset
from zsim.workload.parallel import ParallelConfig

MLP = ModelSpec("toy-mlp", ModelKind.MLP, layers=8, hidden=1024)


def _step(model, cfg, topology, device, *without: Mechanism) -> float:
    cfg = replace(cfg, without=frozenset(without))
    return simulate(model, cfg, presets.topology(topology), device).step_time_s


def test_zero3_copies_a_coalesced_gather_out():
    # The seeds' 8 x Linear(1024) on 2 CPU ranks, ZeRO-3 defaults: biases (1,024 elements)
    # are persistent (< 1e5), each weight is 1,048,576 elements. DeepSpeed's coordinator
    # fetches fc0 alone (one parameter: `_all_gather_sequential`, a view), then prefetches
    # the other seven weights in one call (7.3M < the 5e7-element bucket): a coalesced
    # gather, whose first wait() torch.cats each weight out of the flat buffer. The backward
    # gathers nothing (everything is within the 1e9 reuse distance). On gloo the copy is the
    # main thread's: the step pays exactly one copy of 7 x 1024^2 fp32 elements.
    device = load_profile(CAL / "cpu-2rank.json")
    cfg = ParallelConfig(dp=2, zero_stage=3, micro_batch=4, precision="fp32")
    with_copy = _step(MLP, cfg, "1x2-cpu", device)
    without = _step(MLP, cfg, "1x2-cpu", device, Mechanism.GATHER_COPY_OUT)
    copy = device.copy_time_s(7 * 1024**2 * 4, "fp32")
    assert with_copy - without == pytest.approx(copy, rel=1e-6)


def test_on_nccl_the_copy_runs_beside_the_gathers():
    # on the allgather stream, which NCCL's stream does not wait for: at most the copies'
    # own time is added (gpt-1.3b prefetches 4-5 weights per call: 1.35B elements copied)
    device = presets.gpu("a100-80gb")
    cfg = ParallelConfig(dp=8, zero_stage=3, micro_batch=4)
    model = preset("gpt-1.3b")
    with_copy = _step(model, cfg, "2x4-ethernet", device)
    without = _step(model, cfg, "2x4-ethernet", device, Mechanism.GATHER_COPY_OUT)
    assert 0 < with_copy - without <= device.copy_time_s(1.4e9 * 2, "fp16")


def test_deepspeeds_pipeline_sends_block_its_loop():
    # PipelineEngine's SendActivation / SendGrad are blocking dist.send calls (pipe/p2p.py);
    # beside compute, as Megatron runs them, the step cannot be longer. In its lock-step
    # TrainSchedule every step exchanges first, so where the stages are alike each compute
    # waits for a receive as long as its own send: blocking then costs nothing
    device = presets.gpu("a100-80gb")
    cfg = ParallelConfig(dp=2, pp=4, micro_batch=2, grad_accum=8, precision="bf16")
    model = preset("gpt-1.3b")
    blocking = _step(model, cfg, "1x8-dgx-a100", device)
    beside = _step(model, cfg, "1x8-dgx-a100", device, Mechanism.BLOCKING_P2P)
    assert beside <= blocking
    # BF16_Optimizer's fp32 accumulation: 10 bytes per stage parameter per micro-batch, read 2
    # + 4 and write 4 (counted as a copy of 5): never free
    no_accumulate = _step(model, cfg, "1x8-dgx-a100", device, Mechanism.FP32_GRAD_ACCUMULATE)
    assert no_accumulate < blocking


def test_deepspeeds_pipeline_partitions_its_messages_over_tp():
    """PipelineEngine with model parallelism (`is_pipe_partitioned`, `is_grad_partitioned`,
    unconditional in deepspeed 0.6, config defaults True in 0.19): each TP rank sends 1/tp of
    an activation or gradient (`PartitionedTensor`); a middle stage's forward gathers its
    input (`part_input.full()`), its backward its own output again and the received gradient:
    three all-gathers of the whole b s h message over TP per micro-batch."""
    cfg = ParallelConfig(tp=2, pp=4, micro_batch=2, grad_accum=4, precision="bf16")
    model = preset("gpt-1.3b")
    a100 = presets.gpu("a100-80gb")
    whole = cfg.micro_batch * model.seq_len * model.hidden * 2

    def middle(topology: str, **how) -> list:  # tp rank 0 of stage 1
        spans = simulate(model, cfg, presets.topology(topology), a100, **how).engine.all_spans()
        return [s for s in spans if s.rank == 2]

    # one node: the sends share NVLink with the TP collectives, which go through the network
    one = middle("1x8-dgx-a100")
    sends = [s.nbytes for s in one if s.name.startswith("send.")]
    gathers = [s.nbytes for s in one if ".full" in s.name and not s.name.endswith("_copy")]
    assert sends == [whole / 2] * (2 * cfg.grad_accum)  # an activation and a gradient each
    assert gathers == [whole] * (3 * cfg.grad_accum)
    # a stage per node: TP collectives take a fixed time, and a middle stage's full()s are two
    # tasks per micro-batch (the input's; the output's and the gradient's, twice as long) of
    # the gather's time alone on NVLink (a straggler of 1x runs it through the network) plus
    # the zero-fill and the clone
    fixed = middle("4x2-nvlink")
    inputs = [s.end_s - s.start_s for s in fixed if s.name.endswith(".input.full")]
    both = [s.end_s - s.start_s for s in fixed if s.name.endswith(".output_and_grad.full")]
    alone = middle("4x2-nvlink", full=True, stragglers={0: 1.0})
    gather = next(s for s in alone if s.name.endswith(".full0"))
    one = gather.end_s - gather.start_s + 1.5 * a100.copy_time_s(whole, "bf16")  # + fill, clone
    assert inputs == pytest.approx([one] * cfg.grad_accum, rel=1e-9)
    assert both == pytest.approx([2 * one] * cfg.grad_accum, rel=1e-9)


def test_nccl_mechanisms_act_on_the_cluster():
    device = presets.gpu("a100-80gb")
    cfg = ParallelConfig(tp=8, micro_batch=4)
    model = preset("gpt-1.3b")
    nccl = _step(model, cfg, "1x8-dgx-a100", device)
    line_rate = _step(model, cfg, "1x8-dgx-a100", device, Mechanism.NVLINK_NCCL_RATE)
    ideal = _step(model, cfg, "1x8-dgx-a100", device, Mechanism.NCCL_PROTOCOLS)
    assert line_rate < nccl  # 300 GB/s instead of 240 for the TP all-reduces
    assert ideal < nccl  # no Simple/LL128 latency beyond the routes' LL hops


def test_names_are_checked():
    assert parse_mechanisms("epilogue-wait, blocking-p2p") == {
        Mechanism.EPILOGUE_WAIT,
        Mechanism.BLOCKING_P2P,
    }
    assert set(MECHANISMS) == set(Mechanism)
    with pytest.raises(InputError, match="one of nccl-protocols"):
        parse_mechanisms("fast-mode")
    with pytest.raises(InputError):
        ParallelConfig(without=frozenset({"fast-mode"}))


def test_autograd_adds_later_micro_batches_into_grad():
    # ZeRO-0/1 keep gradients in .grad until the boundary: micro-batches 2..ga add into it in
    # place (AccumulateGrad: read two fp16 tensors, write one, per parameter) on the compute
    # stream; one GPU, accumulation 4: three such passes
    device = presets.gpu("a100-80gb")
    model = preset("gpt-350m")
    for stage in (0, 1):
        cfg = ParallelConfig(zero_stage=stage, micro_batch=2, grad_accum=4)
        added = _step(model, cfg, "1x1-nvlink", device) - _step(
            model, cfg, "1x1-nvlink", device, Mechanism.GRAD_ACCUMULATE
        )
        params = model.total_params()
        assert added == pytest.approx(3 * device.copy_time_s(1.5 * 2 * params, "fp16"), rel=1e-9)
    # ZeRO-2 reduces every micro-batch's gradients out of .grad: nothing accumulates there
    cfg = ParallelConfig(zero_stage=2, micro_batch=2, grad_accum=4)
    assert _step(model, cfg, "1x1-nvlink", device) == _step(
        model, cfg, "1x1-nvlink", device, Mechanism.GRAD_ACCUMULATE
    )


_ADD = "grad_accumulate"


def test_megatron_before_gradient_accumulation_fusion_adds_into_grad():
    # Megatron-LM's local DDP at b84d7a9 (2020-12-26) all-reduces param.grad at the end, so
    # autograd adds micro-batches 2..ga into .grad (read two fp16 tensors, write one); since
    # --gradient-accumulation-fusion (83b1e42, 2022-02) the wgrad GEMM adds into main_grad.
    # A pipeline of 2 stages (one per node), accumulation 4: each stage pays three adds over
    # its own parameters
    device = presets.gpu("a100-80gb")
    model = preset("gpt-350m")
    fused = ParallelConfig(pp=2, micro_batch=1, grad_accum=4, pipeline_engine="megatron")
    unfused = replace(fused, grad_accumulation_fusion=False)
    topology = presets.topology("2x1-ib")
    for cfg, passes in ((fused, 0), (unfused, 3)):
        spans = simulate(model, cfg, topology, device).engine.all_spans()
        for stage in range(2):  # rank s is stage s (dp 1, tp 1)
            adds = [x.end_s - x.start_s for x in spans if (x.rank, x.name) == (stage, _ADD)]
            own = sum(x.params(1) for x in StageJob.of(model, cfg, device, stage, False).chunks[0])
            one = device.copy_time_s(1.5 * 2 * own, "fp16")
            assert adds == pytest.approx([one] * passes, rel=1e-9)
    with pytest.raises(InputError, match="grad_accumulation_fusion"):
        replace(unfused, dp_engine="megatron")  # Megatron-Core's main_grad hook: not modelled


def test_a_timed_accumulating_backward_replaces_the_separate_pass():
    # Calibration times each layer's backward again with the first one's gradients still in
    # .grad (autograd's AccumulateGrad then adds inside the pass: `accumulate_s`). Where a
    # profile has it, a later micro-batch's backward takes that time and no separate pass
    # follows. The seeds' 8 x Linear(1024) on 2 CPU ranks, ZeRO-0, 4 micro-batches: three
    # accumulating backwards of 8 layers each, on the main thread (gloo blocks on every call)
    profile = load_profile(CAL / "cpu-2rank.json")
    key = next(k for k in profile.layer_times if k.startswith("mlp-h1024") and "|mb4|" in k)
    measured = profile.layer_times[key]
    assert measured.accumulate_s is not None  # a profile calibrated with it
    cfg = ParallelConfig(dp=2, zero_stage=0, micro_batch=4, grad_accum=4, precision="fp32")
    none = _step(MLP, cfg, "1x2-cpu", profile, Mechanism.GRAD_ACCUMULATE)
    # without the timed pass (a profile from before it): a pass at the copy rate instead
    before = replace(measured, accumulate_s=None)
    older = replace(profile, layer_times={**profile.layer_times, key: before})
    as_pass = _step(MLP, cfg, "1x2-cpu", older)
    params = 8 * (1024 * 1024 + 1024)
    assert as_pass - none == pytest.approx(3 * profile.copy_time_s(1.5 * 4 * params, "fp32"))
    for extra_s in (0.4e-3, -0.2e-3):  # slower, or faster: fresh gradients cost allocations
        timed = replace(measured, accumulate_s=measured.backward_s + extra_s)
        device = replace(profile, layer_times={**profile.layer_times, key: timed})
        in_pass = _step(MLP, cfg, "1x2-cpu", device)
        assert in_pass - none == pytest.approx(3 * 8 * extra_s, rel=1e-6)


def test_zsim_run_takes_megatron_without_gradient_accumulation_fusion(capsys) -> None:
    args = ["run", "--topology", "2x1-ib", "--model", "gpt-350m", "--pp", "2", "--json"]
    args += ["--pipeline-engine", "megatron", "--micro-batch", "1", "--grad-accum", "4"]
    assert main(args) == 0
    fused = json.loads(capsys.readouterr().out)
    assert main([*args, "--no-gradient-accumulation-fusion"]) == 0
    unfused = json.loads(capsys.readouterr().out)
    assert unfused["parallel"]["grad_accumulation_fusion"] is False
    assert "grad_accumulation_fusion" not in fused["parallel"]
    assert unfused["step_time_s"] > fused["step_time_s"]  # three adds into .grad per stage


def test_eager_ops_switched_off_are_the_fused_kernels():
    """A consistency check of the switch (the eager counts themselves are checked against
    PyTorch's kernels in test_eager_kernels.py): off, an eager job costs what the fused one
    does; on, more, by its extra bytes at the preset's memory rate and its extra launches."""
    from zsim.workload.eager import Elementwise

    model = preset("llama-7b")
    fused = ParallelConfig(dp=8, zero_stage=3, micro_batch=1, flash_attention=True)
    eager = replace(fused, elementwise=Elementwise.EAGER)
    device = presets.gpu("a100-80gb")
    base = _step(model, fused, "1x8-dgx-a100", device)
    assert _step(model, eager, "1x8-dgx-a100", device, Mechanism.EAGER_OPS) == base
    assert _step(model, eager, "1x8-dgx-a100", device) > 1.05 * base


def _asked(model, cfg, topology, device) -> frozenset[Mechanism]:
    with consulted() as asked:
        simulate(model, cfg, presets.topology(topology), device)
    return frozenset(asked)


def test_a_simulation_asks_only_about_its_own_frameworks_mechanisms():
    # DeepSpeed ZeRO-1 on NCCL, no pipeline, bf16: ZeRO-3's host walks and copies, the
    # pipeline's sends and TransformerEngine's FP8 and userbuffers are not part of that job
    # (their sources: stage3.py / partition_parameters.py, pipe/engine.py, TE); NCCL's
    # protocols and NVLink rate are part of every NCCL job.
    cfg = ParallelConfig(dp=8, zero_stage=1, micro_batch=2)
    asked = _asked(preset("gpt-1.3b"), cfg, "2x4-ethernet", presets.gpu("a100-80gb"))
    assert {Mechanism.NCCL_PROTOCOLS, Mechanism.NVLINK_NCCL_RATE} <= asked
    foreign = {
        Mechanism.ZERO3_HOST,
        Mechanism.GATHER_COPY_OUT,
        Mechanism.BLOCKING_P2P,
        Mechanism.PIPE_PARTITIONED,
        Mechanism.FP8_AMAX,
        Mechanism.TE_SM_MARGINS,
        Mechanism.SEND_QUEUE,
        Mechanism.ENGINE_HOST,
    }
    assert not asked & foreign


@pytest.mark.parametrize(
    "cfg",
    [
        ParallelConfig(dp=8, zero_stage=1, micro_batch=2, grad_accum=2),
        ParallelConfig(dp=4, pp=2, zero_stage=1, micro_batch=1, grad_accum=4),
    ],
    ids=["zero1", "pipeline"],
)
def test_a_mechanism_never_asked_about_leaves_the_step_unchanged(cfg):
    # a consistency check of the ablation's shortcut (bench_reference_runs.ablate): switching
    # off a mechanism the simulation did not ask about gives the very same step
    model, device = preset("gpt-1.3b"), presets.gpu("a100-80gb")
    base = _step(model, cfg, "2x4-ethernet", device)
    unasked = set(Mechanism) - _asked(model, cfg, "2x4-ethernet", device)
    assert unasked
    for mechanism in unasked:
        assert _step(model, cfg, "2x4-ethernet", device, mechanism) == base, mechanism
