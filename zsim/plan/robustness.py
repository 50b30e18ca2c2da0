"""Whether a plan's ranking holds if the network delivers less than zsim models.

zsim's step times are short of published runs more often than not
(`benchmarks/results/reference_runs.md`), and the network is what a planner user knows least
before the cluster is rented (congestion, placement, the NCCL version, the fabric's real
rate). Layouts differ in how much of their step is communication: one that wins by a hair at
the modelled link rates can lose to one that hardly communicates. So the planner
re-estimates the layouts it shows on the same cluster with every link slower
(`cluster.topology.with_slower_links`): the closed form's relative growth of each step,
applied to the step shown (simulated where it was). A what-if, not a prediction: the factor
is the user's (`zsim plan --slower-links`), not a measured constant.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from zsim.cluster.device import DeviceProfile
from zsim.cluster.topology import Topology, with_slower_links
from zsim.plan.estimate import Estimator
from zsim.plan.planner import Candidate
from zsim.workload.model import ModelSpec

SLOWER_LINKS = 2.0
"""The default what-if: every link at half its modelled bandwidth."""


@dataclass(frozen=True)
class LinkStress:
    factor: float
    growth: tuple[float, ...]  # each layout's step at the slower links over at the modelled
    steps: tuple[float, ...]  # the steps shown, grown so

    @property
    def first(self) -> int:
        """The layout fastest at the slower links (an index into the shown ones)."""
        return min(range(len(self.steps)), key=self.steps.__getitem__)


def link_stress(
    model: ModelSpec,
    topology: Topology,
    device: DeviceProfile,
    shown: Sequence[Candidate],
    factor: float = SLOWER_LINKS,
) -> LinkStress:
    """Each shown layout's step with every link at 1 / `factor` of its bandwidth: its step
    (simulated where it was) times the closed form's growth from its estimate at the modelled
    links to the slower."""
    slower = Estimator(model, with_slower_links(topology, factor), device)
    growth = tuple(slower.estimate(c.cfg).step_s / c.estimate.step_s for c in shown)
    steps = tuple(c.step_s * g for c, g in zip(shown, growth, strict=True))
    return LinkStress(factor, growth, steps)


def stress_note(stress: LinkStress, shown: Sequence[float]) -> str:
    """What the what-if says of the winner, in one line (`shown`: the steps as ranked)."""
    at = f"with every link at 1/{stress.factor:g} of its bandwidth (closed form)"
    win, j = stress.growth[0] - 1, stress.first
    if j == 0:
        return f"{at.capitalize()}: #1 stays first among these, its step +{win:.0%}."
    lead = shown[j] / shown[0] - 1
    ahead = stress.steps[0] / stress.steps[j] - 1
    return (
        f"{at.capitalize()}: #{j + 1} would be first, {ahead:.1%} ahead of #1 (its step "
        f"+{stress.growth[j] - 1:.0%}, #1's +{win:.0%}); at the modelled rates #1 leads it by "
        f"{lead:.1%}. Where the network is unproven, #{j + 1} is the safer pick."
    )
