"""`zsim calibrate`: flags -> a Plan and a Launch -> the runner -> a summary table."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from zsim.errors import InputError, positive_int, require
from zsim.inputs.scenario import parse_model

_PRECISIONS = ("fp32", "bf16", "fp16")


def add_commands(sub: Any) -> None:
    """Register `zsim calibrate` and `zsim profile` on the `zsim` parser's subcommands."""
    _add_calibrate(sub)
    _add_profile(sub)


def _add_calibrate(sub: Any) -> None:
    p = sub.add_parser(
        "calibrate",
        help="measure this machine (compute, memory, collectives) into a profile",
        description=(
            "Launch torchrun workers that time GEMMs, memory-bound kernels, the model's layers, "
            "copies, AdamW and collectives; fit zsim's models; write calibration/NAME.json "
            "(+ .csv, -fit.png)."
        ),
    )
    p.add_argument("--device", default="cpu", help="cuda or cpu (default cpu)")
    p.add_argument("--nproc", help="ranks per node (default: 2 on cpu, every GPU on cuda)")
    p.add_argument("--nnodes", default="1", help="nodes of a real multi-node run (default 1)")
    p.add_argument("--node-rank", default="0", help="this node's rank in a multi-node run")
    p.add_argument("--master-addr", default="127.0.0.1", help="node 0's address")
    p.add_argument(
        "--topology",
        metavar="NAME",
        help="the measured cluster as a zsim topology, naming the link classes the collectives "
        "are fitted to (default NNODESxNPROC-cpu on cpu, NNODESxNPROC-nvlink on cuda)",
    )
    p.add_argument(
        "--emulate",
        metavar="TOPOLOGY",
        help="emulate nodes with network namespaces, e.g. 2x2-cpu-1gbit (root)",
    )
    p.add_argument(
        "--model",
        action="append",
        metavar="M",
        help="a model whose layers to time: PRESET[:key=value,...], e.g. "
        "gpt-125m:layers=2,seq-len=128 (repeatable; default: kernels only)",
    )
    p.add_argument("--micro-batches", default="1,2,4", help="micro-batch sizes (default 1,2,4)")
    p.add_argument("--flash-attention", action="store_true", help="time fused attention layers")
    p.add_argument(
        "--tp",
        default="1",
        help="TP degrees to time transformer layers at, as one rank's Megatron shard (default 1)",
    )
    p.add_argument("--precision", help="fp32, bf16 or fp16 (default fp32 on cpu, bf16 on cuda)")
    p.add_argument("--threads", help="threads per rank (default: torchrun's, 1 when nproc > 1)")
    p.add_argument(
        "--max-size", default="268435456", help="largest collective size in bytes (default 256 MiB)"
    )
    p.add_argument(
        "--launches",
        help="worker processes the measurements are spread over (default 3 on cpu, where the "
        "OS places each process's threads differently; 1 on cuda and with --quick)",
    )
    p.add_argument("--quick", action="store_true", help="a small, fast run (tests, smoke checks)")
    p.add_argument("--name", help="profile name (default DEVICE-NPROCrank)")
    p.add_argument("--out", type=Path, help="output JSON (default calibration/NAME.json)")
    p.add_argument("--force", action="store_true", help="overwrite the default output")
    p.add_argument("--no-plot", action="store_true", help="skip the -fit.png figure")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_calibrate)


def _add_profile(sub: Any) -> None:
    show = sub.add_parser(
        "profile", help="show a calibration profile: fitted numbers, spread, fit residuals"
    )
    show.add_argument("path", type=Path, help="a calibration JSON (calibration/NAME.json)")
    show.add_argument("--json", action="store_true", help="the DeviceProfile as JSON")
    show.add_argument(
        "--collectives",
        action="store_true",
        help="also every collective row as nccl-tests prints it (size, count, time, algbw, "
        "busbw), with the model's time and each launch's mean",
    )
    show.add_argument(
        "--refit",
        action="store_true",
        help="fit the stored measurements again with this zsim's models and rewrite the file "
        "(+ .csv, -fit.png): after a model changes, no need to measure again",
    )
    show.set_defaults(func=cmd_profile)


def _int(field: str, text: str) -> int:
    try:
        return positive_int(field, int(text))
    except ValueError:
        raise InputError(field, text, "a positive integer") from None


