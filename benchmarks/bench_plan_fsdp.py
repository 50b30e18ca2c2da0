"""How well the planner's closed form for PyTorch FSDP2 (`zsim.plan.fsdp_terms`) agrees with
the simulation, per topology: FSDP layouts of gpt-350m (full, grad-op, hybrid; tp 1 and 2;
recompute none and full; micro-batch up to 4, global batch 32), every second one of them,
at most 14, simulated and estimated.

    python benchmarks/bench_plan_fsdp.py

Writes benchmarks/results/plan_fsdp.md (between its markers) and plan_fsdp.csv.
"""

from __future__ import annotations

from pathlib import Path

from results_md import write_block, write_csv

from zsim.inputs import presets
from zsim.plan.advice import describe
from zsim.plan.agreement import spearman
from zsim.plan.estimate import Estimator
from zsim.plan.space import Space, layouts
from zsim.simulation import simulate
from zsim.workload.model_presets import preset
from zsim.workload.parallel import DpEngine

RESULTS = Path(__file__).parent / "results"
CASES = (("2x4-ib", 8, 4), ("2x4-ethernet", 8, 4), ("2x8-ib", 16, 8))


def main() -> None:
    model, gpu = preset("gpt-350m"), presets.gpu("a100-80gb")
    space = Space(
        max_micro_batch=4,
        recomputes=("none", "full"),  # type: ignore[arg-type]
        engines=(DpEngine.FSDP,),
    )
    rows, lines = (
        [],
        ["| topology | layouts | Spearman | worst error | worst layout |", "|---|---|---|---|---|"],
    )
    for name, world, node in CASES:
        topo = presets.topology(name)
        estimator = Estimator(model, topo, gpu)
        sample = list(layouts(model, world, node, 32, space))[::2][:14]
        pairs = [
            (estimator.estimate(c).step_s, simulate(model, c, topo, gpu).step_time_s)
            for c in sample
        ]
        for c, (closed, simulated) in zip(sample, pairs, strict=True):
            error = 100 * (closed / simulated - 1)
            row = {"topology": name, "layout": describe(c), "closed_form_s": closed}
            rows.append(row | {"simulated_s": simulated, "error_pct": error})
        errors = [abs(a / b - 1) for a, b in pairs]
        worst = max(range(len(errors)), key=errors.__getitem__)
        rho = spearman([a for a, _ in pairs], [b for _, b in pairs])
        cells = [name, str(len(sample)), f"{rho:.3f}", f"{100 * errors[worst]:.1f} %"]
        lines.append("| " + " | ".join([*cells, describe(sample[worst])]) + " |")
        print(lines[-1], flush=True)
    write_csv(RESULTS / "plan_fsdp.csv", rows)
    write_block(RESULTS / "plan_fsdp.md", "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
