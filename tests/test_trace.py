"""Interval arithmetic behind compute / exposed-communication / idle, against brute force."""

import random

import pytest

from zsim.step.trace import uncovered, union_length


def brute(intervals, cover, step=0.001):
    ts = [i * step + step / 2 for i in range(int(10 / step))]
    inside = lambda t, xs: any(a <= t < b for a, b in xs)  # noqa: E731
    return sum(step for t in ts if inside(t, intervals) and not inside(t, cover))


@pytest.mark.parametrize("seed", range(5))
def test_uncovered_matches_brute_force(seed):
    rng = random.Random(seed)
    spans = [(a, a + rng.uniform(0, 1)) for a in (rng.uniform(0, 9) for _ in range(12))]
    cover = [(a, a + rng.uniform(0, 2)) for a in (rng.uniform(0, 8) for _ in range(8))]
    assert uncovered(spans, cover) == pytest.approx(brute(spans, cover), abs=0.02)
    assert union_length(spans) == pytest.approx(brute(spans, []), abs=0.02)


def test_a_pipeline_trace_shows_every_pass_and_the_kernels_of_the_first_of_each_kind():
    # 2 stages x 8 micro-batches, passes fused (TP inside a DGX, PP across): each rank runs 8
    # forward and 8 backward passes of its one chunk, all alike, so the trace has 2 x 16 pass events
    # and the kernels and TP collectives of one forward and one backward per rank (1/8 of all
    # the parts simulated); every pipeline send and receive is kept
    from zsim.inputs import presets
    from zsim.simulation import simulate
    from zsim.step.trace import chrome_trace
    from zsim.workload.model_presets import preset
    from zsim.workload.parallel import ParallelConfig

    cfg = ParallelConfig(dp=1, tp=8, pp=2, micro_batch=1, grad_accum=8, pipeline_engine="megatron")
    topo, gpu = presets.topology("2x8-dgx-a100"), presets.gpu("a100-80gb")
    report = simulate(preset("gpt-125m"), cfg, topo, gpu)
    events = chrome_trace(report.engine.spans, report.engine.passes)["traceEvents"]
    passes = [e for e in events if "parts" in e.get("args", {})]
    assert len(passes) == 2 * 16
    simulated_tp = [s for s in report.engine.all_spans() if s.category == "tp_comm"]
    traced_tp = [e for e in events if e.get("cat") == "tp_comm"]
    assert len(simulated_tp) > 0
    assert len(traced_tp) * 8 == len(simulated_tp)
    sends = [s for s in report.engine.spans if s.category == "pp_comm"]
    assert len([e for e in events if e.get("cat") == "pp_comm"]) == len(sends)
