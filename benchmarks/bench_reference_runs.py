"""Accuracy: zsim's predicted step time against published end-to-end training runs.

    python benchmarks/bench_reference_runs.py [--max-rows 40] [--jobs 2] [--files megatron,...]

Reads the reference runs copied into benchmarks/reference/ (public data, each row names its
source; see benchmarks/reference/README.md), maps every row it can into a zsim scenario
(model shape, parallel layout, ZeRO stage, recompute, precision, cluster), simulates one step
with spec-sheet GPU presets (no calibration, nothing fitted to these rows) and compares the
step time. Writes benchmarks/results/reference_runs.csv (one line per row, mapped or skipped)
and the tables of benchmarks/results/reference_runs.md (between its table markers; the
hand-written method and diagnosis around them are kept).

Every comparison is made on the step time. A row that reports throughput (tokens/s,
samples/s) is converted with its own batch; a row that reports only TFLOP/s is converted
with the FLOP formula its source used (Narayanan et al. 2021), never with zsim's.
The end-to-end runs are for checking only: no constant in zsim is tuned to them.
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import replace
from functools import cache
from pathlib import Path
from typing import Any

from reference_ablation import ablation_table, plot
from reference_mapping import (
    CSV_OUT,
    FILES,
    MD_OUT,
    REFERENCE,
    RESULTS,
    Case,
    Skip,
    gpu_profile,
    map_row,
)
from reference_report import (
    COLUMNS,
    SLOWER_LINKS,
    load_results,
    sweep_groups,
    tables,
    write_md,
)
from results_md import write_block, write_csv

from zsim.cluster.fabric import fabric_from_mapping
from zsim.cluster.topology import Topology, build_topology, with_slower_links
from zsim.inputs import presets
from zsim.inputs.files import load_mapping
from zsim.simulation import simulate
from zsim.workload.mechanisms import Mechanism, consulted, parse_mechanisms

PNG_OUT = RESULTS / "reference_runs.png"
ABLATION_CSV = RESULTS / "reference_ablation.csv"
ABLATION_BEGIN, ABLATION_END = "<!-- ablation:begin -->", "<!-- ablation:end -->"


def read_rows(file: str) -> list[dict[str, str]]:
    with (REFERENCE / file).open(newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def cost(case: Case) -> int:
    """A rough count of the passes zsim simulates (distinct ranks x micro-batches x chunks)."""
    c = case.parallel
    return c.pp * c.grad_accum * c.virtual_stages * (3 if c.zero_stage == 3 else 1)


PER_SOURCE = 4
"""Rows of each source sampled first (all it has where fewer): a source is judged on its own
rows, not left out because another source of its file has more."""


def select(cases: list[Case], limit: int) -> list[Case]:
    """Up to `limit` rows: `PER_SOURCE` of each source, then the rest evenly spread over the
    file (so every table and model size is represented), each time preferring rows whose
    configuration is given in full."""
    sources: dict[str, list[Case]] = {}
    for c in cases:
        sources.setdefault(c.source_id, []).append(c)
    chosen = [c for rows in sources.values() for c in _given_first(rows, PER_SOURCE)]
    taken = {c.row_id for c in chosen}
    chosen += _given_first([c for c in cases if c.row_id not in taken], limit - len(chosen))
    order = {c.row_id: i for i, c in enumerate(cases)}
    return sorted(chosen, key=lambda c: order[c.row_id])


def _given_first(cases: list[Case], n: int) -> list[Case]:
    given = [c for c in cases if not c.assumed]
    chosen = spread(given, n)
    return chosen + spread([c for c in cases if c.assumed], n - len(chosen))


def spread(items: list[Case], n: int) -> list[Case]:
    if n <= 0:
        return []
    if len(items) <= n:
        return list(items)
    return [items[round(i * (len(items) - 1) / (n - 1))] for i in range(n)] if n > 1 else items[:1]


@cache
def _fabric_yaml(path: str) -> dict[str, Any]:
    data = dict(load_mapping(Path(path), "topology"))
    data.pop("nodes", None)
    return data


def topology_of(case: Case) -> Topology:
    """The row's cluster; a job on part of one node gets a node of just its GPUs (the same
    links between them: zsim simulates every GPU of a topology)."""
    per_node = min(case.gpus_per_node, case.parallel.world_size)
    name = f"{case.nodes}x{per_node}-{case.fabric}"
    if not case.fabric.endswith(".yaml"):
        if per_node == case.gpus_per_node:
            return presets.topology(name)
        spec = presets.fabric(case.fabric)
    else:
        spec = fabric_from_mapping(
            _fabric_yaml(case.fabric), Path(case.fabric).name, presets.gpu_names()
        )
    spec = replace(spec, gpus_per_node=(per_node,))
    return build_topology(name, spec, case.nodes, per_node)


def run_case(
    case: Case,
    protocol: str | None = None,
    without: frozenset[Mechanism] = frozenset(),
    slower_links: float = 1.0,
) -> dict[str, Any]:
    """One row; `protocol` overrides the cluster's NCCL protocol model, `without` switches
    mechanisms off (ablations), `slower_links` divides every link's bandwidth (a what-if)."""
    start = time.perf_counter()
    try:
        topo = with_slower_links(topology_of(case), slower_links)
        if protocol is not None:
            topo = replace(topo, fabric=replace(topo.fabric, protocol=protocol), memo={})
        cfg = replace(case.parallel, without=case.parallel.without | without)
        with consulted() as asked:
            report = simulate(case.model, cfg, topo, gpu_profile(case.gpu))
    except Exception as exc:  # a scenario zsim cannot run is a finding, recorded as such
        return outcome(case, None, f"zsim failed: {type(exc).__name__}: {exc}", start)
    return outcome(case, report, "", start) | {"consulted": frozenset(asked)}


