"""`zsim run`, `zsim memory`, `zsim models`, `zsim gpus`: flags -> the scenario -> the core ->
the rendered result."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from zsim.cli.layout_flags import add_model_flags, add_parallel_flags
from zsim.cli.output import EXIT_DOES_NOT_FIT, EXIT_OK, write_output
from zsim.cluster.device import DeviceProfile
from zsim.cluster.topology import Topology
from zsim.errors import InputError, require
from zsim.inputs import presets
from zsim.inputs.scenario import build_model, build_parallel, check_layout, dp_left, parse_int
from zsim.memory import peak_ledger
from zsim.outputs import render
from zsim.simulation import Report, simulate
from zsim.step.trace import chrome_trace
from zsim.workload.layout import stage_blocks
from zsim.workload.mechanisms import MECHANISMS, parse_mechanisms
from zsim.workload.model import ModelKind, ModelSpec
from zsim.workload.model_presets import PRESETS
from zsim.workload.parallel import ParallelConfig, ZeroStage, with_stage
from zsim.workload.sharding import default_shard_size


def _model_from(args: argparse.Namespace) -> Any:
    return build_model(
        args.model,
        args.params,
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        ffn_hidden=args.ffn_hidden,
        seq_len=args.seq_len,
        vocab=args.vocab,
        kv_heads=args.kv_heads,
    )


def _parallel_from(
    args: argparse.Namespace, model: ModelSpec, **extra: Any
) -> tuple[ParallelConfig, list[str]]:
    flags = {
        k: getattr(args, k, None)
        for k in (
            "dp",
            "tp",
            "pp",
            "cp",
            "micro_batch",
            "grad_accum",
            "global_batch",
            "stage",
            "precision",
            "recompute",
            "offload",
            "sequence_parallel",
            "flash_attention",
            "attention_kernel",
            "elementwise",
            "pp_schedule",
            "pipeline_engine",
            "pp_partition",
            "pp_balancer",
            "virtual_stages",
            "dp_engine",
            "fsdp_sharding",
            "fsdp_shard_size",
            "overlap_param_gather",
            "tp_comm_overlap",
            "tp_comm_overlap_cfg",
            "async_tp_allreduce",
            "grad_accumulation_fusion",
            "reduce_bucket_size",
            "allgather_bucket_size",
            "prefetch_bucket_size",
            "param_persistence_threshold",
            "max_live_parameters",
            "max_reuse_distance",
            "overlap_comm",
            "hpz_partition_size",
            "quantized_weights",
            "quantized_gradients",
        )
    }
    hidden = model.hidden if model.kind is not ModelKind.PARAMS_ONLY else None
    return build_parallel(args.ds_config, hidden, **(flags | extra))


# ---- commands ------------------------------------------------------------------------------


def cmd_memory(args: argparse.Namespace) -> int:
    model = _model_from(args)
    pipelined = args.pp not in (None, "1")
    megatron = getattr(args, "dp_engine", None) == "megatron"  # its DDP: ZeRO-0 or 1 only
    # built at the highest stage the layout allows, then compared at each allowed stage
    cfg, notes = _parallel_from(args, model, stage="1" if pipelined or megatron else "3")
    check_layout(model, cfg)
    device = presets.gpu(args.gpu)
    low = cfg.pp > 1 or megatron
    stages = [s for s in ZeroStage if not low or s <= ZeroStage.OPTIMIZER]
    if len(stages) < len(ZeroStage):
        why = "Megatron-Core's DDP" if megatron else "DeepSpeed's pipeline"
        notes.append(f"ZeRO-2 and ZeRO-3 left out ({why} takes 0 or 1)")
    ledgers = {s: peak_ledger(model, with_stage(cfg, s)) for s in stages}
    if model.kind is ModelKind.PARAMS_ONLY:
        notes.append(
            "--params gives no shape: activations are not counted, so `fits` covers model "
            "states and buffers only (give --model for the whole ledger)"
        )
    report = render.memory_report(model, cfg, device, ledgers)
    if args.json:
        print(json.dumps(report | {"notes": notes}, indent=2))
    else:
        for line in notes:
            render.note(line)
        render.print_memory(report)
    return EXIT_OK if report["first_stage_that_fits"] is not None else EXIT_DOES_NOT_FIT


DEFAULT_RUN = {"topology": "1x8-nvlink", "model": "gpt-1.3b", "micro_batch": "4"}


def _run_defaults(args: argparse.Namespace) -> dict[str, str]:
    """The built-in defaults a run takes for what was not given; a ds_config's batch is its
    own (its train_batch_size and micro-batch, not zsim's micro-batch 4)."""
    return {
        k: v
        for k, v in DEFAULT_RUN.items()
        if getattr(args, k) is None and not (k == "micro_batch" and args.ds_config is not None)
    }


def _device(args: argparse.Namespace, topology: Topology) -> DeviceProfile:
    """A calibrated profile (--profile), a GPU preset (--gpu), or the topology's GPU."""
    if args.profile:
        from zsim.calibrate.profile import load_profile

        return load_profile(args.profile)
    name = args.gpu or topology.gpu_model
    if name is None:
        raise InputError(
            "gpu",
            None,
            f"a GPU preset (--gpu) or a calibrated profile (--profile): "
            f"topology {topology.name} names no GPU model",
        )
    return presets.gpu(name)


def _default_shard_size(args: argparse.Namespace, per_node: int, tp: int, dp: str) -> str:
    """--sharding hybrid without --shard-size: a node's data-parallel ranks; the note."""
    if args.fsdp_sharding != "hybrid" or args.fsdp_shard_size is not None:
        return ""
    ranks = parse_int("dp", dp) or 1
    args.fsdp_shard_size = str(default_shard_size(per_node, tp, ranks))
    return f"--shard-size {args.fsdp_shard_size}: a node's data-parallel ranks"


def _write_views(args: argparse.Namespace, name: str, cfg: ParallelConfig, report: Report) -> None:
    """The step's Chrome trace (--trace) and timeline plot (--plot), where asked for."""
    if args.trace:
        write_output(
            args.trace, json.dumps(chrome_trace(report.engine.spans, report.engine.passes))
        )
    if args.plot:
        from zsim.outputs.timeline import timeline

        title = f"{name}: ZeRO-{int(cfg.zero_stage)}, {cfg.sizes(' ')[1]}"
        fig = timeline(report.engine.spans, title, passes=report.engine.passes)
        write_output(args.plot, fig)


def cmd_run(args: argparse.Namespace) -> int:
    require(
        args.params is None,
        "params",
        args.params,
        "a model shape for zsim run (--model, shape flags): a parameter count alone sizes "
        "memory (zsim memory --params), not kernels",
    )
    defaults = [f"--{k.replace('_', '-')} {v}" for k, v in _run_defaults(args).items()]
    for key, value in _run_defaults(args).items():
        setattr(args, key, value)
    topology = presets.topology(args.topology)
    model = _model_from(args)
    tp, pp, cp = (parse_int(x, getattr(args, x, None)) or 1 for x in ("tp", "pp", "cp"))
    world = topology.world_size
    dp = args.dp or str(dp_left(world, topology.name, tp, pp, cp))
    shard_note = _default_shard_size(args, topology.gpus_per_node, tp, dp)
    cfg, notes = _parallel_from(args, model, dp=dp)
    notes += [shard_note] if shard_note else []
    without = parse_mechanisms(args.without, "without")
    if without:
        cfg = replace(cfg, without=without)
        notes.append("switched off (an ablation): " + ", ".join(sorted(without)))
    check_layout(model, cfg)
    if cfg.world_size != world:
        product, values = cfg.sizes()
        raise InputError(product, cfg.world_size, f"the {world} GPUs of {topology.name} ({values})")
    device = _device(args, topology)
    if cfg.tp_comm_overlap and cfg.tp > 1 and cfg.tp_overlap_sms and not device.sm_count:
        notes.append(f"{device.name} has no SM count: TransformerEngine's SM margins not applied")
    if cfg.pp > 1 and model.kind is not ModelKind.PARAMS_ONLY:
        held = ", ".join(map(str, stage_blocks(model, cfg)))
        how = cfg.pp_partition + ("" if cfg.pp_partition == "uniform" else f", {cfg.pp_balancer}")
        notes.append(f"pipeline stages hold {held} blocks ({how})")
    slow = parse_stragglers(args.straggler or [])
    fold = not (args.trace or args.plot)  # they show every task: no steady state repeated
    report = simulate(model, cfg, topology, device, full=args.full, stragglers=slow, fold=fold)
    summary = render.run_report(model, cfg, topology.name, device, report)
    notes += render.fold_note(report.engine.fold, cfg.grad_accum)
    _write_views(args, f"{model.name} on {topology.name}", cfg, report)
    if args.json:
        print(json.dumps(summary | {"notes": notes}, indent=2))
    else:
        if defaults:
            render.note("defaults: " + "  ".join(defaults))
        for line in notes:
            render.note(line)
        render.print_run(summary)
    return EXIT_OK if report.fits else EXIT_DOES_NOT_FIT


def parse_stragglers(items: list[str]) -> dict[int, float]:
    """`RANK:FACTOR` items -> {rank: factor}."""
    out: dict[int, float] = {}
    for item in items:
        rank, _, factor = item.partition(":")
        try:
            out[int(rank)] = float(factor)
        except ValueError:
            raise InputError("straggler", item, "RANK:FACTOR, e.g. 3:1.2") from None
    return out


def cmd_models(args: argparse.Namespace) -> int:
    rows = [render.model_row(m) for m in PRESETS.values()]
    print(json.dumps(rows, indent=2)) if args.json else render.print_rows(rows, "Model presets")
    return 0


def cmd_gpus(args: argparse.Namespace) -> int:
    rows = [render.gpu_row(presets.gpu(n)) for n in presets.gpu_names()]
    print(json.dumps(rows, indent=2)) if args.json else render.print_rows(rows, "GPU presets")
    return 0


def add_commands(sub: Any) -> None:
    """Register `run`, `memory`, `models` and `gpus` on zsim's subparsers."""
    run = sub.add_parser("run", help="simulate one training step on a cluster")
    run.add_argument(
        "--topology",
        help="cluster preset NxG-fabric or a YAML file "
        f"(default {DEFAULT_RUN['topology']}; see `zsim topologies`)",
    )
    add_model_flags(run)
    add_parallel_flags(run)
    run.add_argument(
        "--gpu", help="GPU preset (see `zsim gpus`) or a GPU spec YAML, instead of the topology's"
    )
    run.add_argument("--profile", type=Path, help="a calibrated profile (zsim calibrate)")
    run.add_argument("--full", action="store_true", help="simulate every rank, not one per stage")
    run.add_argument(
        "--straggler",
        action="append",
        metavar="RANK:FACTOR",
        help="with --full: this rank's kernels run FACTOR x slower (repeatable), e.g. 3:1.2",
    )
    run.add_argument(
        "--without",
        metavar="NAME[,NAME]",
        help="switch modelled mechanisms off to see what each costs (an ablation): "
        + ", ".join(MECHANISMS),
    )
    run.add_argument("--json", action="store_true", help="machine-readable output")
    run.add_argument("--trace", type=Path, help="write a Chrome/Perfetto trace JSON")
    run.add_argument("--plot", type=Path, help="write a timeline PNG of compute and comm")
    run.set_defaults(func=cmd_run)

    mem = sub.add_parser("memory", help="memory ledger per GPU for ZeRO stages 0-3")
    add_model_flags(mem)
    add_parallel_flags(mem, stage=False)
    mem.add_argument("--gpu", default="a100-80gb", help="GPU preset (see `zsim gpus`)")
    mem.add_argument("--json", action="store_true", help="machine-readable output")
    mem.set_defaults(func=cmd_memory)

    for name, func, text in (
        ("models", cmd_models, "list model presets"),
        ("gpus", cmd_gpus, "list GPU presets"),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument("--json", action="store_true")
        p.set_defaults(func=func)
