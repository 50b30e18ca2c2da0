"""Megatron-Core's data parallelism (`zsim.step.megatron_dp`) against its source
(megatron/core/distributed at NVIDIA/Megatron-LM d98e8a6): the buckets
`_ParamAndGradBuffer` cuts, the bytes its reduce-scatters move, when they start, and where the
distributed optimizer's gathers go; each expected value worked by hand from the source."""

import pytest

from zsim.errors import InputError
from zsim.inputs import presets
from zsim.memory import model_state_bytes
from zsim.simulation import simulate
from zsim.step.builder import build_program
from zsim.step.job import StageJob
from zsim.step.megatron_dp import buckets
from zsim.workload.model import ModelKind, ModelSpec
from zsim.workload.model_presets import preset
from zsim.workload.parallel import ParallelConfig, ZeroKnobs

MLP = ModelSpec("toy-mlp", ModelKind.MLP, layers=8, hidden=4096)  # 8 x (4096^2 + 4096)
A100 = presets.gpu("a100-80gb")


def _cfg(**kw) -> ParallelConfig:
    """Megatron-Core's DDP with the distributed optimizer and --overlap-grad-reduce."""
    base = {"dp": 2, "zero_stage": 1, "precision": "bf16", "dp_engine": "megatron"} | kw
    return ParallelConfig(**base, knobs=ZeroKnobs(overlap_comm=True))


def _layers_per_bucket(cfg: ParallelConfig, stage: int = 0, model: ModelSpec = MLP) -> list[int]:
    job = StageJob.of(model, cfg, A100, stage, False)
    return [sum(t.name.endswith("weight") for t in b) for b in buckets(job)]


def test_buckets_close_at_the_parameter_that_fills_them():
    # reverse parameter order: fc7.bias, fc7.weight, fc6.bias, ...; a bucket closes at the
    # parameter that brings it to max(4e7, 1e6 x dp): at dp 2, 40M -> after fc5.weight
    # (3 x 16,781,312 = 50.3M), again after fc2.weight, and fc1, fc0 are the last bucket
    assert _layers_per_bucket(_cfg()) == [3, 3, 2]
    # dp 64: 64M -> four layers (67.1M) per bucket
    assert _layers_per_bucket(_cfg(dp=64)) == [4, 4]
    # one bucket without --overlap-grad-reduce, and on every pipeline stage but the first
    assert _layers_per_bucket(_cfg_no_overlap()) == [8]
    assert _layers_per_bucket(_cfg(pp=2, pipeline_engine="megatron"), stage=1) == [4]
    # interleaved: one DDP buffer per model chunk, and only the first chunk is cut
    # (disable_bucketing for the others); no bucket holds two chunks' parameters
    interleaved = _cfg(
        pp=2, virtual_stages=2, pipeline_engine="megatron", pp_schedule="interleaved", grad_accum=2
    )
    wide = ModelSpec("toy-mlp", ModelKind.MLP, layers=8, hidden=8192)  # 67M per layer
    assert _layers_per_bucket(interleaved, model=wide) == [1, 1, 2]


def _cfg_no_overlap() -> ParallelConfig:
    return ParallelConfig(dp=2, zero_stage=1, precision="bf16", dp_engine="megatron")


def _reduced_bytes(cfg: ParallelConfig) -> float:
    program = build_program(MLP, cfg, A100, 0)
    return sum(t.comm.nbytes for t in program.tasks if t.name == "grad_reduce")


def test_bf16_gradients_are_reduced_in_fp32():
    # bf16 sets accumulate_allreduce_grads_in_fp32: 4 bytes per element; each bucket padded
    # to lcm(dp, 128) for the distributed optimizer
    params = 8 * (4096**2 + 4096)
    assert _reduced_bytes(_cfg()) == pytest.approx(4 * params, rel=1e-5)
    assert _reduced_bytes(_cfg(precision="fp16")) == pytest.approx(2 * params, rel=1e-5)
    # the main_grad buffer in the ledger: 4 bytes per parameter, not bf16's 2
    _, grads, _, _ = model_state_bytes(1e9, _cfg())
    assert grads == pytest.approx(4e9)


def test_buckets_reduce_during_the_last_backward():
    cfg = _cfg(dp=8, grad_accum=2, micro_batch=4)
    report = simulate(MLP, cfg, presets.topology("2x4-ethernet"), A100)
    spans = [s for s in report.engine.all_spans() if s.rank == 0]
    reduces = [s for s in spans if s.name == "grad_reduce"]
    backward = [s for s in spans if s.category == "backward"]
    assert len(reduces) == 3  # one per bucket, at the last micro-batch only (no_sync before)
    assert min(r.start_s for r in reduces) < max(b.end_s for b in backward)


def test_overlapped_gathers_go_before_the_first_forward():
    cfg = _cfg(overlap_param_gather=True)
    program = build_program(MLP, cfg, A100, 0)
    names = [t.name for t in program.tasks]
    assert names.count("param_gather") == 3  # one per bucket, in the step's first forward
    assert "param_allgather" not in names  # nothing after the optimizer step
    plain = build_program(MLP, _cfg(), A100, 0)
    assert [t.name for t in plain.tasks].count("param_allgather") == 3


