"""`zsim validate`: run real DeepSpeed steps, simulate the same cases, plot one against the other.

flags -> cases (one per ZeRO stage) and the cluster (local, or emulated with namespaces) ->
`runner.run_all` -> `compare.compare` per case -> predicted_vs_measured.csv / .png,
summary.json, a table. Exit 0 when every case ran, 1 when one failed (all are still reported).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from zsim.cli.validate_cases import (
    fsdp_cases,
    parse_stages,
    planned_case,
    precision_of,
    stage_case,
    whole,
)
from zsim.errors import InputError, require
from zsim.inputs.scenario import parse_model
from zsim.workload.parallel import ZeroStage

DEFAULT_CPU_MODEL = "toy-mlp:hidden=1024"  # the seeds' 8 x Linear, narrowed to fit 8 CPU ranks
DEFAULT_GPU_MODEL = "toy-mlp"  # the seeds' experiment: 8 x Linear(4096, 4096)


def add_commands(sub: Any) -> None:
    """Register `zsim validate` on the `zsim` parser's subcommands."""
    p = sub.add_parser(
        "validate",
        help="run real DeepSpeed training, simulate the same cases, plot predicted vs measured",
        description=(
            "For each ZeRO stage: launch real DeepSpeed training with torchrun (under --emulate, "
            "one torchrun per network namespace of an emulated cluster), measure step time and "
            "memory, simulate the same case with the profile, and write "
            "predicted_vs_measured.csv/.png and summary.json to --out."
        ),
    )
    p.add_argument("--profile", type=Path, help="a calibration JSON (from `zsim calibrate`)")
    p.add_argument(
        "--stages", "--stage", dest="stages", default="0,1,2,3", help="ZeRO stages (default all)"
    )
    p.add_argument(
        "--model",
        help="PRESET[:key=value,...] as in zsim calibrate "
        f"(default {DEFAULT_CPU_MODEL} on cpu, {DEFAULT_GPU_MODEL} on cuda)",
    )
    p.add_argument(
        "--topology",
        help="NxG-fabric (see zsim topologies); default 1xNPROC-cpu. "
        "More than one node needs --emulate",
    )
    p.add_argument(
        "--emulate",
        action="store_true",
        help="emulate the topology's nodes as network namespaces joined by tc-shaped veth links "
        "(root, cpu)",
    )
    p.add_argument(
        "--scale",
        help="emulated rate = topology's inter-node rate x SCALE (default: down to 1 Gbit/s)",
    )
    _add_run_flags(p)
    p.set_defaults(func=cmd_validate)


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    """How each case runs: device, ranks, steps, launches, batch, precision, output."""
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--nproc", help="ranks when no --topology is given (default 2)")
    p.add_argument("--steps", default="5", help="timed steps per case (default 5)")
    p.add_argument(
        "--launches",
        default="1",
        help="separate launches per case; step time = median of their medians",
    )
    p.add_argument(
        "--warmup",
        default=None,
        help="untimed steps first (default 20 on cpu, 5 on cuda: on CPU glibc keeps handing "
        "DeepSpeed's per-step buffers fresh pages, 13 ms of page faults per 34 MB, for tens of "
        "steps)",
    )
    p.add_argument(
        "--ds-config",
        type=Path,
        help="one case as this DeepSpeed config says (e.g. zsim plan --emit DIR's ds_config.json)",
    )
    p.add_argument("--micro-batch", default="4", help="per-rank micro-batch (default 4)")
    p.add_argument(
        "--tp", default="1", help="Megatron-style tensor parallel degree (transformers; default 1)"
    )
    p.add_argument(
        "--pp",
        default="1",
        help="pipeline stages of DeepSpeed's PipelineEngine (toy-mlp, ZeRO 0-1; default 1); "
        "--grad-accum micro-batches per step",
    )
    p.add_argument("--grad-accum", default="1", help="gradient accumulation steps (default 1)")
    p.add_argument("--precision", help="fp32, bf16 or fp16 (default fp32 on cpu, fp16 on cuda)")
    p.add_argument("--timeout", default="900", help="seconds a case may run (default 900)")
    p.add_argument(
        "--band-samples", default="20", help="profiles resampled for the prediction band"
    )
    p.add_argument(
        "--engine", help="deepspeed (default) or fsdp (PyTorch FSDP2, one case per --sharding)"
    )
    p.add_argument(
        "--sharding", metavar="S", help="with --engine fsdp: full,grad-op,hybrid (default full)"
    )
    p.add_argument(
        "--shard-size",
        metavar="N",
        help="with --sharding hybrid: ranks per shard group (default: a node's ranks)",
    )
    p.add_argument("--out", type=Path, default=Path("validation"), help="output folder")
    p.add_argument("--no-progress", action="store_true", help="no live status line")


