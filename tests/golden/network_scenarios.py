"""Scenarios where the flow-by-flow network simulation still runs, for the speed work of issue
13: contention between TP, DP and PP traffic on shared NICs, oversubscribed fat trees, rails,
every rank simulated with a straggler, ZeRO-3 prefetch, offload, gloo on the CPU topologies.

`network_outputs.json` records, from the flow-by-flow code before that work: each scenario's
step time as simulated (symmetric ranks unless `full`), and the bytes each link class carried in
the step, every rank simulated and every flow on the network (no fused passes), summed over the
directed links of the class. A faster network must give the same step time within 0.1 % and
the same bytes per link class.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).parent.parent.parent
DATA = ROOT / "tests" / "data"
CAL = ROOT / "calibration"


@dataclass(frozen=True)
class NetScenario:
    topology: str
    model: str
    layout: dict[str, Any]
    model_overrides: dict[str, int] = field(default_factory=dict)
    profile: str = ""  # a calibration file under calibration/, else the topology's GPU preset
    full: bool = False
    stragglers: dict[int, float] = field(default_factory=dict)


def _s(topology: str, model: str, **layout: Any) -> NetScenario:
    extra = {k: layout.pop(k) for k in ("full", "stragglers", "profile") if k in layout}
    shape = layout.pop("shape", {})
    return NetScenario(topology, model, layout, shape, **extra)


_MLP = {"hidden": 1024}
SCENARIOS: dict[str, NetScenario] = {
    **{
        f"eth-2x4-z{s}": _s("2x4-ethernet", "gpt-350m", dp=8, zero_stage=s, micro_batch=2)
        for s in range(4)
    },
    "eth-2x4-z3-prefetch": _s(
        "2x4-ethernet",
        "gpt-350m",
        dp=8,
        zero_stage=3,
        micro_batch=2,
        knobs={"prefetch_bucket_size": 20_000_000, "max_reuse_distance": 1},
    ),
    "eth-2x4-z2-accum3-overlap": _s(
        "2x4-ethernet",
        "gpt-125m",
        dp=8,
        zero_stage=2,
        micro_batch=2,
        grad_accum=3,
        knobs={"overlap_comm": True},
    ),
    "eth-2x4-tp2-z1": _s("2x4-ethernet", "gpt-350m", dp=4, tp=2, zero_stage=1, micro_batch=2),
    "ib-4x4-z2": _s("4x4-ib", "gpt-350m", dp=16, zero_stage=2, micro_batch=1),
    "ib-4x4-tp2-pp2-dp4-megatron": _s(
        "4x4-ib",
        "gpt-350m",
        dp=4,
        tp=2,
        pp=2,
        zero_stage=1,
        micro_batch=1,
        grad_accum=4,
        pipeline_engine="megatron",
    ),
    "ib-4x4-pp4-deepspeed": _s(
        "4x4-ib", "gpt-350m", dp=4, pp=4, micro_batch=1, grad_accum=6, zero_stage=1
    ),
    "ib-8x1-z3": _s("8x1-ib", "gpt-125m", dp=8, zero_stage=3, micro_batch=2),
    "oversub-z2": _s(
        str(DATA / "fat-tree-oversub.yaml"), "gpt-350m", dp=32, zero_stage=2, micro_batch=1
    ),
    "oversub-z3": _s(
        str(DATA / "fat-tree-oversub.yaml"), "gpt-125m", dp=32, zero_stage=3, micro_batch=1
    ),
    "oversub-tp4-pp2-dp4": _s(
        str(DATA / "fat-tree-oversub.yaml"),
        "gpt-350m",
        dp=4,
        tp=4,
        pp=2,
        micro_batch=1,
        grad_accum=4,
        pipeline_engine="megatron",
    ),
    "rails-z3": _s(str(DATA / "rails-4x4.yaml"), "gpt-350m", dp=16, zero_stage=3, micro_batch=1),
    "rails-tp4-dp4-z1": _s(
        str(DATA / "rails-4x4.yaml"), "gpt-1.3b", dp=4, tp=4, zero_stage=1, micro_batch=1
    ),
    "rails-interleaved": _s(
        str(DATA / "rails-4x4.yaml"),
        "gpt-350m",
        dp=2,
        tp=2,
        pp=4,
        micro_batch=1,
        grad_accum=8,
        pipeline_engine="megatron",
        pp_schedule="interleaved",
        virtual_stages=2,
        sequence_parallel=True,
    ),
    "dgx-2x8-tp8-pp2": _s(
        "2x8-dgx-a100",
        "gpt-1.3b",
        dp=1,
        tp=8,
        pp=2,
        micro_batch=1,
        grad_accum=4,
        pipeline_engine="megatron",
    ),
    "roce-2x8-llama-z3": _s("2x8-roce", "llama-7b", dp=16, zero_stage=3, micro_batch=1),
    "full-straggler-eth-z2": _s(
        "2x4-ethernet",
        "gpt-125m",
        dp=8,
        zero_stage=2,
        micro_batch=2,
        full=True,
        stragglers={3: 1.2},
    ),
    "full-straggler-ib-pp2": _s(
        "4x4-ib",
        "gpt-125m",
        dp=8,
        pp=2,
        zero_stage=1,
        micro_batch=1,
        grad_accum=4,
        full=True,
        stragglers={5: 1.5},
    ),
    "full-oversub-z3": _s(
        str(DATA / "fat-tree-oversub.yaml"),
        "gpt-125m",
        dp=32,
        zero_stage=3,
        micro_batch=1,
        full=True,
    ),
    "cpu-1x2-offload-z3": _s(
        "1x2-cpu",
        "toy-mlp",
        dp=2,
        zero_stage=3,
        micro_batch=4,
        precision="fp32",
        offload="optimizer+params",
        profile="cpu-2rank",
        shape=_MLP,
    ),
    "cpu-1x4-z2": _s(
        "1x4-cpu",
        "toy-mlp",
        dp=4,
        zero_stage=2,
        micro_batch=4,
        precision="fp32",
        profile="cpu-4rank",
        shape=_MLP,
    ),
    "cpu-2x2-emulated-z3": _s(
        "2x2-cpu-1000mbit",
        "toy-mlp",
        dp=4,
        zero_stage=3,
        micro_batch=4,
        precision="fp32",
        profile="cpu-2x2-1gbit",
        shape=_MLP,
    ),
    "cpu-2x4-emulated-z1": _s(
        "2x4-cpu-1000mbit",
        "toy-mlp",
        dp=8,
        zero_stage=1,
        micro_batch=4,
        precision="fp32",
        profile="cpu-2x4-1gbit",
        shape=_MLP,
    ),
}
