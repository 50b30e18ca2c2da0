"""The planner's speed, and how well its closed-form tier agrees with the simulation.

    python benchmarks/bench_plan.py [--quick] [--no-write]

(a) the closed-form tier's rate, layouts per second: the time estimate alone, and with each
    layout's memory ledger, over every layout of gpt-175b on 1,024 A100s (global batch 1,536)
    and of llama-70b on 64 H100s (global batch 1,024);
(b) a whole `plan()` of gpt-175b on 1,024 GPUs: every layout, the best 5 simulated (and up
    to 5 more whose closed form still beats the best simulated step);
(c) agreement on 10 plans of smaller models and clusters: in each, the 10 best layouts by the
    closed form and 10 others drawn evenly from the rest that fit are simulated; the Spearman
    rank correlation of the two tiers' step times over all of them, and in how many plans
    both tiers choose the same winner among them.

Times are also given as ratios to a reference operation timed in the same run (bench_step_speed's:
Python sorting a million floats since 2026-12-06, numpy sorting 2 million before), because
this machine is shared. Writes
benchmarks/results/plan.md (between its markers) and plan_agreement.csv.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from bench_step_speed import reference_s
from results_md import write_block, write_csv

from zsim.inputs import presets
from zsim.inputs.scenario import build_model
from zsim.memory import peak_ledger
from zsim.plan.agreement import spearman
from zsim.plan.estimate import Estimator
from zsim.plan.planner import plan
from zsim.plan.robustness import link_stress, stress_note
from zsim.plan.space import Space, layouts
from zsim.simulation import simulate
from zsim.workload.model_presets import preset
from zsim.workload.parallel import DpEngine

RESULTS = Path(__file__).resolve().parent / "results"
SPACES = [("gpt-175b", "128x8-dgx-a100", 1536), ("llama-70b", "8x8-dgx-h100", 1024)]
PLANS = [
    ("gpt-350m", "1x8-nvlink", 64),
    ("gpt-760m", "2x4-ethernet", 64),
    ("gpt-1.3b", "2x8-dgx-a100", 128),
    ("gpt-1.3b", "4x8-ethernet", 128),
    ("gpt-2.7b", "2x4-ib", 64),
    ("gpt-2.7b", "1x8-nvlink", 32),
    ("llama-7b", "2x8-dgx-h100", 128),
    ("llama-7b", "4x8-ethernet", 64),
    ("gpt-6.7b", "4x8-roce", 256),
    ("gpt-13b", "4x8-dgx-a100", 128),
]


def device_of(topology: object) -> object:
    return presets.gpu(topology.gpu_model or "a100-80gb")  # type: ignore[attr-defined]


def closed_form_rate(name: str, cluster: str, batch: int) -> list[str]:
    """Layouts per second of the time estimate over a whole space: from a fresh estimator (its
    pass templates and collective lines computed on the way), then again (only what differs
    per layout); and with each layout's memory ledger."""
    model, topo = preset(name), presets.topology(cluster)
    device = device_of(topo)
    space = list(layouts(model, topo.world_size, topo.gpus_per_node, batch))
    ref = reference_s()
    estimator = Estimator(model, topo, device)  # type: ignore[arg-type]
    rates = []
    for _ in range(2):
        start = time.perf_counter()
        for cfg in space:
            estimator.estimate(cfg)
        rates.append(time.perf_counter() - start)
    start = time.perf_counter()
    for cfg in space:
        peak_ledger(model, cfg)
    ledger_s = time.perf_counter() - start
    n = len(space)
    return [
        f"| {name} on {cluster}, batch {batch} | {n:,} | {n / rates[0]:,.0f} | {n / rates[1]:,.0f} "
        f"| {n / (rates[0] + ledger_s):,.0f} | {rates[0] / ref:.1f} |"
    ]


def whole_plan() -> list[str]:
    model, topo = preset("gpt-175b"), presets.topology("128x8-dgx-a100")
    ref = reference_s()
    start = time.perf_counter()
    result = plan(model, topo, device_of(topo), 1536, simulate_top=5)  # type: ignore[arg-type]
    wall = time.perf_counter() - start
    best = result.ranked[0]
    shown = result.ranked[:5]
    stress = link_stress(model, topo, device_of(topo), shown)  # type: ignore[arg-type]
    return [
        f"Whole plan, gpt-175b on 128x8-dgx-a100, global batch 1,536: {result.layouts:,} "
        f"layouts, {len(result.ranked):,} fit, {result.simulated} simulated, **{wall:.1f} s** "
        f"({wall / ref:.0f}x the reference). Winner: step {best.step_s:.2f} s, "
        f"{best.tokens_per_s:,.0f} tokens/s. The what-if of `zsim plan` over its best 5: "
        + stress_note(stress, [c.step_s for c in shown]),
    ]