def cmd_validate(args: argparse.Namespace) -> int:
    device = args.device
    require(device in ("cpu", "cuda"), "device", device, "cpu or cuda")
    stages = parse_stages(args.stages)
    model_spec = args.model or (DEFAULT_CPU_MODEL if device == "cpu" else DEFAULT_GPU_MODEL)
    model = parse_model(model_spec)
    precision = precision_of(args.precision, device)
    reference = None  # the machine's speed when the profile was measured (`speed`)
    if args.profile is not None:  # a bad file is refused before anything runs
        from zsim.calibrate.profile import load_calibration

        reference = load_calibration(args.profile).provenance.get("speed_probe_s")
    nodes, ranks_per_node, simulated, emulation = _cluster(args, device)
    require(args.scale is None or args.emulate, "scale", args.scale, "only with --emulate")
    cluster = (simulated, nodes, ranks_per_node)
    fsdp = args.engine == "fsdp"
    require(args.engine in (None, "deepspeed", "fsdp"), "engine", args.engine, "deepspeed or fsdp")
    if fsdp:  # FSDP shards all three model states: one stage-3 case per strategy
        stages = [ZeroStage.PARAMETERS]
    cases = [stage_case(args, stage, model, precision, *cluster) for stage in stages]
    if fsdp:
        cases = fsdp_cases(args, cases[0])
    if args.ds_config is not None:  # one case, as the file (e.g. `zsim plan --emit`) says
        cases = [planned_case(args, cases[0], nodes * ranks_per_node)]
    context = {
        "model_spec": model_spec,
        "requested_topology": args.topology or simulated,
        "emulated": bool(emulation),
        "profile": str(args.profile) if args.profile else "",
    }
    return _run(args, cases, emulation, context, reference)


def _cluster(args: argparse.Namespace, device: str) -> tuple[int, int, str, Any]:
    """(nodes, ranks per node, the topology simulated, the emulation plan or None)."""
    from zsim.inputs import presets
    from zsim.testbed.emulation_plan import EmulationPlan

    if args.topology is None:
        require(device == "cpu", "topology", None, "a topology for cuda runs, e.g. 1x8-nvlink")
        require(not args.emulate, "emulate", True, "a --topology with the nodes to emulate")
        nproc = whole("nproc", args.nproc or "2")
        presets.topology(f"1x{nproc}-cpu")
        return 1, nproc, f"1x{nproc}-cpu", None
    topo = presets.topology(args.topology)
    require(
        args.nproc is None or whole("nproc", args.nproc) == topo.world_size,
        "nproc",
        args.nproc,
        f"{topo.world_size} (the ranks of {args.topology}) or not given",
    )
    if not args.emulate:
        require(
            topo.nodes == 1,
            "topology",
            args.topology,
            "one node, or add --emulate to emulate its nodes on this machine",
        )
        return topo.nodes, topo.gpus_per_node, args.topology, None
    require(device == "cpu", "emulate", True, "--device cpu (ranks as processes)")
    scale = None if args.scale is None else _float("scale", args.scale)
    emulation = EmulationPlan.of(topo, scale)
    presets.topology(emulation.topology)
    return topo.nodes, topo.gpus_per_node, emulation.topology, emulation


