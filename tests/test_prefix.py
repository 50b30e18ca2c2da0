"""The prefix (zsim.step.prefix): compute timed as a longest path, sends issued on the engine's
own network in time order, then handed over to the event loop at the first collective. A
consistency check between two ways of running the same model: on every network scenario of
tests/golden/network_scenarios.py (pipelines with sends sharing NICs, rails, oversubscribed fat
trees, stragglers with every rank simulated, ZeRO-3, offload, gloo), the step with the prefix
gives the spans, fused passes, traffic and bytes per link class of the step run wholly on the
event loop (the engine before the prefix existed, whose answers the golden files hold). Also:
the prefix does take over a pipeline's steady state, also where its sends crowd a link."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import pytest

from tests.golden.network_scenarios import SCENARIOS
from tests.golden.record_network import inputs
from zsim.simulation import Report, simulate
from zsim.step import engine as engine_module
from zsim.step import prefix as prefix_module
from zsim.step.prefix import Prefix
from zsim.step.trace import RankTimes

T = TypeVar("T")


def _run(name: str) -> Report:
    s = SCENARIOS[name]
    model, cfg, topo, device = inputs(s)
    # spans are compared: every micro-batch simulated
    return simulate(
        model, cfg, topo, device, full=s.full, stragglers=s.stragglers or None, fold=False
    )


def _event_loop_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_module, "time_prefix", lambda _engine: Prefix())


def _spans(report: Report) -> list[tuple[object, ...]]:
    return sorted((s.rank, s.stream, s.name, s.start_s, s.end_s) for s in report.engine.all_spans())


@pytest.mark.consistency
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_the_prefix_gives_the_event_loops_step(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    fast = _run(name)
    _event_loop_only(monkeypatch)
    slow = _run(name)
    assert fast.step_time_s == pytest.approx(slow.step_time_s, rel=1e-12)
    assert fast.link_traffic_bytes == pytest.approx(slow.link_traffic_bytes, rel=1e-12)
    assert fast.traffic_bytes_per_gpu == pytest.approx(slow.traffic_bytes_per_gpu, rel=1e-12)
    got, want = _spans(fast), _spans(slow)
    assert [g[:3] for g in got] == [w[:3] for w in want]  # the same tasks, ...
    for g, w in zip(got, want, strict=True):  # ... at the same times
        assert g[3:] == pytest.approx(w[3:], rel=1e-12, abs=1e-15)
    for f, s in zip(fast.stages, slow.stages, strict=True):  # read from the prefix's columns
        assert _breakdown(f) == pytest.approx(_breakdown(s), rel=1e-12, abs=1e-15)
        assert f.exposed_by_category == pytest.approx(s.exposed_by_category, rel=1e-12, abs=1e-15)


def _breakdown(times: RankTimes) -> tuple[float, ...]:
    return (times.compute_s, times.exposed_comm_s, times.idle_s, times.comm_total_s, times.end_s)


def _at_the_cut(
    name: str, monkeypatch: pytest.MonkeyPatch, read: Callable[[engine_module.Engine, Prefix], T]
) -> T:
    """What `read` sees of the engine and its prefix when the prefix hands over (the first
    simulation of scenario `name`)."""
    seen: list[T] = []
    real = prefix_module.time_prefix

    def reading(engine: engine_module.Engine) -> Prefix:
        found = real(engine)
        seen.append(read(engine, found))
        return found

    monkeypatch.setattr(engine_module, "time_prefix", reading)
    _run(name)
    return seen[0]


@pytest.mark.parametrize(
    ("name", "share"),
    [
        ("dgx-2x8-tp8-pp2", 0.65),
        ("ib-4x4-pp4-deepspeed", 0.8),
        ("full-straggler-eth-z2", 0.8),
        ("full-straggler-ib-pp2", 0.8),
    ],
)
def test_a_pipelines_steady_state_is_the_prefixs(
    name: str, share: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Most tasks of a pipeline's step (and of a data-parallel step with accumulation) start
    before its first collective. (The 1.3B at tp 8 x pp 2 runs 29 of its 42 tasks so: since
    DeepSpeed's gradient copies at dp 1 are modelled, two of them follow the tied embeddings'
    all-reduce.)"""

    def ran_and_tasks(engine: engine_module.Engine, found: Prefix) -> tuple[int, int]:
        tasks = sum(len(engine.programs[engine.coords(r)[1]].tasks) for r in engine.ranks)
        return sum(len(found.ran_indices(r)) for r in engine.ranks), tasks

    ran, tasks = _at_the_cut(name, monkeypatch, ran_and_tasks)
    assert ran >= share * tasks


def test_sends_that_crowd_a_link_share_it_inside_the_prefix(monkeypatch: pytest.MonkeyPatch):
    """The straggler's pipeline on InfiniBand: its sends meet on links as flows whose rates the
    network re-solves, before the first collective (so the prefix keeps going past them)."""
    recomputed = _at_the_cut(
        "full-straggler-ib-pp2", monkeypatch, lambda e, _p: e.comms.network.recomputations
    )
    assert recomputed > 0