def cmd_calibrate(args: argparse.Namespace) -> int:
    from zsim.calibrate import runner

    device = args.device
    require(device in ("cpu", "cuda"), "device", device, "cuda or cpu")
    launch = _launch(args, device)
    emulation = None
    topology = (
        args.topology or f"{launch.nnodes}x{launch.nproc}-{'cpu' if device == 'cpu' else 'nvlink'}"
    )
    if args.emulate is not None:
        emulation = _emulation(args.emulate, device)
        topology = emulation.topology
        launch = runner.Launch(emulation.ranks_per_node, launch.threads, emulation.nodes)
    name = args.name or f"{device}-{launch.nproc * launch.nnodes}rank"
    out = args.out or Path("calibration") / f"{name}.json"
    require(
        args.out is not None or args.force or not out.exists(),
        "out",
        str(out),
        "a new file: it exists (perhaps a committed profile); give --out, or --force",
    )
    try:
        written = runner.calibrate(
            _plan(args, device, topology),
            launch,
            name,
            out,
            show_progress=not args.no_progress,
            plot=not args.no_plot,
            emulation=emulation,
        )
    except runner.CalibrationFailed as exc:
        print(f"zsim: error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 1
    if written is None:
        print(f"zsim: node {launch.node_rank} measured; node 0 writes the profile")
        return 0
    from zsim.calibrate.report import print_summary

    print_summary(written.calibration, written.paths)
    return 0


def _launch(args: argparse.Namespace, device: str) -> Any:
    from zsim.calibrate.runner import Launch

    nproc = _int("nproc", args.nproc) if args.nproc else None
    if nproc is None:
        nproc = 2 if device == "cpu" else _cuda_count()
    launch = Launch(
        nproc=nproc,
        threads=_int("threads", args.threads) if args.threads else None,
        nnodes=_int("nnodes", args.nnodes),
        node_rank=int(args.node_rank) if args.node_rank.isdigit() else -1,
        master_addr=args.master_addr,
    )
    require(
        0 <= launch.node_rank < launch.nnodes,
        "node_rank",
        args.node_rank,
        f"0..{launch.nnodes - 1}",
    )
    return launch


def _plan(args: argparse.Namespace, device: str, topology: str) -> Any:
    from zsim.calibrate import plan as plans

    precision = args.precision or ("bf16" if device == "cuda" else "fp32")
    require(precision in _PRECISIONS, "precision", precision, ", ".join(_PRECISIONS))
    models = tuple(parse_model(m) for m in (args.model or []))
    micro = tuple(_int("micro_batches", x) for x in args.micro_batches.split(",") if x)
    require(bool(micro), "micro_batches", args.micro_batches, "comma-separated positive integers")
    tp = tuple(_int("tp", x) for x in args.tp.split(",") if x)
    require(bool(tp), "tp", args.tp, "comma-separated positive integers")
    return plans.default_plan(
        device,
        precision,
        models,
        micro,
        quick=args.quick,
        flash_attention=args.flash_attention,
        topology=topology,
        tp_degrees=tp,
        link_classes=_link_classes(topology),
        max_collective_bytes=_int("max_size", args.max_size),
        launches=_int("launches", args.launches) if args.launches else None,
    )


def _emulation(name: str, device: str) -> Any:
    """The emulated cluster for `--emulate NAME`, exactly as `zsim validate --emulate` builds
    it (the rate scaled down to what this host sustains)."""
    from zsim.inputs import presets
    from zsim.testbed.emulation_plan import EmulationPlan

    require(device == "cpu", "emulate", name, "--device cpu (ranks as processes)")
    topo = presets.topology(name)
    require(topo.nodes > 1, "emulate", name, "a topology of more than one node, e.g. 2x2-cpu")
    return EmulationPlan.of(topo)


def cmd_profile(args: argparse.Namespace) -> int:
    import json

    from zsim.calibrate.profile import load_calibration, profile_to_dict
    from zsim.calibrate.report import print_collectives, print_summary

    cal = load_calibration(args.path)
    written: list[Path] = []
    if args.refit:
        from zsim.calibrate.runner import refit

        refitted = refit(cal, args.path)
        cal, written = refitted.calibration, refitted.paths
    if args.json:
        print(json.dumps(profile_to_dict(cal.profile), indent=1))
        return 0
    print_summary(cal, written)
    if args.collectives:
        print_collectives(cal)
    return 0


def _link_classes(topology: str) -> dict[str, str]:
    """The link class each measured process group's traffic is bottlenecked by."""
    from zsim.calibrate.links import link_class_of
    from zsim.inputs import presets

    topo = presets.topology(topology)
    g, nodes = topo.gpus_per_node, topo.nodes
    groups = {"intra": g} if g > 1 else {}
    if nodes > 1:
        groups |= {"inter": nodes, "full": nodes * g}
    return {name: link_class_of(topo, name, ranks) for name, ranks in groups.items()}


def _cuda_count() -> int:
    from zsim.calibrate.host import check_machine

    check_machine("cuda", 1)
    import torch

    return int(torch.cuda.device_count())