# (d) Megatron-Core's layouts (`--engine megatron`): long sequences, context parallelism
MEGATRON_PLANS = [
    ("llama-7b", 8192, "1x8-dgx-h100", 32),
    ("llama-7b", 16384, "2x8-dgx-h100", 64),
    ("llama-13b", 16384, "4x8-dgx-h100", 64),
]
MEGATRON_SPACE = Space(engines=(DpEngine.MEGATRON,), cps=(1, 2, 4))


def agreement(quick: bool, megatron: bool = False) -> tuple[list[str], list[dict[str, object]]]:
    rows: list[dict[str, object]] = []
    same = 0
    if megatron:
        plans = [(f"{n}:seq-len={s}", c, b) for n, s, c, b in MEGATRON_PLANS]
    else:
        plans = PLANS[:3] if quick else PLANS
    space = MEGATRON_SPACE if megatron else Space()
    for name, cluster, batch in plans:
        model, topo = build_model(name), presets.topology(cluster)
        device = device_of(topo)
        result = plan(model, topo, device, batch, simulate_top=0, space=space)  # type: ignore[arg-type]
        rest = result.ranked[10:]
        step = max(1, len(rest) // 10)
        chosen = result.ranked[:10] + rest[::step][:10]
        mine = []
        for c in chosen:
            simulated = simulate(model, c.cfg, topo, device).step_time_s  # type: ignore[arg-type]
            mine.append((c.estimate.step_s, simulated))
            rows.append(
                {"plan": f"{name} {cluster} {batch}", "layout": _layout(c.cfg)}
                | {"closed_form_s": c.estimate.step_s, "simulated_s": simulated}
            )
        winner_closed = min(range(len(mine)), key=lambda i: mine[i][0])
        winner_simulated = min(range(len(mine)), key=lambda i: mine[i][1])
        same += winner_closed == winner_simulated
        agreed = winner_closed == winner_simulated
        print(f"{name} {cluster}: {len(mine)} layouts, same winner {agreed}", file=sys.stderr)
    closed = [float(r["closed_form_s"]) for r in rows]  # type: ignore[arg-type]
    simulated = [float(r["simulated_s"]) for r in rows]  # type: ignore[arg-type]
    errors = [c / s - 1 for c, s in zip(closed, simulated, strict=True)]
    lines = [
        f"{len(rows)} layouts from {len(plans)} plans: Spearman rank correlation "
        f"**{spearman(closed, simulated):.3f}**; the same winner in **{same} of {len(plans)}** "
        f"plans; closed form / simulation - 1: median {statistics.median(errors):+.1%}, "
        f"from {min(errors):+.1%} to {max(errors):+.1%}.",
    ]
    return lines, rows


def megatron_agreement(no_write: bool) -> int:
    """(d): the two tiers on Megatron-Core's layouts, written to plan_megatron.md."""
    agree, rows = agreement(False, megatron=True)
    block = "\n".join(["### (d) the two tiers on Megatron-Core's layouts", "", *agree]) + "\n"
    print(block)
    if not no_write:
        write_block(RESULTS / "plan_megatron.md", block)
        write_csv(RESULTS / "plan_megatron_agreement.csv", rows)
    return 0


def _layout(cfg: object) -> str:
    from zsim.plan.advice import describe

    return describe(cfg)  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--megatron", action="store_true", help="(d) only: plan_megatron.md")
    args = parser.parse_args(argv)
    if args.megatron:
        return megatron_agreement(args.no_write)
    lines = [
        "### (a) closed-form tier",
        "",
        "| space | layouts | estimates per s, fresh | again | fresh, with memory ledgers "
        "| fresh / reference |",
        "|---|---|---|---|---|---|",
    ]
    for space in SPACES[:1] if args.quick else SPACES:
        lines += closed_form_rate(*space)
        print(lines[-1], file=sys.stderr, flush=True)
    if not args.quick:
        lines += ["", "### (b) a whole plan", "", *whole_plan()]
    agree, rows = agreement(args.quick)
    lines += ["", "### (c) the two tiers", "", *agree]
    block = "\n".join(lines) + "\n"
    print(block)
    if not args.no_write:
        write_block(RESULTS / "plan.md", block)
        write_csv(RESULTS / "plan_agreement.csv", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
