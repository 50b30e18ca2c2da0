"""The seeds' stage-selection table (seed 000, section 4.1), computed: for each of its rows,
what `plan()` recommends on a matching cluster, beside what the seed recommends.

Each row fixes what the seed's row fixes (a pure data-parallel job has tp = pp = 1; the
Ethernet row lets TP inside a node) and lets the planner choose the rest by throughput.
"""

from __future__ import annotations

from dataclasses import dataclass

from zsim.inputs import presets
from zsim.plan.advice import describe
from zsim.plan.planner import plan
from zsim.plan.space import Space
from zsim.workload.model_presets import preset
from zsim.workload.parallel import ZeroStage


@dataclass(frozen=True)
class Row:
    scenario: str
    seed: str  # the seed's recommendation, in its words (translated)
    model: str
    topology: str
    global_batch: int
    tps: tuple[int, ...] | None
    pps: tuple[int, ...] | None
    seed_stages: tuple[int, ...]  # the stages the seed recommends


# (scenario, the seed's words, model, cluster, global batch, tp, pp, the seed's stages);
# tp = pp = 1 where the seed's row is a data-parallel job
ROWS = tuple(
    Row(*fields)
    for fields in (
        (
            "7B fine-tune, one GPU",
            "ZeRO-2, offload optional",
            "llama-7b",
            "1x1-nvlink",
            8,
            (1,),
            (1,),
            (2,),
        ),
        ("7B, data parallel", "ZeRO-1 or 2", "llama-7b", "1x8-nvlink", 64, (1,), (1,), (1, 2)),
        ("70B, many GPUs", "ZeRO-3 (or FSDP)", "llama-70b", "8x8-dgx-a100", 512, (1,), (1,), (3,)),
        (
            "70B across Ethernet",
            "ZeRO-2, TP in a node",
            "llama-70b",
            "8x8-ethernet",
            128,
            None,
            (1,),
            (2,),
        ),
        ("extreme memory", "ZeRO-3 with offload", "llama-70b", "1x8-nvlink", 32, (1,), (1,), (3,)),
    )
)


@dataclass(frozen=True)
class Answer:
    row: Row
    layout: str  # what zsim recommends, `describe`d ("nothing fits")
    zero_stage: int | None
    tokens_per_s: float | None
    seed_layout: str  # the best layout at the seed's stages
    seed_tokens_per_s: float | None


def answer(row: Row, simulate_top: int = 1) -> Answer:
    """zsim's choice for the row, and the best it finds at the seed's stages."""
    topo = presets.topology(row.topology)
    device = presets.gpu(topo.gpu_model or "a100-80gb")
    model = preset(row.model)
    found = []
    for stages in (tuple(ZeroStage), tuple(ZeroStage(s) for s in row.seed_stages)):
        space = Space(stages=stages, tps=row.tps, pps=row.pps)
        result = plan(model, topo, device, row.global_batch, simulate_top=simulate_top, space=space)
        best = result.ranked[0] if result.ranked else None
        found.append(
            (describe(best.cfg), int(best.cfg.zero_stage), best.tokens_per_s)
            if best
            else ("nothing fits", None, None)
        )
    (layout, stage, rate), (seed_layout, _, seed_rate) = found
    return Answer(row, layout, stage, rate, seed_layout, seed_rate)
