"""`zsim topologies`, `zsim topology` and `zsim collective`: the network half of the CLI.

`add_commands(sub)` registers them on zsim's parser. Flags are parsed and validated here (the
boundary); numbers come from `zsim.cluster` and `zsim.network`.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from zsim.cli.output import write_output
from zsim.cluster.grid import GroupKind, RankGrid, process_groups
from zsim.cluster.names import GRAMMAR
from zsim.cluster.topology import Topology
from zsim.errors import InputError, require
from zsim.inputs import presets
from zsim.inputs.scenario import parse_choice, parse_int
from zsim.network.collective import Algorithm, CollectiveCall, CollectiveOp, bandwidths
from zsim.network.communicator import simulate_s
from zsim.network.plans import plan
from zsim.outputs import render
from zsim.outputs.topology_summary import describe

_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}  # nccl-tests' sizes are powers of 1024
_SIZE = re.compile(r"^(\d+)([KMG]?)$")
FLOAT_BYTES = 4  # nccl-tests' default data type, -d float


def parse_size(text: str) -> int:
    match = _SIZE.match(text.strip().upper())
    if not match:
        raise InputError("sizes", text, "bytes like 8, 64K, 16M or 1G (K = 1024)")
    return int(match.group(1)) * _UNITS[match.group(2)]


def parse_sizes(text: str) -> list[int]:
    """`1K..1G` (doubling, as nccl-tests -f 2) or a comma list `1K,4M`."""
    if ".." in text:
        low, high = (parse_size(part) for part in text.split("..", 1))
        require(0 < low <= high, "sizes", text, "LOW..HIGH with 0 < LOW <= HIGH")
        sizes = [low]
        while sizes[-1] * 2 <= high:
            sizes.append(sizes[-1] * 2)
        return sizes
    return [parse_size(part) for part in text.split(",") if part.strip()]


# ---- commands --------------------------------------------------------------------------------


def cmd_topologies(args: argparse.Namespace) -> int:
    rows = [_fabric_row(name) for name in presets.fabric_names()]
    if args.json:
        print(json.dumps({"grammar": GRAMMAR, "fabrics": rows}, indent=2))
        return 0
    render.print_rows(
        [{k: v for k, v in row.items() if k != "description"} for row in rows],
        "Fabric presets (topologies/*.yaml)",
    )
    print(f"Names: {GRAMMAR}. Or --topology path/to/cluster.yaml.")
    return 0


def _fabric_row(name: str) -> dict[str, Any]:
    spec = presets.fabric(name)
    inside = "NVSwitch" if spec.nvswitch else "PCIe" if spec.pcie else "loopback"
    nic_gbps = spec.nic.bandwidth_bytes_per_s * 8 / 1e9
    return {
        "fabric": name,
        "gpus_per_node": ",".join(str(g) for g in spec.gpus_per_node),
        "gpu": spec.gpu or "-",
        "inside_node": inside,
        "nics": f"{spec.nics_per_node} x {nic_gbps:g} Gb/s {spec.nic_class}",
        "network": ("rail-optimized " if spec.rail_optimized else "")
        + f"fat tree 1:{spec.oversubscription:g}",
        "backend": str(spec.backend),
        "description": spec.description,
    }


def cmd_topology(args: argparse.Namespace) -> int:
    topo = presets.topology(args.name)
    summary = describe(topo)
    if args.emit:
        require(
            not Path(args.name).suffix,
            "name",
            args.name,
            "an NxG-fabric name for --emit (a cluster file is already editable)",
        )
        write_output(args.emit, presets.cluster_file_text(args.name))
        summary["emitted"] = str(args.emit)
    if args.plot:
        from zsim.outputs.topology_plot import topology_figure

        write_output(args.plot, topology_figure(topo))
        summary["plot"] = str(args.plot)
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    _print_topology(summary)
    return 0


def _print_topology(summary: dict[str, Any]) -> None:
    print(
        f"{summary['name']}: {summary['nodes']} nodes x {summary['gpus_per_node']} GPUs "
        f"= {summary['gpus']} ({summary['gpu'] or 'CPU ranks'}), backend {summary['backend']}, "
        f"call latency {summary['call_latency_us']:g} us"
    )
    print(f"  {summary['description']}")
    print("  vertices: " + ", ".join(f"{n} {k}" for k, n in summary["vertices"].items()))
    rows = [
        {
            "link class": link["class"],
            "GB/s per direction": f"{link['bandwidth_GBps']:g}",
            "latency us": f"{link['latency_us']:g}",
            "directed edges": link["directed_edges"],
        }
        for link in summary["links"]
    ]
    render.print_rows(rows, "Links")
    if "nvlink_line_GBps" in summary:
        print(
            f"  nvlink: the rate NCCL drives {summary['nvlinks_per_gpu']} NVLinks per GPU at "
            f"(line rate {summary['nvlink_line_GBps']:g} GB/s; zsim.cluster.nvlink)"
        )
    if "plot" in summary:
        print(f"  drawing: {summary['plot']}")


def cmd_collective(args: argparse.Namespace) -> int:
    topo = presets.topology(args.topology)
    op = parse_choice("op", args.op, CollectiveOp)
    algorithm = parse_choice("algorithm", args.algorithm, Algorithm)
    kind = parse_choice("group", args.group, GroupKind)
    groups = _groups(topo, args, kind)
    group = _for_op(op, groups[0])
    rows = []
    for size in parse_sizes(args.sizes):
        calls = [CollectiveCall(op, size, _for_op(op, g), algorithm) for g in groups]
        chosen = plan(topo, calls[0])
        time_s = simulate_s(topo, calls if args.all_groups else calls[:1])[0]
        rows.append(_row(op, len(group), size, time_s, chosen.algorithm, chosen.closed_form_s))
    header = {
        "topology": topo.name,
        "op": str(op),
        "group": str(kind),
        "gpus": list(group),
        "concurrent_groups": len(groups) if args.all_groups else 1,
    }
    if args.json:
        print(json.dumps(header | {"rows": rows}, indent=2))
    else:
        _print_nccl_tests(header, rows)
    return 0


def _groups(
    topo: Topology, args: argparse.Namespace, kind: GroupKind
) -> tuple[tuple[int, ...], ...]:
    tp = parse_int("tp", args.tp) or 1
    pp = parse_int("pp", args.pp) or 1
    dp = parse_int("dp", args.dp)
    if dp is None:
        require(
            topo.world_size % (tp * pp) == 0,
            "tp x pp",
            tp * pp,
            f"a divisor of the {topo.world_size} GPUs of {topo.name} (or give --dp)",
        )
        dp = topo.world_size // (tp * pp)
    return process_groups(topo, RankGrid(dp=dp, pp=pp, tp=tp), kind)


def _for_op(op: CollectiveOp, group: tuple[int, ...]) -> tuple[int, ...]:
    """send_recv runs between the group's first two members."""
    if op is not CollectiveOp.SEND_RECV:
        return group
    require(len(group) >= 2, "group", list(group), "at least 2 GPUs for send_recv")
    return group[:2]


