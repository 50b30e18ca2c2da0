"""`zsim plan`: every layout the cluster allows, the ones that fit, ranked; the winner emitted.

flags -> the model, cluster and batch -> `zsim.plan.planner.plan` -> a table of the top K
(the simulated ones first), the seeds' stage rule for the winner, the frontier PNG, and with
--emit the winner's ds_config.json and launcher. Exit 1 when no layout fits (the closest
misses and what would make them fit are printed instead of an empty table).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
from pathlib import Path
from typing import Any

from zsim.cli.output import EXIT_OK, write_output
from zsim.cluster.device import GB
from zsim.errors import require
from zsim.inputs import presets
from zsim.inputs.scenario import build_model, parse_choice, parse_int
from zsim.outputs import render
from zsim.plan import advice, emit
from zsim.plan.planner import Objective, Plan, plan
from zsim.plan.robustness import SLOWER_LINKS, link_stress, stress_note
from zsim.plan.space import Space
from zsim.workload.eager import Elementwise
from zsim.workload.parallel import DpEngine, Precision, ZeroStage

EXIT_NOTHING_FITS = 1


def cmd_plan(args: argparse.Namespace) -> int:
    require(args.model is not None, "model", None, "a model to plan for (--model)")
    require(args.topology is not None, "topology", None, "a cluster (--topology)")
    model = build_model(args.model, None, seq_len=args.seq_len)
    topology = presets.topology(args.topology)
    device = _device(args, topology)
    global_batch = parse_int("global_batch", args.global_batch)
    require(global_batch is not None, "global_batch", None, "the global batch (--global-batch)")
    assert global_batch is not None
    objective = parse_choice("objective", args.objective, Objective) or Objective.THROUGHPUT
    top = parse_int("top", args.top) or 5
    precision = parse_choice("precision", args.precision, Precision) or Precision.BF16
    engines = _engines(args.engine)
    no_fp8 = "bf16, fp16 or fp32 without --engine megatron (TransformerEngine's FP8 is modelled "
    no_fp8 += "under Megatron-Core only)"
    fp8_ok = precision is not Precision.FP8 or DpEngine.MEGATRON in engines
    require(fp8_ok, "precision", str(precision), no_fp8)
    space = Space(
        stages=tuple(ZeroStage(v) for v in _ints("stage", args.stage, (0, 1, 2, 3))),
        tps=_ints("tp", args.tp, None),
        pps=_ints("pp", args.pp, None),
        precision=precision,
        flash_attention=not args.no_flash_attention,
        elementwise=parse_choice("elementwise", args.elementwise, Elementwise) or Elementwise.FUSED,
        engines=engines,
        cps=_ints("cp", args.cp, (1,)),
    )
    simulate_top = 0 if args.simulate is None else _count("simulate", args.simulate)
    simulate_top = top if args.simulate is None else simulate_top
    result = plan(
        model, topology, device, global_batch, objective, simulate_top, space, _progress(args)
    )
    slower = _factor(args.slower_links)
    summary = _summary(model, topology, device, result, top, slower)
    if args.json:
        print(json.dumps(summary, indent=2))
    elif args.csv:
        print(_csv(summary["ranked"]), end="")
    else:
        _print(summary)
    if result.ranked:
        _outputs(args, model, topology, result)
    return EXIT_OK if result.ranked else EXIT_NOTHING_FITS


def _ints(field: str, text: str | None, default: Any) -> Any:
    """A comma list of integers from a flag (`--tp 1,2`), or the default."""
    if text is None:
        return default
    values = tuple(parse_int(field, item) for item in text.split(","))
    if field == "stage":
        for v in values:
            require(v in (0, 1, 2, 3), "stage", v, "0, 1, 2 or 3")
    return values


def _factor(text: str | None) -> float:
    """--slower-links: a factor >= 1 (1: no what-if)."""
    if text is None:
        return SLOWER_LINKS
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    ok = 1.0 <= value < float("inf")  # False for nan
    require(ok, "slower_links", text, "a finite factor >= 1 (1: links as modelled, no what-if)")
    return value


def _count(field: str, text: str) -> int:
    value = parse_int(field, text) if text != "0" else 0
    return value or 0


def _device(args: argparse.Namespace, topology: Any) -> Any:
    if args.profile:
        from zsim.calibrate.profile import load_profile

        return load_profile(args.profile)
    name = args.gpu or topology.gpu_model
    require(name is not None, "gpu", None, "a GPU preset (--gpu): the topology names none")
    return presets.gpu(name)


def _progress(args: argparse.Namespace) -> Any:
    if args.json or args.csv or not sys.stderr.isatty():
        return None

    def show(what: str, done: int, total: int) -> None:
        end = f"/{total}" if total else ""
        print(f"\r{what}: {done}{end}   ", end="", file=sys.stderr, flush=True)

    return show


def _summary(
    model: Any, topology: Any, device: Any, result: Plan, top: int, slower: float
) -> dict[str, Any]:
    from zsim.plan.estimate import Estimator

    rows = []
    for c in result.ranked[:top]:
        line = (
            render.bottleneck(render.run_report(model, c.cfg, topology.name, device, c.report))
            if c.report
            else "closed form only"
        )
        rows.append(advice.row(c, result.usable_bytes, line))
    notes = []
    if result.ranked:
        estimator = Estimator(model, topology, device)
        notes.append(advice.stage_rule(model, device, estimator, result.ranked[0]))
        notes.append(_agreement(result))
    if rows and slower > 1.0:
        shown = result.ranked[:top]
        stress = link_stress(model, topology, device, shown, slower)
        for r, growth in zip(rows, stress.growth, strict=True):
            r["slower_links_factor"], r["slower_links_growth"] = slower, growth - 1
        notes.append(stress_note(stress, [c.step_s for c in shown]))
    return {
        "model": model.name,
        "topology": topology.name,
        "gpu": device.name,
        "layouts": result.layouts,
        "fitting": len(result.ranked),
        "simulated": result.simulated,
        "seconds": result.seconds,
        "ranked": rows,
        "notes": notes,
        "closest_misses": [] if result.ranked else advice.miss_rows(result.misses[:5]),
        "advice": []
        if result.ranked
        else advice.advice(model, device, topology.world_size, result),
    }


def _agreement(result: Plan) -> str:
    pairs = [(c.estimate.step_s, c.report.step_time_s) for c in result.ranked if c.report]
    if not pairs:
        return "no layout simulated (--simulate 0): closed-form ranking only"
    worst = max(abs(e / s - 1) for e, s in pairs)
    return f"closed form vs simulation on the {len(pairs)} simulated: step times within {worst:.1%}"


def _print(s: dict[str, Any]) -> None:
    print(
        f"{s['model']} on {s['topology']} ({s['gpu']}): {s['layouts']:,} layouts, "
        f"{s['fitting']:,} fit, {s['simulated']} simulated, {s['seconds']:.1f} s"
    )
    if not s["ranked"]:
        print("Nothing fits. The closest misses:")
        for m in s["closest_misses"]:
            over = f"{m['over_GB']:.1f} GB over ({m['largest']})"
            print(f"  {m['layout']}: {m['memory_GB']:.1f} GB, {over}")
        for line in s["advice"][3:]:
            print(f"  - {line}")
        return
    rows = [
        {
            "#": str(i),
            "layout": r["layout"],
            "step s": f"{r['step_s']:.3f}{'' if r['simulated'] else '*'}",
            "tokens/s": f"{r['tokens_per_s']:,.0f}",
            "MFU": f"{r['mfu']:.1%}",
            "GB/GPU (headroom)": f"{r['memory_GB']:.1f} ({r['headroom_GB']:.1f})",
            "exposed comm": f"{r['exposed_comm_share']:.0%}",
        }
        | _stressed(r)
        for i, r in enumerate(s["ranked"], start=1)
    ]
    render.print_rows(rows, "Best layouts (* closed form only)")
    for i, r in enumerate(s["ranked"], start=1):
        print(f"{i}. {r['bottleneck']}")
    for note in s["notes"]:
        print(note)


def _stressed(r: dict[str, Any]) -> dict[str, str]:
    if "slower_links_growth" not in r:
        return {}
    return {f"links 1/{r['slower_links_factor']:g}": f"{r['slower_links_growth']:+.0%}"}


def _csv(rows: list[dict[str, Any]]) -> str:
    buffer = io.StringIO()
    flat = [{k: v for k, v in r.items() if k != "config"} | r["config"] for r in rows]
    if flat:
        writer = csv.DictWriter(buffer, fieldnames=list(flat[0]))
        writer.writeheader()
        writer.writerows(flat)
    return buffer.getvalue()


def _outputs(args: argparse.Namespace, model: Any, topology: Any, result: Plan) -> None:
    if args.plot:
        from zsim.outputs.pareto import pareto_figure

        points = [(c.memory.device_total / GB, c.tokens_per_s) for c in result.ranked]
        labels = [advice.describe(c.cfg) for c in result.ranked]
        title = f"{model.name} on {topology.name}: {result.layouts:,} layouts"
        write_output(args.plot, pareto_figure(points, labels, result.usable_bytes / GB, title))
    if args.emit:
        best = result.ranked[0].cfg
        args.emit.mkdir(parents=True, exist_ok=True)
        for name, config in emit.config_files(best).items():
            write_output(args.emit / name, json.dumps(config, indent=2))
        lines = emit.launch_lines(model, best, topology.nodes, topology.gpus_per_node)
        write_output(args.emit / "launch.sh", "\n".join(lines) + "\n")


def _engines(text: str | None) -> tuple[DpEngine, ...]:
    """The data-parallel engines to search (DeepSpeed's covers Megatron's pipelines too)."""
    if text is None:
        return (DpEngine.DEEPSPEED,)
    names = [t.strip() for t in text.split(",") if t.strip()]
    ok = bool(names) and all(n in ("deepspeed", "fsdp", "megatron") for n in names)
    require(ok, "engine", text, "a list of deepspeed, fsdp, megatron (Megatron-Core's DDP)")
    return tuple(DpEngine(n) for n in dict.fromkeys(names))


def add_commands(sub: Any) -> None:
    p = sub.add_parser("plan", help="rank every layout the cluster allows for a model")
    p.add_argument("--model", help="PRESET[:key=value,...] (see zsim models)")
    p.add_argument("--topology", help="NxG-fabric or a cluster YAML file")
    p.add_argument("--global-batch", metavar="N", help="train_batch_size")
    p.add_argument("--seq-len", metavar="N", help="override the model's sequence length")
    p.add_argument("--gpu", help="GPU preset or a GPU spec YAML, instead of the topology's")
    p.add_argument("--profile", type=Path, help="a calibrated profile (zsim calibrate)")
    p.add_argument("--objective", help="throughput (default) or memory")
    p.add_argument("--top", metavar="K", help="layouts to show (default 5)")
    p.add_argument(
        "--simulate",
        metavar="N",
        help="layouts the simulator ranks (default K), and up to N more while the next one's "
        "closed form beats the best simulated step",
    )
    p.add_argument("--precision", help="bf16 (default), fp16, fp32 or fp8 (--engine megatron)")
    p.add_argument("--tp", metavar="LIST", help="only these TP widths, e.g. 1 or 1,2")
    p.add_argument("--pp", metavar="LIST", help="only these pipeline depths")
    p.add_argument("--cp", metavar="LIST", help="context-parallel sizes (--engine megatron)")
    p.add_argument("--stage", metavar="LIST", help="only these ZeRO stages, e.g. 2,3")
    p.add_argument("--no-flash-attention", action="store_true")
    p.add_argument(
        "--slower-links",
        metavar="F",
        help=f"what-if: each shown layout's step with every link at 1/F of its bandwidth "
        f"(closed form; default {SLOWER_LINKS:g}, 1: off)",
    )
    p.add_argument(
        "--elementwise",
        metavar="E",
        help="fused (default), eager or eager-fused-norm: the job's norms, RoPE, activation "
        "(as `zsim run --elementwise`)",
    )
    p.add_argument(
        "--engine",
        metavar="LIST",
        help="deepspeed (default), fsdp, megatron or a list (deepspeed,fsdp: PyTorch FSDP2 "
        "beside; megatron: Megatron-Core's DDP, with --cp and fp8)",
    )
    p.add_argument(
        "--emit", type=Path, metavar="DIR", help="write the winner's ds_config, launcher"
    )
    p.add_argument("--plot", type=Path, metavar="OUT.png", help="the throughput-memory frontier")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true")
    out.add_argument("--csv", action="store_true")
    p.set_defaults(func=cmd_plan)
