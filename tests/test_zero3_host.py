"""DeepSpeed ZeRO-3's host walks over the data-parallel ranks (`zsim.step.zero3_host`).

Expected values are counted from DeepSpeed 0.19.8's source, not from zsim: the seeds' 8-layer
MLP (8 x Linear(1024, 1024)) under ZeRO-3 keeps its biases gathered (1,024 elements, under
stage3_param_persistence_threshold's 1e5) and gathers its weights. The forward's first module
fetches its own weight alone (`_all_gather_sequential`: no rank walk) and the coordinator then
prefetches the other seven weights in one call (7 M elements, under the 5e7-element
prefetch bucket): one coalesced gather, whose issue makes a view per rank
(`_all_gather_dtype`) and whose first wait makes a view and a cat per rank for each of its
seven parameters (`AllGatherCoalescedHandle.wait`). Nothing is released before the backward
(stage3_max_reuse_distance 1e9), so the backward gathers nothing; its reduce-scatters slice
all 16 gradients per rank (`reduce_scatter_coalesced`).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from zsim.cluster.device import ZERO3_HOST_COSTS
from zsim.inputs import presets
from zsim.plan.estimate import Estimator
from zsim.simulation import simulate
from zsim.step.builder import build_program
from zsim.step.program import Stream
from zsim.workload.mechanisms import Mechanism
from zsim.workload.model import ModelKind, ModelSpec
from zsim.workload.parallel import ParallelConfig

MLP = ModelSpec("toy-mlp", ModelKind.MLP, layers=8, hidden=1024)
COSTS = {"gather_issue": 2e-6, "gather_wait": 3e-6, "reduce": 5e-6}  # seconds per rank
GPU = replace(presets.gpu("a100-80gb"), zero3_rank_host_s=COSTS)
WORLD = 64


def _host(cfg: ParallelConfig) -> dict[str, float]:
    program = build_program(MLP, cfg, GPU, 0)
    out: dict[str, float] = {}
    for t in program.tasks:
        if t.stream is Stream.HOST:
            out[t.name] = out.get(t.name, 0.0) + t.duration_s
    return out


def test_the_host_walks_what_deepspeed_walks() -> None:
    host = _host(ParallelConfig(dp=WORLD, zero_stage=3))
    assert host["host_gather_issue"] == pytest.approx(WORLD * COSTS["gather_issue"])
    assert host["host_gather_wait"] == pytest.approx(7 * WORLD * COSTS["gather_wait"])
    assert host["host_reduce"] == pytest.approx(16 * WORLD * COSTS["reduce"])


def test_each_micro_step_walks_again() -> None:
    host = _host(ParallelConfig(dp=WORLD, zero_stage=3, grad_accum=2))
    assert host["host_reduce"] == pytest.approx(2 * 16 * WORLD * COSTS["reduce"])


@pytest.mark.parametrize(
    "cfg",
    [
        ParallelConfig(dp=WORLD, zero_stage=3, without=frozenset({Mechanism.ZERO3_HOST})),
        ParallelConfig(dp=WORLD, zero_stage=2),  # no gathers; stage 2's reduce walks no ranks
        ParallelConfig(dp=1, tp=2, zero_stage=3),  # a group of one: nothing to walk
    ],
)
def test_no_walk_where_deepspeed_has_none(cfg: ParallelConfig) -> None:
    walks = {f"host_{cost}" for cost in ZERO3_HOST_COSTS}
    assert not walks & set(_host(cfg))


def test_a_host_bound_step_lasts_its_walks() -> None:
    """With walks far longer than the kernels, the step lasts at least the host's work, and
    the planner's closed form keeps that floor (a consistency check of the two tiers)."""
    slow = replace(GPU, zero3_rank_host_s={k: 100 * v for k, v in COSTS.items()})
    topo = presets.topology("8x8-dgx-a100")
    cfg = ParallelConfig(dp=WORLD, zero_stage=3)
    walks = WORLD * 100 * (COSTS["gather_issue"] + 7 * COSTS["gather_wait"] + 16 * COSTS["reduce"])
    walked = simulate(MLP, cfg, topo, slow).step_time_s
    bare = simulate(MLP, replace(cfg, without=frozenset({Mechanism.ZERO3_HOST})), topo, slow)
    assert bare.step_time_s < walks < walked
    assert Estimator(MLP, topo, slow).estimate(cfg).step_s >= walks


def test_cpu_ranks_keep_their_measured_engine_time() -> None:
    """A gloo rank's calibrated engine host time already holds its walks at its world size."""
    cpu = replace(presets.gpu("a100-80gb"), backend="gloo", zero3_rank_host_s=COSTS)
    program = build_program(MLP, ParallelConfig(dp=WORLD, zero_stage=3), cpu, 0, gloo=True)
    assert not [t for t in program.tasks if t.stream is Stream.HOST]


def test_the_gpu_presets_take_the_committed_measurement() -> None:
    """Every built-in GPU charges the per-rank costs `calibration/zero3-host.json` fitted."""
    import json

    from zsim.inputs.files import data_dir

    fitted = json.loads((data_dir("calibration") / "zero3-host.json").read_text())["fit"]
    for name in presets.gpu_names():
        costs = presets.gpu(name).zero3_rank_host_s
        assert costs == {k: v["per_rank_s"] for k, v in fitted.items()}
        assert all(1e-7 < s < 1e-4 for s in costs.values())  # microseconds, as Python is


def test_qgz_on_one_node_reduce_scatters_and_walks_in_both_tiers() -> None:
    """qgZ averages across nodes only (stage3.py: `num_nodes > 1`); on one node the gradients
    are reduce-scattered as plain ZeRO-3, with its walk, in the simulation and the closed form."""
    slow = replace(GPU, zero3_rank_host_s={k: 1e4 * v for k, v in COSTS.items()})
    topo = presets.topology("1x8-nvlink")
    knobs = replace(ParallelConfig().knobs, quantized_gradients=True)
    cfg = ParallelConfig(dp=8, zero_stage=3, knobs=knobs)
    walks = 8 * 1e4 * 16 * COSTS["reduce"]  # the 16 gradients, over 8 ranks
    assert simulate(MLP, cfg, topo, slow).step_time_s > walks
    assert Estimator(MLP, topo, slow).estimate(cfg).step_s > walks