def outcome(case: Case, report: Any, failure: str, start: float) -> dict[str, Any]:
    row: dict[str, Any] = {
        "row_id": case.row_id,
        "file": case.file,
        "source_id": case.source_id,
        "scenario": case.scenario(),
        "measured_from": case.measured_from,
        "measured_step_s": round(case.measured_s, 4),
        "assumed": "; ".join(case.assumed),
        "notes": "; ".join(case.notes),
        "sim_wall_s": round(time.perf_counter() - start, 2),
        "gpu": case.gpu,
        "tp": case.parallel.tp,
        "pp": case.parallel.pp,
        "dp": case.parallel.dp,
        "micro_batch": case.parallel.micro_batch,
        "seq_len": case.model.seq_len,
        "flash": case.parallel.flash_attention,
    }
    if report is None:
        return row | {"status": "failed", "reason": failure}
    step = report.step_time_s
    return row | {
        "status": "compared",
        "predicted_step_s": round(step, 4),
        "error_pct": round(100 * (step - case.measured_s) / case.measured_s, 1),
        "compute_frac": round(report.compute_s / step, 3),
        "exposed_comm_frac": round(report.exposed_comm_s / step, 3),
        "idle_frac": round(report.bubble_s / step, 3),
        "predicted_mfu_pct": round(100 * report.mfu, 1),
        "fits_memory": report.fits,
    }


def too_slow(case: Case, args: argparse.Namespace) -> str:
    """Why a row would take too long to simulate here ('' if it would not)."""
    if cost(case) > args.max_cost:
        return f"simulation cost (stages x micro-batches x chunks) > {args.max_cost}"
    return ""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--max-rows",
        type=int,
        default=None,
        help="rows simulated per file (default: every mapped row; a sample takes PER_SOURCE of "
        "each source first)",
    )
    parser.add_argument("--jobs", type=int, default=2, help="simulations in parallel")
    parser.add_argument(
        "--max-cost",
        type=int,
        default=100_000,
        help="skip rows costlier than this (pipeline stages x micro-batches x chunks)",
    )
    parser.add_argument("--files", default=",".join(FILES), help="which files (comma list)")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument(
        "--protocol",
        choices=("auto", "ll", "ll128", "simple", "ideal"),
        help="override every cluster's NCCL protocol model (ablation; use with --no-write)",
    )
    parser.add_argument(
        "--from-csv", action="store_true", help="re-render the tables from the last CSV only"
    )
    parser.add_argument(
        "--ablate",
        action="store_true",
        help="also simulate the rows once per mechanism with it switched off (the ablation "
        "table and reference_ablation.csv); a row whose simulation never asked about the "
        "mechanism keeps its result",
    )
    parser.add_argument(
        "--ablate-only",
        metavar="NAMES",
        help="the ablation for these mechanisms alone (comma list), against this run; printed "
        "only (the committed table holds every mechanism from one run)",
    )
    return parser


def choose(args: argparse.Namespace, results: list[dict[str, Any]]) -> list[Case]:
    """The rows to simulate; every other row goes to `results` with the reason."""
    cases: list[Case] = []
    for key in args.files.split(","):
        file = FILES[key]
        mapped = []
        for row in read_rows(file):
            try:
                mapped.append(map_row(row, file))
            except Skip as why:
                results.append(
                    {"row_id": row["row_id"], "file": file, "source_id": row["source_id"]}
                    | {"status": "skipped", "reason": str(why)}
                )
        affordable = [c for c in mapped if not too_slow(c, args)]
        chosen = affordable if args.max_rows is None else select(affordable, args.max_rows)
        ids = {c.row_id for c in chosen}
        for c in mapped:
            if c.row_id not in ids:
                why = too_slow(c, args) or f"not among the {args.max_rows} rows sampled per file"
                results.append(
                    {"row_id": c.row_id, "file": file, "source_id": c.source_id}
                    | {"status": "not sampled", "reason": why}
                    | {"scenario": c.scenario(), "assumed": "; ".join(c.assumed)}
                    | {"notes": "; ".join(c.notes)}
                )
        cases += chosen
    return cases


