"""The cases `zsim validate` runs, from its flags: one per ZeRO stage (or, with --engine fsdp,
one per FSDP sharding strategy), or the one a ds_config describes."""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

from zsim.errors import InputError, positive_int, require
from zsim.inputs.scenario import check_layout
from zsim.workload.parallel import DpEngine, ParallelConfig, Precision, ZeroStage
from zsim.workload.sharding import FsdpSharding, default_shard_size

DEFAULT_WARMUP = {"cpu": "20", "cuda": "5"}


def whole(field: str, text: str, zero: bool = False) -> int:
    try:
        value = int(text)
    except ValueError:
        raise InputError(field, text, "a whole number") from None
    if zero:
        require(value >= 0, field, value, "a whole number, 0 or more")
        return value
    return positive_int(field, value)


def parse_stages(text: str) -> list[ZeroStage]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    require(
        bool(items) and all(s in ("0", "1", "2", "3") for s in items),
        "stages",
        text,
        "comma-separated ZeRO stages from 0,1,2,3",
    )
    return [ZeroStage(int(s)) for s in dict.fromkeys(items)]


def stage_case(
    args: argparse.Namespace,
    stage: ZeroStage,
    model: Any,
    precision: Precision,
    simulated: str,
    nodes: int,
    ranks_per_node: int,
) -> Any:
    from zsim.validate import runner

    tp, pp = whole("tp", args.tp), whole("pp", args.pp)
    world = nodes * ranks_per_node
    require(world % (tp * pp) == 0, "tp x pp", tp * pp, f"a divisor of the {world} ranks")
    layout = "".join(f"-{k}{v}" for k, v in (("tp", tp), ("pp", pp)) if v > 1)
    parallel = ParallelConfig(
        dp=world // (tp * pp),
        tp=tp,
        pp=pp,
        zero_stage=stage,
        micro_batch=whole("micro_batch", args.micro_batch),
        grad_accum=whole("grad_accum", args.grad_accum),
        precision=precision,
    )
    check_layout(model, parallel)  # before anything runs: TP must divide heads and ffn
    return runner.Case(
        name=f"z{int(stage)}{layout}",
        model=model,
        parallel=parallel,
        topology=simulated,
        nodes=nodes,
        ranks_per_node=ranks_per_node,
        device=args.device,
        steps=whole("steps", args.steps),
        warmup=whole("warmup", args.warmup or DEFAULT_WARMUP[args.device], zero=True),
        timeout_s=whole("timeout", args.timeout),
        launches=whole("launches", args.launches),
    )


def planned_case(args: argparse.Namespace, base: Any, world: int) -> Any:
    """The case a ds_config describes (stage, batch, precision, ZeRO knobs), on `world` ranks."""
    from zsim.inputs.files import load_mapping
    from zsim.workload.ds_config import from_ds_config

    cfg = from_ds_config(load_mapping(args.ds_config, "ds_config"))
    require(
        cfg.dp == world,
        "ds_config",
        f"dp={cfg.dp} (train_batch_size / micro-batch / accumulation)",
        f"{world}: the ranks this validation runs (a data-parallel plan for them)",
    )
    return replace(base, name=f"z{int(cfg.zero_stage)}-planned", parallel=cfg)


def precision_of(text: str | None, device: str) -> Precision:
    if text is None:
        return Precision.FP32 if device == "cpu" else Precision.FP16
    try:
        return Precision(text)
    except ValueError:
        raise InputError("precision", text, "fp32, bf16 or fp16") from None


def fsdp_cases(args: argparse.Namespace, base: Any) -> list[Any]:
    """With --engine fsdp: the stage-3 case once per --sharding strategy, as PyTorch FSDP2
    trains it; hybrid shards within a node unless --shard-size says otherwise."""
    items = [s.strip() for s in (args.sharding or "full").split(",") if s.strip()]
    allowed = ", ".join(str(s) for s in FsdpSharding)
    require(
        bool(items) and all(s in allowed.split(", ") for s in items),
        "sharding",
        args.sharding,
        f"comma-separated strategies from {allowed}",
    )
    size = whole("shard_size", args.shard_size) if args.shard_size else 0
    out = []
    for sharding in dict.fromkeys(items):
        hybrid = sharding == FsdpSharding.HYBRID
        if hybrid and not size:
            size = default_shard_size(base.ranks_per_node, 1, base.parallel.dp)
        parallel = replace(
            base.parallel,
            dp_engine=DpEngine.FSDP,
            fsdp_sharding=FsdpSharding(sharding),
            fsdp_shard_size=size if hybrid else 0,
        )
        out.append(replace(base, name=f"fsdp-{sharding}", parallel=parallel))
    return out
