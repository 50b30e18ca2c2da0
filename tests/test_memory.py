"""The memory ledger against the seeds' formulas and tables."""

import pytest

from zsim.memory import in_flight_micro_batches, ledger, peak_ledger
from zsim.workload.model_presets import from_params, preset
from zsim.workload.parallel import (
    ParallelConfig,
    PipelineEngine,
    PipelineSchedule,
    Precision,
    Recompute,
    ZeroStage,
)

GB = 1e9


def seed_formula(psi, nd):
    """Seeds 000, section 2.3: 16Ψ, 4Ψ + 12Ψ/Nd, 2Ψ + 14Ψ/Nd, 16Ψ/Nd bytes."""
    return [16 * psi, 4 * psi + 12 * psi / nd, 2 * psi + 14 * psi / nd, 16 * psi / nd]


@pytest.mark.parametrize(("psi", "nd"), [(7.5e9, 64), (30e9, 16), (1.3e9, 8), (175e9, 1024)])
def test_model_states_follow_seed_formulas(psi, nd):
    model = from_params(psi)
    got = [ledger(model, ParallelConfig(dp=nd, zero_stage=s)).model_states for s in ZeroStage]
    assert got == pytest.approx(seed_formula(psi, nd), rel=1e-12)


def test_seed_table_7_5b_on_64_gpus():
    # seeds 000, table in 2.3: 120 / 31.4 / 16.6 / 1.9 GB
    model = from_params(7.5e9)
    got = [ledger(model, ParallelConfig(dp=64, zero_stage=s)).model_states / GB for s in ZeroStage]
    assert [round(g, 1) for g in got] == [120.0, 31.4, 16.6, 1.9]


def test_seed_question_1_30b_on_16_gpus():
    # seeds 000, question 1: ZeRO-1 142.5, ZeRO-2 86.25, ZeRO-3 30 GB
    model = from_params(30e9)
    got = [
        ledger(model, ParallelConfig(dp=16, zero_stage=s)).model_states / GB
        for s in (ZeroStage.OPTIMIZER, ZeroStage.GRADIENTS, ZeroStage.PARAMETERS)
    ]
    assert got == pytest.approx([142.5, 86.25, 30.0])


def test_tp_divides_sharded_weights_and_pp_splits_blocks():
    m = preset("gpt-13b")
    base = ledger(m, ParallelConfig()).parameters
    tp4 = ledger(m, ParallelConfig(tp=4)).parameters
    # only LayerNorms, row-parallel biases and position embeddings are replicated
    assert base / 4 < tp4 < base / 4 * 1.01
    pp4 = [ledger(m, ParallelConfig(pp=4), s).parameters for s in range(4)]
    h, v = m.hidden, m.vocab
    block = 12 * h * h + 13 * h  # a GPT layer's weights and biases (Narayanan et al. 2021)
    assert pp4[1] == pp4[2] == 10 * block * 2
    # Megatron puts the embedding on the first stage and a copy of the tied word embedding
    # on the last, beside the final LayerNorm
    assert pp4[0] == (10 * block + v * h + m.seq_len * h) * 2
    assert pp4[3] == (10 * block + 2 * h + v * h) * 2


def test_offload_moves_optimizer_to_host():
    model = from_params(1e9)
    cfg = ParallelConfig(dp=4, zero_stage=ZeroStage.GRADIENTS, offload="optimizer")
    led = ledger(model, cfg)
    assert led.optimizer_states == 0
    # 12 bytes/param of optimizer plus the 4-byte fp32 gradient partition per rank
    assert led.host_offloaded == pytest.approx(1e9 * 16 / 4)


def test_fp32_training_ledger():
    # fp32 plain DP: 4 (weights) + 4 (grads) + 8 (Adam m, v) bytes/param
    model = from_params(1e9)
    assert ledger(model, ParallelConfig(precision=Precision.FP32)).model_states == 16e9


@pytest.mark.parametrize(
    ("p", "m", "v", "expected"),
    [
        (4, 8, 1, 4.0),
        (4, 2, 1, 2.0),
        (8, 64, 2, 8 * (1 + 7 / 16)),
        (4, 16, 4, 4 * (1 + 3 / 16)),
    ],
)
def test_first_stage_in_flight_micro_batches(p, m, v, expected):
    # 1F1B: min(p, m) (Narayanan 2021); interleaved: p(1 + (p-1)/(pv)) (Korthikanti 2022)
    sched = PipelineSchedule.INTERLEAVED if v > 1 else PipelineSchedule.ONE_F_ONE_B
    cfg = ParallelConfig(
        pp=p, grad_accum=m, pp_schedule=sched, virtual_stages=v, pipeline_engine="megatron"
    )
    assert in_flight_micro_batches(cfg) == pytest.approx(expected)


def test_recompute_reduces_activations():
    m = preset("gpt-1.3b")
    torchtitans = (Recompute.SELECTIVE_OP, Recompute.SELECTIVE_LAYER)  # test_selective_*.py
    modes = (r for r in Recompute if r not in torchtitans)
    acts = {r: ledger(m, ParallelConfig(micro_batch=4, recompute=r)).activations for r in modes}
    assert acts["full"] < acts["selective"] < acts["none"]
    # full recompute keeps 2sbh per layer (the layer input) plus one layer's working set
    sbh2 = 2 * 2048 * 4 * 2048
    assert acts["full"] > 24 * sbh2


@pytest.mark.parametrize(
    ("name", "pp", "v", "schedule", "m"),
    [
        ("gpt-175b", 16, 1, PipelineSchedule.ONE_F_ONE_B, 64),  # tied embedding on the ends
        ("gpt-175b", 8, 3, PipelineSchedule.INTERLEAVED, 64),
        ("llama-70b", 8, 1, PipelineSchedule.ONE_F_ONE_B, 4),  # m < p: in flight capped at m
        ("llama-70b", 4, 1, PipelineSchedule.GPIPE, 8),
        ("gpt-760m", 4, 2, PipelineSchedule.INTERLEAVED, 16),
    ],
)
def test_the_peak_stage_is_the_fullest_of_every_stage(name, pp, v, schedule, m):
    # the peak is looked for among a few candidate stages; every stage's ledger is the truth
    model = preset(name)
    cfg = ParallelConfig(pp=pp, tp=8, grad_accum=m, virtual_stages=v, pp_schedule=schedule,
                         pipeline_engine=PipelineEngine.MEGATRON)  # fmt: skip
    totals = [ledger(model, cfg, s).device_total for s in range(pp)]
    stage, found = peak_ledger(model, cfg)
    assert stage == totals.index(max(totals))
    assert found == ledger(model, cfg, stage)