def simulate_all(
    cases: list[Case],
    jobs: int,
    protocol: str | None = None,
    without: frozenset[Mechanism] = frozenset(),
    slower_links: float = 1.0,
) -> list[dict[str, Any]]:
    cases = sorted(cases, key=cost, reverse=True)  # longest first keeps the workers busy
    out = []
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(run_case, c, protocol, without, slower_links) for c in cases]
        for future in as_completed(futures):
            result = future.result()
            print(
                f"{result['row_id']:38s} {result.get('error_pct', result.get('reason'))!s:>8}"
                f"  ({result['sim_wall_s']} s)",
                file=sys.stderr,
            )
            out.append(result)
    return out


def with_slower_sweeps(
    cases: list[Case], results: list[dict[str, Any]], args: argparse.Namespace
) -> None:
    """The rows of the layout sweeps again with every link slower (the sweeps table's
    what-if), their steps set into `results` as predicted_slower_links_s."""
    done = [r for r in results if r["status"] == "compared"]
    ids = {r["row_id"] for rows in sweep_groups(done).values() for r in rows}
    print(f"[what-if] {len(ids)} sweep rows, links at 1/{SLOWER_LINKS:g}", file=sys.stderr)
    again = simulate_all(
        [c for c in cases if c.row_id in ids], args.jobs, args.protocol, frozenset(), SLOWER_LINKS
    )
    slower = {r["row_id"]: r.get("predicted_step_s") for r in again}
    for r in results:
        if slower.get(r["row_id"]):
            r["predicted_slower_links_s"] = slower[r["row_id"]]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    start = time.perf_counter()
    if args.from_csv:
        previous = load_results(CSV_OUT)
        block = tables(previous, "Re-rendered from reference_runs.csv.")
        print(block)
        if not args.no_write:
            write_md(block)
            plot(previous, PNG_OUT)
        return 0
    results: list[dict[str, Any]] = []
    cases = choose(args, results)
    results += simulate_all(cases, args.jobs, args.protocol)
    with_slower_sweeps(cases, results, args)
    order = {k: i for i, k in enumerate(FILES.values())}
    results.sort(key=lambda r: (order[r["file"]], r["row_id"]))
    wall = time.perf_counter() - start
    simulated = sum(r["status"] == "compared" for r in results)
    block = tables(
        results, f"Generated in {wall:.0f} s ({simulated} rows simulated, {args.jobs} jobs)."
    )
    print(block)
    if not args.no_write:
        RESULTS.mkdir(exist_ok=True)
        with CSV_OUT.open("w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, COLUMNS, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(results)
        write_md(block)
        plot(results, PNG_OUT)
    if args.ablate_only:
        named = parse_mechanisms(args.ablate_only, "ablate-only")
        print(ablate(cases, results, argparse.Namespace(**{**vars(args), "no_write": True}), named))
    elif args.ablate:
        ablation = ablate(cases, results, args)
        print(ablation)
        if not args.no_write:
            write_block(MD_OUT, ablation, ABLATION_BEGIN, ABLATION_END)
    return 0


def ablate(
    cases: list[Case],
    base: list[dict[str, Any]],
    args: argparse.Namespace,
    mechanisms: Iterable[Mechanism] = tuple(Mechanism),
) -> str:
    """The same rows once per mechanism switched off; its table, and every row's error with
    each mechanism off in reference_ablation.csv. A row whose simulation never asked about a
    mechanism is not simulated again without it: its result is the base run's."""
    asked = consulted_by(cases, base)
    done = {r["row_id"]: r for r in base}
    off: dict[str, list[dict[str, Any]]] = {}
    asking: dict[str, set[str]] = {}
    todo = list(mechanisms)
    for i, mechanism in enumerate(todo, 1):
        mine = [c for c in cases if mechanism in asked[c.row_id]]
        print(
            f"[ablation {i}/{len(todo)}] without {mechanism}: {len(mine)} of {len(cases)} rows "
            "ask about it",
            file=sys.stderr,
        )
        redone = simulate_all(mine, args.jobs, args.protocol, frozenset({mechanism}))
        asking[str(mechanism)] = again = {r["row_id"] for r in redone}
        off[str(mechanism)] = redone + [done[c.row_id] for c in cases if c.row_id not in again]
    if not args.no_write:
        rows = [
            {"row_id": r["row_id"], "without": name, "error_pct": r.get("error_pct", "")}
            | {"simulated": r["row_id"] in asking[name]}
            for name, rs in off.items()
            for r in sorted(rs, key=lambda r: r["row_id"])
        ]
        write_csv(ABLATION_CSV, rows)
    return ablation_table(base, off)


def consulted_by(cases: list[Case], base: list[dict[str, Any]]) -> dict[str, frozenset[str]]:
    """The mechanisms each row's base simulation asked about, joined over the rows of equal
    model and layout (zsim caches by them, so a later such row may not ask again); a row
    that failed counts as asking about all."""
    record = {r["row_id"]: r.get("consulted") for r in base}
    joined: dict[tuple[Any, Any], set[str]] = {}
    for c in cases:
        asked = record.get(c.row_id)
        joined.setdefault((c.model, c.parallel), set()).update(
            set(Mechanism) if asked is None else asked
        )
    return {c.row_id: frozenset(joined[(c.model, c.parallel)]) for c in cases}


if __name__ == "__main__":
    sys.exit(main())
