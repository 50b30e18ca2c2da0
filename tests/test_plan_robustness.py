"""zsim plan's what-if of slower links (`zsim.plan.robustness`): what it must mean physically,
and what its note says, worked by hand."""

from __future__ import annotations

import json

import pytest

from zsim.cli import main
from zsim.cluster.topology import with_slower_links
from zsim.inputs import presets
from zsim.network.collective import CollectiveOp
from zsim.plan.estimate import Estimator
from zsim.plan.planner import plan
from zsim.plan.robustness import LinkStress, link_stress, stress_note
from zsim.workload.model_presets import preset


def test_a_bandwidth_bound_collective_takes_twice_as_long_on_half_the_bandwidth():
    # a 4 GB all-reduce over two nodes is bandwidth-bound (its latency is microseconds
    # against a second): at half of every link's bandwidth it takes twice as long
    topo, device, model = (
        presets.topology("2x4-ethernet"),
        presets.gpu("a100-80gb"),
        preset("gpt-125m"),
    )
    group = tuple(range(8))
    times = []
    for factor in (1.0, 2.0):
        estimator = Estimator(model, with_slower_links(topo, factor), device)
        times.append(estimator.collective_s(CollectiveOp.ALL_REDUCE, 4e9, group))
    assert times[1] == pytest.approx(2 * times[0], rel=0.01)


def test_a_layout_on_one_gpu_sends_nothing_so_slower_links_leave_it_alone():
    model, topo = preset("gpt-125m"), presets.topology("1x1-nvlink")
    device = presets.gpu("a100-80gb")
    shown = plan(model, topo, device, 8, simulate_top=1).ranked[:3]
    stress = link_stress(model, topo, device, shown, 4.0)
    assert stress.growth == (1.0,) * len(shown)
    assert stress.steps == tuple(c.step_s for c in shown)


def test_the_note_names_the_layout_that_wins_on_slower_links():
    # shown: #1 1.00 s, #2 1.01 s; on slower links #1 grows by 10 %, #2 by 2 %:
    # 1.100 s against 1.0302 s, so #2 is first, #1 1.100 / 1.0302 - 1 = 6.8 % behind it
    stress = LinkStress(2.0, (1.10, 1.02), (1.10, 1.01 * 1.02))
    note = stress_note(stress, [1.00, 1.01])
    assert "#2 would be first, 6.8% ahead of #1" in note
    assert "#1 leads it by 1.0%" in note
    assert "(its step +2%, #1's +10%)" in note


def test_the_note_says_when_the_winner_holds():
    stress = LinkStress(2.0, (1.03, 1.20), (1.03, 1.5 * 1.20))
    assert "#1 stays first among these, its step +3%" in stress_note(stress, [1.0, 1.5])


BASE = ["plan", "--model", "gpt-125m", "--topology", "2x4-ethernet", "--global-batch", "32"]


def test_the_plan_shows_each_layouts_growth_unless_asked_not_to(capsys):
    assert main([*BASE, "--simulate", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert all(r["slower_links_factor"] == 2.0 for r in out["ranked"])
    assert all(r["slower_links_growth"] >= 0.0 for r in out["ranked"])
    assert "1/2 of its bandwidth" in out["notes"][-1]
    assert main([*BASE, "--simulate", "1", "--json", "--slower-links", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert not any("slower_links_growth" in r for r in out["ranked"])
    assert not any("bandwidth (closed form)" in n for n in out["notes"])


@pytest.mark.parametrize("value", ["0.5", "fast", "inf"])
def test_a_factor_below_one_or_not_finite_is_one_line(capsys, value):
    assert main([*BASE, "--slower-links", value]) == 2
    err = capsys.readouterr().err
    assert f"slower_links={value!r}" in err
    assert err.count("\n") == 1