def _float(field: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise InputError(field, text, "a number") from None


def _run(
    args: argparse.Namespace,
    cases: Sequence[Any],
    emulation: Any,
    context: dict[str, Any],
    reference: dict[str, float] | None = None,
) -> int:
    from zsim.validate import compare, results, runner

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    band = whole("band_samples", args.band_samples, zero=True)
    with _status(not args.no_progress) as show:
        measured, link = runner.run_all(cases, out, emulation, progress=show, reference=reference)
        show("simulating", None)
        burst = None if link is None else link.burst_bytes
        rows = [compare.compare(m, args.profile, band, burst) for m in measured]
    if link is not None:
        context |= {
            "emulated_rate_bps": link.rate_bps,
            "emulation_scale": link.scale,
            "measured_link_bps": link.measured_rate_bps,
            "latency_emulation": link.latency_emulation,
        }
    title = f"{context['model_spec']} on {context['requested_topology']}"
    if link is not None:
        title += f" (emulated at {link.rate_bps * 8 / 1e6:.0f} Mbit/s, scale {link.scale:g})"
    table, summary = results.write_results(rows, context, out, title, link)
    _print(table, summary, out)
    return 0 if all(r.measurement.status is runner.Status.OK for r in rows) else 1


class _Progress:
    """A live status line (rich) while cases run, and a line for each finished case."""

    def __init__(self, console: Any, status: Any) -> None:
        self.console, self.status = console, status
        self.since = time.monotonic()

    def __call__(self, name: str, measurement: Any) -> None:
        if measurement is not None:
            self.console.print(_done_line(measurement))
            self.since = time.monotonic()
        elif self.status is not None:
            self.status.update(f"{name}: {time.monotonic() - self.since:.0f} s")


@contextmanager
def _status(enabled: bool) -> Iterator[_Progress]:
    from rich.console import Console

    console = Console(stderr=True)
    if not enabled:
        yield _Progress(console, None)
        return
    with console.status("starting") as status:
        yield _Progress(console, status)


def _done_line(m: Any) -> str:
    if m.step_time_s is None:
        return f"{m.case.name}: [red]{m.status}[/red] {m.detail[:160]}"
    return f"{m.case.name}: step {m.step_time_s:.3f} s measured ({m.wall_s:.0f} s wall)"


def _print(table: Sequence[dict[str, Any]], summary: dict[str, Any], out: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    from zsim.validate import compare

    t = Table(title="predicted vs measured")
    for col in (
        "case",
        "status",
        "measured s",
        "predicted s",
        "band s",
        "error %",
        "worst memory %",
    ):
        t.add_column(col)
    for r in table:
        band = (
            f"{r['predicted_low_s']:.3f}-{r['predicted_high_s']:.3f}"
            if r["predicted_low_s"] is not None
            else ""
        )
        errors = {c: r[f"{c}_error_pct"] for c in compare.MEMORY_CATEGORIES}
        known = {c: e for c, e in errors.items() if e is not None}
        worst = max(known, key=lambda c: abs(known[c]), default=None)
        mem = f"{worst} {known[worst]:+.0f}" if worst is not None else ""
        t.add_row(
            r["case"],
            r["status"],
            _fmt(r["measured_step_s"]),
            _fmt(r["predicted_step_s"]),
            band,
            _fmt(r["step_error_pct"], "{:+.1f}"),
            mem,
        )
    console = Console()
    console.print(t)
    mape = summary["mape_pct"]
    console.print(f"MAPE: {mape:.1f}%" if mape is not None else "MAPE: n/a (no predictions)")
    notes = {r["prediction_note"] for r in table if r["prediction_note"]}
    for note in sorted(notes):
        console.print(f"no prediction: {note}")
    console.print(f"written: {out / 'predicted_vs_measured.csv'}, .png, summary.json")


def _fmt(value: float | None, spec: str = "{:.3f}") -> str:
    return "" if value is None else spec.format(value)