def test_the_frameworks_rules():
    with pytest.raises(InputError, match="zero_stage"):
        ParallelConfig(dp=2, zero_stage=2, dp_engine="megatron")
    with pytest.raises(InputError, match="overlap_param_gather"):
        ParallelConfig(dp=2, zero_stage=1, overlap_param_gather=True)  # DeepSpeed's engine
    with pytest.raises(InputError, match="overlap_param_gather"):
        ParallelConfig(dp=2, zero_stage=1, dp_engine="megatron", overlap_param_gather=True)
    with pytest.raises(InputError, match="pipeline_engine"):  # not under DeepSpeed's pipeline
        ParallelConfig(dp=2, pp=2, zero_stage=1, dp_engine="megatron")


def test_megatron_overlap_beats_deepspeeds_schedule_on_a_big_model():
    # same bytes (fp32 reduce-scatter vs bf16 all-reduce), but Megatron starts each bucket in
    # the backward and gathers in the next forward: never slower than DeepSpeed's ZeRO-1
    model = preset("gpt-1.3b")
    topo = presets.topology("2x4-ethernet")
    ds = ParallelConfig(dp=8, zero_stage=1, precision="bf16", micro_batch=4)
    mg = _cfg(dp=8, micro_batch=4, overlap_param_gather=True)
    assert simulate(model, mg, topo, A100).step_time_s < simulate(model, ds, topo, A100).step_time_s


def test_the_run_says_which_engine_and_overlaps(capsys):
    import json

    from zsim.cli import main

    argv = ["run", "--topology", "1x8-dgx-a100", "--model", "gpt-350m", "--tp", "2"]
    argv += ["--stage", "1", "--precision", "bf16", "--dp-engine", "megatron", "--overlap-comm"]
    argv += ["--overlap-param-gather", "--sequence-parallel", "--tp-comm-overlap", "--json"]
    assert main(argv) == 0
    parallel = json.loads(capsys.readouterr().out)["parallel"]
    assert parallel["dp_engine"] == "megatron"
    assert parallel["megatron_overlaps"] == [
        "--overlap-grad-reduce",
        "--overlap-param-gather",
        "--tp-comm-overlap",
    ]
    assert main([*argv[:-1], "--dp-engine", "deepspeed", "--json"]) == 2  # overlaps need it


def test_interleaving_aligns_the_parameter_gathers():
    # forward_backward_pipelining_with_interleaving dispatches chunks 0 and 1 at its start
    # (schedules.py:1219-1221): their gathers wait for nothing; chunk 2's waits for compute
    wide = ModelSpec("toy-mlp", ModelKind.MLP, layers=12, hidden=4096)
    cfg = _cfg(
        pp=2,
        virtual_stages=3,
        pipeline_engine="megatron",
        pp_schedule="interleaved",
        grad_accum=2,
        overlap_param_gather=True,
    )
    program = build_program(wide, cfg, A100, 1)
    gathers = [t for t in program.tasks if t.name == "param_gather"]
    assert len(gathers) == 3  # one bucket per chunk beyond the first stage
    assert [bool(t.deps) for t in gathers] == [False, False, True]


def test_a_pipeline_send_waits_for_the_grad_scaling_queued_before_it():
    # the last micro-batch's backward scales each finished bucket in place on the compute
    # stream (`start_grad_sync`: grad_data *= 1/dp) before the schedule sends the chunk's
    # input gradient; PyTorch's NCCL stream waits on the compute stream when the send is
    # issued, so the send starts after the scaling (schedules.py: the grad sync is launched
    # inside backward_step_helper, before send_backward); the interleaved schedule's sends
    # run beside compute (the others' block the loop anyway)
    from dataclasses import replace

    model = preset("gpt-125m")
    cfg = _cfg(
        dp=4,
        pp=2,
        grad_accum=4,
        pipeline_engine="megatron",
        pp_schedule="interleaved",
        virtual_stages=2,
    )
    topo = presets.topology("1x8-dgx-a100")

    def waits(config: ParallelConfig) -> list[bool]:
        """For each of the last stage's last-micro-batch sends: whether it starts after the
        grad scaling that started before it ended."""
        rank = config.world_size // 2
        spans = [
            s for s in simulate(model, config, topo, A100).engine.all_spans() if s.rank == rank
        ]
        scales = [s for s in spans if s.name == "grad_scale"]
        sends = [s for s in spans if s.name.startswith("send.grad3")]
        assert len(sends) == len(scales) == 2  # a chunk each
        return [
            send.start_s >= max(x.end_s for x in scales if x.start_s <= send.start_s)
            for send in sends
        ]

    assert all(waits(cfg))
    assert not any(waits(replace(cfg, without=frozenset({"send-queue"}))))


def test_the_grad_scaling_reads_and_writes_each_fp32_gradient_once():
    # `grad_data *= gradient_scaling_factor` on the fp32 main_grad buffer: 4 bytes read and
    # 4 written per element at the GPU's read-plus-write HBM rate; the MLP's 8 x (4096^2 +
    # 4096) parameters, bucket padding aside
    cfg = _cfg(dp=8)
    program = build_program(MLP, cfg, A100, 0)
    scaled = sum(t.duration_s for t in program.tasks if t.name == "grad_scale")
    params = 8 * (4096**2 + 4096)
    expected = params * 8 / A100.rates_for("bf16").memory_bytes_per_s
    assert scaled == pytest.approx(expected, rel=1e-3)
