"""`plan()`: every layout the cluster allows, the ones that fit, ranked.

Two tiers: each layout's memory ledger (`zsim.memory`, the same one `zsim memory` prints)
drops what does not fit, the closed-form tier (`zsim.plan.estimate`) orders the rest, and the
discrete-event simulation (`zsim.simulation.simulate`) times the best of them, and any next one
whose closed form still beats the best time simulated (up to twice as many), which are then
ranked by what it says.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import StrEnum

from zsim.cluster.device import DeviceProfile
from zsim.cluster.topology import Topology
from zsim.errors import require
from zsim.memory import MemoryLedger, overflow_bytes, peak_ledger
from zsim.plan.estimate import Estimate, Estimator
from zsim.plan.space import Space, layouts
from zsim.simulation import Report, simulate
from zsim.workload.model import ModelSpec
from zsim.workload.parallel import ParallelConfig, Recompute

EVERYTHING = Space()


class Objective(StrEnum):
    THROUGHPUT = "throughput"  # the most tokens per second
    MEMORY = "memory"  # the least memory per GPU (then the most tokens per second)


@dataclass(frozen=True)
class Candidate:
    cfg: ParallelConfig
    memory: MemoryLedger
    memory_stage: int  # the pipeline stage whose ledger is the peak
    estimate: Estimate
    report: Report | None = None  # the simulation's, for the best candidates

    @property
    def step_s(self) -> float:
        return self.report.step_time_s if self.report else self.estimate.step_s

    @property
    def tokens_per_s(self) -> float:
        return self.report.tokens_per_s if self.report else self.estimate.tokens_per_s


@dataclass(frozen=True)
class Miss:
    """A layout that does not fit: by how much, and its largest category."""

    cfg: ParallelConfig
    memory: MemoryLedger
    over_bytes: float
    largest: str


@dataclass
class Plan:
    ranked: list[Candidate]  # fitting layouts, best first (simulated ones ranked by it)
    misses: list[Miss]  # the closest misses first
    layouts: int
    seconds: float
    usable_bytes: float
    simulated: int = 0
    notes: list[str] = field(default_factory=list)


def plan(
    model: ModelSpec,
    topology: Topology,
    device: DeviceProfile,
    global_batch: int,
    objective: Objective = Objective.THROUGHPUT,
    simulate_top: int = 5,
    space: Space = EVERYTHING,
    progress: Callable[[str, int, int], None] | None = None,
) -> Plan:
    """Every layout of `model` on `topology` at `global_batch`, ranked by `objective`."""
    require(simulate_top >= 0, "simulate", simulate_top, "a count >= 0")
    objective = Objective(objective)
    start = time.perf_counter()
    estimator = Estimator(model, topology, device)
    gpus_per_node = topology.gpus_per_node
    fitting, misses, count = [], [], 0
    for cfg in layouts(model, topology.world_size, gpus_per_node, global_batch, space):
        count += 1
        stage, ledger = peak_ledger(model, cfg)
        over = overflow_bytes(ledger, device)
        if over > 0:
            host = ledger.host_offloaded - device.host_memory_bytes >= over > 0
            misses.append(Miss(cfg, ledger, over, "host_offloaded" if host else _largest(ledger)))
        else:
            fitting.append(Candidate(cfg, ledger, stage, estimator.estimate(cfg)))
        if progress and count % 500 == 0:
            progress("closed form", count, 0)
    fitting = _distinct(sorted(fitting, key=_order(objective)))
    misses.sort(key=lambda m: m.over_bytes)
    order = _order(objective)

    def run(i: int, cfg: ParallelConfig) -> Report:
        if progress:
            progress("simulating", i, max(simulate_top, i + 1))
        return simulate(model, cfg, topology, device)

    top = _simulate_best(fitting, order, simulate_top, run)
    ranked = sorted(top, key=order) + fitting[len(top) :]
    result = Plan(ranked, misses[:20], count, 0.0, device.usable_bytes, len(top))
    result.seconds = time.perf_counter() - start
    return result


def _simulate_best(
    fitting: list[Candidate],
    order: Callable[[Candidate], tuple[float, ...]],
    count: int,
    run: Callable[[int, ParallelConfig], Report],
) -> list[Candidate]:
    """The best `count` by the closed form simulated, then each next one whose estimate still
    beats the best simulated (the closed form errs both ways: `benchmarks/results/plan.md`),
    up to `count` more."""
    top: list[Candidate] = []
    for i, candidate in enumerate(fitting[: 2 * count]):
        if i >= count and order(candidate) >= min(map(order, top)):
            break
        top.append(replace(candidate, report=run(i, candidate.cfg)))
    return top


def _order(objective: Objective) -> Callable[[Candidate], tuple[float, ...]]:
    """Best first; among equals the smaller layout, then the simpler (no SP, fewer chunks).
    For throughput less recompute comes before smaller: where the closed form hides a replay
    behind communication it cannot tell the two apart, and the one doing less work is not
    slower."""

    def replay(c: Candidate) -> int:
        return list(Recompute).index(c.cfg.recompute)

    def simpler(c: Candidate) -> tuple[float, ...]:
        return (c.cfg.sequence_parallel, c.cfg.virtual_stages)

    if objective is Objective.MEMORY:
        return lambda c: (c.memory.device_total, -c.tokens_per_s, replay(c), *simpler(c))
    return lambda c: (-c.tokens_per_s, replay(c), c.memory.device_total, *simpler(c))


def _distinct(ranked: list[Candidate]) -> list[Candidate]:
    """Drop a layout that predicts the very same step and memory as a simpler one ranked
    before it (selective recompute with flash attention saves nothing flash does not)."""
    kept: list[Candidate] = []
    seen: set[tuple[object, ...]] = set()
    for c in ranked:
        k = c.cfg
        twin: tuple[object, ...] = (k.dp, k.tp, k.pp, k.cp, k.zero_stage, k.offload, k.dp_engine)
        twin += (k.micro_batch,)
        twin += (
            k.pp_schedule,
            k.virtual_stages,
            k.pipeline_engine,
            c.estimate.step_s,
            c.memory.device_total,
        )
        if twin not in seen:
            seen.add(twin)
            kept.append(c)
    return kept


def _largest(ledger: MemoryLedger) -> str:
    totals = ("model_states", "device_total", "host_offloaded")
    parts = {k: v for k, v in ledger.as_dict().items() if k not in totals}
    return max(parts, key=lambda k: parts[k] or 0.0)
