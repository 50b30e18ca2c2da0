"""A 1F1B pipeline's steady state simulated once and repeated (zsim.step.fold). A consistency
check between two ways of running the same model: the folded step (pp + 6 micro-batches
simulated, the rest repeated) against the step with every micro-batch simulated, on pipelines
whose sends, tensor- and data-parallel collectives share NICs, oversubscribed fat trees, every
rank simulated with a straggler, Megatron's and DeepSpeed's schedules, gloo on the CPU. The
fold must give the same step, the same times per stage and the same bytes per link class and
category; and it must refuse a timeline that does not repeat."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tests.golden.network_scenarios import SCENARIOS, NetScenario, _s
from tests.golden.record_network import inputs
from zsim.simulation import Report, simulate
from zsim.step import fold as fold_module
from zsim.step.fold import INTERLEAVED_GROUPS, STEADY_MICRO_BATCHES, short_config
from zsim.workload.mechanisms import Mechanism
from zsim.workload.parallel import ParallelConfig

_MEGATRON = {"pipeline_engine": "megatron"}
_EXTRA: dict[str, NetScenario] = {
    "ib-4x4-tp2-pp4-deepspeed-partitioned": _s(
        "4x4-ib", "gpt-350m", dp=2, tp=2, pp=4, micro_batch=1, zero_stage=1
    ),
    "ib-4x4-pp4-megatron-ddp-overlap": _s(
        "4x4-ib",
        "gpt-350m",
        dp=4,
        pp=4,
        micro_batch=1,
        zero_stage=1,
        dp_engine="megatron",
        knobs={"overlap_comm": True},
        **_MEGATRON,
    ),
    "eth-2x4-pp2-bf16-fp32-accumulate": _s(
        "2x4-ethernet", "gpt-125m", dp=4, pp=2, micro_batch=2, precision="bf16", zero_stage=1
    ),
    "ib-4x4-tp2-pp2-full": _s(
        "4x4-ib", "gpt-125m", dp=4, tp=2, pp=2, micro_batch=1, zero_stage=1, full=True
    ),
    "cpu-1x4-tp2-pp2-gloo-full": _s(
        "1x4-cpu",
        "gpt-125m",
        dp=1,
        tp=2,
        pp=2,
        micro_batch=1,
        precision="fp32",
        profile="cpu-4rank",
        full=True,
        shape={"layers": 4, "hidden": 256, "heads": 4, "seq_len": 128},
    ),
    "cpu-1x2-pp2-gloo": _s(
        "1x2-cpu",
        "gpt-125m",
        dp=1,
        pp=2,
        micro_batch=1,
        precision="fp32",
        profile="cpu-2rank",
        shape={"layers": 4, "hidden": 256, "heads": 4, "seq_len": 128},
    ),
}
_PIPELINES = {
    name: s
    for name, s in {**SCENARIOS, **_EXTRA}.items()
    if s.layout.get("pp", 1) > 1
    and s.layout.get("pp_schedule", "1f1b") == "1f1b"
    and not s.stragglers
}


def _long(cfg: ParallelConfig, extra: int = 3) -> ParallelConfig:
    """Enough micro-batches to fold, and a few more (any count folds, not only round ones)."""
    return dataclasses.replace(cfg, grad_accum=2 * (cfg.pp + STEADY_MICRO_BATCHES) + extra)


def _both(s: NetScenario, **change: object) -> tuple[Report, Report]:
    model, cfg, topo, device = inputs(s)
    long = {"grad_accum": 2 * (cfg.pp + STEADY_MICRO_BATCHES) + 3}  # as `_long`
    cfg = dataclasses.replace(cfg, **(long | change))  # type: ignore[arg-type]
    run = {"full": s.full, "stragglers": s.stragglers or None}
    folded = simulate(model, cfg, topo, device, **run)  # type: ignore[arg-type]
    whole = simulate(model, cfg, topo, device, fold=False, **run)  # type: ignore[arg-type]
    return folded, whole


def _assert_same(folded: Report, whole: Report) -> None:
    step = whole.step_time_s
    assert folded.step_time_s == pytest.approx(step, rel=1e-9)
    assert folded.link_traffic_bytes == pytest.approx(whole.link_traffic_bytes, rel=1e-9)
    assert folded.traffic_bytes_per_gpu == pytest.approx(whole.traffic_bytes_per_gpu, rel=1e-9)
    assert folded.critical.rank == whole.critical.rank
    fields = ("compute_s", "exposed_comm_s", "idle_s", "comm_total_s", "end_s")
    for got, want in zip(folded.stages, whole.stages, strict=True):
        for name in fields:
            assert getattr(got, name) == pytest.approx(getattr(want, name), abs=1e-9 * step)
        assert got.exposed_by_category.keys() == want.exposed_by_category.keys()
        for category, seconds in want.exposed_by_category.items():
            assert got.exposed_by_category[category] == pytest.approx(seconds, abs=1e-9 * step)


@pytest.mark.consistency
@pytest.mark.parametrize("name", sorted(_PIPELINES))
def test_a_folded_pipeline_gives_the_whole_steps_answers(name: str) -> None:
    folded, whole = _both(_PIPELINES[name])
    assert folded.engine.fold is not None  # it did fold ...
    cfg = _long(inputs(_PIPELINES[name])[1])
    short = short_config(cfg)
    assert short is not None
    left_out = cfg.grad_accum - short.grad_accum  # in periods of one or two micro-batches
    assert left_out in (folded.engine.fold.periods, 2 * folded.engine.fold.periods)
    assert whole.engine.fold is None  # ... and the reference did not
    _assert_same(folded, whole)


@pytest.mark.consistency
@pytest.mark.parametrize("v", [2, 4])
def test_an_interleaved_pipeline_folds_by_groups_of_pp(v: int) -> None:
    # rails, tp 2 with sequence parallelism, pp 4: Megatron's interleaved order repeats by
    # groups of pp micro-batches; 12 groups, 6 of them simulated
    s = SCENARIOS["rails-interleaved"]
    folded, whole = _both(s, grad_accum=12 * 4, virtual_stages=v)
    fold = folded.engine.fold
    assert fold is not None
    assert fold.micro_batches == INTERLEAVED_GROUPS * 4
    assert fold.periods * 4 == 12 * 4 - fold.micro_batches  # periods of pp micro-batches
    _assert_same(folded, whole)


@pytest.mark.consistency
def test_megatron_without_blocking_sends_folds_alike() -> None:
    s = SCENARIOS["oversub-tp4-pp2-dp4"]
    folded, whole = _both(s, without=frozenset({Mechanism.BLOCKING_P2P}))
    assert folded.engine.fold is not None
    _assert_same(folded, whole)


def test_only_long_1f1b_pipelines_are_folded() -> None:
    base = ParallelConfig(dp=1, pp=4, micro_batch=1, grad_accum=2 * (4 + STEADY_MICRO_BATCHES))
    assert short_config(base) == dataclasses.replace(base, grad_accum=4 + STEADY_MICRO_BATCHES)
    odd = dataclasses.replace(base, grad_accum=base.grad_accum + 3)  # an even number left out
    assert short_config(odd) == dataclasses.replace(base, grad_accum=5 + STEADY_MICRO_BATCHES)
    assert short_config(dataclasses.replace(base, grad_accum=base.grad_accum - 1)) is None
    assert short_config(ParallelConfig(dp=8, grad_accum=64)) is None  # no pipeline
    gpipe = dataclasses.replace(base, pipeline_engine="megatron", pp_schedule="gpipe")
    assert short_config(gpipe) is None  # no steady state: all forwards, then all backwards
    mega = dataclasses.replace(base, pipeline_engine="megatron", pp_schedule="interleaved")
    groups = dataclasses.replace(mega, virtual_stages=2, grad_accum=2 * INTERLEAVED_GROUPS * 4)
    assert short_config(groups) == dataclasses.replace(groups, grad_accum=INTERLEAVED_GROUPS * 4)
    fewer = dataclasses.replace(groups, grad_accum=groups.grad_accum - 4)
    assert short_config(fewer) is None


@pytest.mark.consistency
def test_a_straggler_s_own_rhythm_is_not_folded() -> None:
    # every rank simulated, one slower: its data-parallel replica of the pipeline runs at
    # its own period, so the timeline does not repeat with one period: simulated whole
    folded, whole = _both(SCENARIOS["full-straggler-ib-pp2"])
    assert folded.engine.fold is None
    assert folded.step_time_s == whole.step_time_s


def test_a_timeline_that_does_not_repeat_is_simulated_whole(monkeypatch) -> None:
    s = SCENARIOS["ib-4x4-pp4-deepspeed"]
    real = fold_module.find_fold
    refused = []

    def perturbed(engine, micro_batches, periods):  # one task in the checked periods moved
        found = real(engine, micro_batches, periods)
        assert found is not None
        rank = engine.ranks[-1]
        lo, _ = found.window
        starts = engine.task_start[rank]
        index = next(i for i, t in enumerate(starts) if lo <= t < lo + found.period_s)
        engine.task_end[rank][index] += 1e-6 * found.period_s
        refused.append(real(engine, micro_batches, periods))
        return refused[-1]

    monkeypatch.setattr("zsim.simulation.find_fold", perturbed)
    folded, whole = _both(s)
    assert refused == [None]
    assert folded.engine.fold is None  # simulated whole after the refusal
    assert folded.step_time_s == whole.step_time_s


def test_zsim_run_says_what_it_folded_and_a_trace_simulates_everything(tmp_path, capsys) -> None:
    from zsim.cli import main

    args = ["run", "--topology", "4x4-ib", "--model", "gpt-350m", "--pp", "4", "--dp", "4"]
    args += ["--micro-batch", "1", "--grad-accum", "40", "--stage", "1", "--json"]
    assert main(args) == 0
    folded = json.loads(capsys.readouterr().out)
    assert any(n.startswith("pipeline steady state: 12 of 40") for n in folded["notes"])
    assert main([*args, "--trace", str(tmp_path / "t.json")]) == 0
    whole = json.loads(capsys.readouterr().out)
    assert not any(n.startswith("pipeline steady state") for n in whole["notes"])
    assert folded["step_time_s"] == pytest.approx(whole["step_time_s"], rel=1e-9)
