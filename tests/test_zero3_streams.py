"""ZeRO-3's collectives on DeepSpeed's process groups. ProcessGroupNCCL runs every collective of
a group on that group's one NCCL stream per device (torch: `ncclStreams_.at(key)`,
`getKeyFromDevice`), after the caller's stream. DeepSpeed 0.19 gathers parameters on the
mpu's data-parallel group when it is given an mpu, else on WORLD, and reduce-scatters on the
engine's data-parallel group (the mpu's, else `_clone_world_group()`, a second communicator)."""

import pytest

from zsim.inputs import presets
from zsim.simulation import simulate
from zsim.workload.model_presets import preset
from zsim.workload.parallel import ParallelConfig, ZeroKnobs


def _comm_spans(mpu: bool):
    # 20M-element buckets (HF's "auto" is hidden^2) and 50M live parameters: the backward
    # gathers the layers again while it reduce-scatters their gradients
    knobs = ZeroKnobs(
        reduce_bucket_size=20_000_000, max_live_parameters=50_000_000, max_reuse_distance=50_000_000
    )
    cfg = ParallelConfig(dp=8, zero_stage=3, micro_batch=1, knobs=knobs, mpu=mpu)
    report = simulate(preset("gpt-350m"), cfg, presets.topology("2x4-ethernet"),
                      presets.gpu("a100-80gb"))  # fmt: skip
    spans = [s for s in report.engine.all_spans() if s.rank == 0]
    gathers = [s for s in spans if s.category == "param_gather"]
    reduces = [s for s in spans if s.category == "grad_reduce"]
    return report, gathers, reduces


def _overlap_s(a, b) -> float:
    return sum(max(0.0, min(x.end_s, y.end_s) - max(x.start_s, y.start_s)) for x in a for y in b)


def test_one_group_runs_gathers_and_reduce_scatters_one_at_a_time():
    _, gathers, reduces = _comm_spans(mpu=True)
    assert gathers
    assert reduces
    assert _overlap_s(gathers, reduces) == pytest.approx(0.0, abs=1e-12)


def test_two_groups_let_them_run_together_and_one_group_costs_time():
    two, gathers, reduces = _comm_spans(mpu=False)
    assert _overlap_s(gathers, reduces) > 0  # on Ethernet the backward's both are long
    one, *_ = _comm_spans(mpu=True)
    assert one.step_time_s > two.step_time_s


def test_an_mpu_is_given_exactly_with_model_parallelism_by_default():
    assert not ParallelConfig(dp=8, zero_stage=3).one_dp_group
    assert ParallelConfig(dp=4, tp=2, zero_stage=3).one_dp_group
    assert ParallelConfig(dp=8, zero_stage=3, mpu=True).one_dp_group


def test_each_backward_ends_when_its_reductions_do():
    # stage3.py `independent_gradient_partition_epilogue` synchronizes the reduction stream at
    # the end of every backward: the next micro-step's forward starts after the last
    # reduce-scatter of the one before
    knobs = ZeroKnobs(reduce_bucket_size=20_000_000)
    cfg = ParallelConfig(dp=8, zero_stage=3, micro_batch=1, grad_accum=2, knobs=knobs)
    report = simulate(preset("gpt-350m"), cfg, presets.topology("2x4-ethernet"),
                      presets.gpu("a100-80gb"))  # fmt: skip
    spans = [s for s in report.engine.all_spans() if s.rank == 0]
    first_backward_end = min(s.end_s for s in spans if s.name.startswith("B0"))
    reduces = [s for s in spans if s.category == "grad_reduce" and s.name == "grad_reduce"]
    second_forward = min(s.start_s for s in spans if s.name.startswith("F1"))
    last_reduce_of_first = max(s.end_s for s in reduces if s.start_s < second_forward)
    assert last_reduce_of_first > first_backward_end  # the reductions outlast the backward
    assert second_forward >= last_reduce_of_first


def _backward_end(monkeypatch, max_events):
    monkeypatch.setattr("zsim.step.zero_reduce.MAX_PARAM_REDUCE_EVENTS", max_events)
    knobs = ZeroKnobs(reduce_bucket_size=1_000_000)
    cfg = ParallelConfig(dp=8, zero_stage=3, micro_batch=1, knobs=knobs)
    report = simulate(preset("gpt-350m"), cfg, presets.topology("2x4-ethernet"),
                      presets.gpu("a100-80gb"))  # fmt: skip
    spans = [s for s in report.engine.all_spans() if s.rank == 0]
    backward = [s for s in spans if s.category == "backward" and s.stream == "compute"]
    flush_ends = sorted(s.end_s for s in spans if s.name == "bucket_scatter")
    return max(s.end_s for s in backward), flush_ends


@pytest.mark.consistency
def test_the_host_waits_when_three_flushes_are_still_reducing(monkeypatch):
    # stage3.py `__reduce_and_partition_ipg_grads`: with more than max_param_reduce_events = 2
    # reductions in flight, the host waits for the oldest before it issues the next flush, so
    # the backward cannot run more than three flushes ahead of its reduce-scatters. Over
    # 100 GbE with 1M-element buckets it would (a consistency check: the same run without the
    # throttle)
    throttled, ends = _backward_end(monkeypatch, 2)
    free, _ = _backward_end(monkeypatch, 10**9)
    assert len(ends) > 6
    assert throttled > free
    assert throttled >= ends[-4]  # the last hooks waited for all but the last three