def _row(
    op: CollectiveOp, n: int, size: int, time_s: float, algorithm: str, closed_s: float
) -> dict[str, Any]:
    algbw, busbw = bandwidths(op, n, size, time_s)
    return {
        "size_bytes": size,
        "count": size // FLOAT_BYTES,
        "type": "float",
        "time_us": time_s * 1e6,
        "algbw_GBps": algbw / 1e9,
        "busbw_GBps": busbw / 1e9,
        "algorithm": algorithm,
        "closed_form_us": closed_s * 1e6,
    }


def _print_nccl_tests(header: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """nccl-tests' layout: size, count, type, time (us), algbw, busbw (GB/s = 1e9 B/s)."""
    gpus = header["gpus"]
    shown = ", ".join(map(str, gpus[:16])) + (", ..." if len(gpus) > 16 else "")
    print(
        f"# zsim collective {header['op']} on {header['topology']}, {header['group']} group "
        f"of {len(gpus)} GPUs [{shown}]; {header['concurrent_groups']} group(s) at once"
    )
    print("#")
    names = f"{'size':>10}  {'count':>12}  {'type':>6}  {'time':>10}  {'algbw':>7}  {'busbw':>7}"
    print(f"# {names}  algorithm")
    print(f"# {'(B)':>10}  {'(elements)':>12}  {'':>6}  {'(us)':>10}  {'(GB/s)':>7}  {'(GB/s)':>7}")
    for row in rows:
        print(
            f"  {row['size_bytes']:>10}  {row['count']:>12}  {row['type']:>6}  "
            f"{row['time_us']:>10.2f}  {row['algbw_GBps']:>7.2f}  {row['busbw_GBps']:>7.2f}  "
            f"{row['algorithm']}"
        )


# ---- registration ------------------------------------------------------------------------------


def add_commands(sub: Any) -> None:
    """Register `topologies`, `topology` and `collective` on zsim's subparsers."""
    p = sub.add_parser("topologies", help="list topology presets and the NxG-fabric grammar")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_topologies)

    p = sub.add_parser("topology", help="summarize (and draw) one topology")
    p.add_argument("name", help=f"{GRAMMAR}, or a cluster YAML file")
    p.add_argument("--plot", type=Path, metavar="OUT.png", help="draw the graph to this file")
    p.add_argument(
        "--emit", type=Path, metavar="FILE.yaml", help="write it as an editable cluster file"
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_topology)

    p = sub.add_parser("collective", help="simulate a collective, nccl-tests style")
    p.add_argument("--topology", required=True, help=f"{GRAMMAR}, or a cluster YAML file")
    p.add_argument("--op", required=True, help=", ".join(o.value for o in CollectiveOp))
    p.add_argument("--group", default="world", help="dp, tp, pp or world (default world)")
    for flag in ("dp", "tp", "pp"):
        p.add_argument(f"--{flag}", metavar="N", help=f"{flag} size of the layout")
    p.add_argument("--sizes", default="1K..1G", help="LOW..HIGH doubling, or a list (1K,4M)")
    p.add_argument("--algorithm", default="auto", help=", ".join(a.value for a in Algorithm))
    p.add_argument(
        "--all-groups", action="store_true", help="run it in every group of that kind at once"
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_collective)
