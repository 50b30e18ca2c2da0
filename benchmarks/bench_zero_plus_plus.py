"""The seeds' question 2 with ZeRO++: ZeRO-3 on one 8-GPU NVLink node against two 4-GPU nodes
over 100 Gb Ethernet, plain and with hpZ (a secondary partition over each node), qwZ (int8
gathers), both, qgZ (int4 gradients by all-to-alls) and all three, at 1 and 4 micro-batches
per step.

    python benchmarks/bench_zero_plus_plus.py [--no-write]

Writes the table block of benchmarks/results/zero_plus_plus.md and zero_plus_plus.csv, with
the planner's closed-form step time (`zsim.plan.estimate`) against the simulated one.
Spec-sheet presets (A100 80 GB); nothing here is fitted to a run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from results_md import write_block, write_csv

from zsim.inputs import presets
from zsim.plan.estimate import Estimator
from zsim.simulation import simulate
from zsim.workload.model_presets import preset
from zsim.workload.parallel import ParallelConfig, ZeroKnobs

RESULTS = Path(__file__).parent / "results"
MODELS = ("gpt-1.3b", "llama-7b")
TOPOLOGIES = ("1x8-nvlink", "2x4-ethernet")
VARIANTS = {
    "ZeRO-3": {},
    "hpZ 4": {"hpz_partition_size": 4},
    "qwZ": {"quantized_weights": True},
    "hpZ 4 + qwZ": {"hpz_partition_size": 4, "quantized_weights": True},
    "qgZ": {"quantized_gradients": True},
    "hpZ 4 + qwZ + qgZ": {
        "hpz_partition_size": 4,
        "quantized_weights": True,
        "quantized_gradients": True,
    },
}


def rows() -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    gpu = presets.gpu("a100-80gb")
    for name in MODELS:
        model = preset(name)
        for topology in TOPOLOGIES:
            topo = presets.topology(topology)
            estimator = Estimator(model, topo, gpu)  # the planner's closed-form tier
            for accum in (1, 4):
                for variant, knobs in VARIANTS.items():
                    cfg = ParallelConfig(
                        dp=8,
                        zero_stage=3,
                        micro_batch=2,
                        grad_accum=accum,
                        knobs=ZeroKnobs(**knobs),
                    )
                    r = simulate(model, cfg, topo, gpu)
                    closed_s = estimator.estimate(cfg).step_s
                    links = r.link_traffic_bytes
                    out.append(
                        {
                            "model": name,
                            "topology": topology,
                            "accum": accum,
                            "variant": variant,
                            "tokens_per_s": r.tokens_per_s,
                            "exposed_s": r.exposed_comm_s,
                            "step_s": r.step_time_s,
                            "closed_form_s": closed_s,
                            "ethernet_GB": links.get("ethernet", 0.0) / 1e9,
                            "memory_GB": r.memory.device_total / 1e9,
                        }
                    )
                    print(name, topology, accum, variant, f"{r.tokens_per_s:,.0f}", file=sys.stderr)
    return out


def table(data: list[dict[str, object]]) -> str:
    lines = [
        "| model | cluster | micro-batches | layout | tokens/s | vs 1x8 NVLink ZeRO-3 "
        "| exposed comm s | bytes across nodes, GB | memory per GPU, GB "
        "| planner's closed form vs simulated |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = {
        (r["model"], r["accum"]): float(r["tokens_per_s"])  # type: ignore[arg-type]
        for r in data
        if r["topology"] == "1x8-nvlink" and r["variant"] == "ZeRO-3"
    }
    for r in data:
        tokens = float(r["tokens_per_s"])  # type: ignore[arg-type]
        lines.append(
            f"| {r['model']} | {r['topology']} | {r['accum']} | {r['variant']} | {tokens:,.0f} "
            f"| {tokens / base[(r['model'], r['accum'])]:.2f} | {r['exposed_s']:.3f} "
            f"| {r['ethernet_GB']:.2f} | {r['memory_GB']:.1f} "
            f"| {float(r['closed_form_s']) / float(r['step_s']) - 1:+.1%} |"  # type: ignore[arg-type]
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    data = rows()
    block = table(data)
    print(block)
    if not args.no_write:
        write_block(RESULTS / "zero_plus_plus.md", block)
        write_csv(RESULTS / "zero_plus_plus.csv", data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
