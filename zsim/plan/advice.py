"""What a plan says in words: each layout in one line, the seeds' stage rule for the winner,
and what would make a request that fits nowhere fit."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from zsim.cluster.device import GB, DeviceProfile
from zsim.memory import peak_ledger
from zsim.plan.estimate import Estimator
from zsim.plan.planner import Candidate, Miss, Plan
from zsim.workload.model import ModelSpec
from zsim.workload.parallel import (
    DpEngine,
    Offload,
    ParallelConfig,
    PipelineEngine,
    Recompute,
    ZeroStage,
)
from zsim.workload.sharding import FsdpSharding


def describe(cfg: ParallelConfig) -> str:
    """A layout in one line: ZeRO stage, offload, the three sizes, batch, schedule, options."""
    parts = [f"ZeRO-{int(cfg.zero_stage)}"]
    if cfg.dp_engine is DpEngine.MEGATRON:
        parts = ["Megatron-Core " + ("DistOpt" if cfg.zero_stage else "DDP")]
    if cfg.dp_engine is DpEngine.FSDP:
        hybrid = cfg.fsdp_sharding is FsdpSharding.HYBRID
        parts = [f"FSDP {cfg.fsdp_sharding}" + (f" {cfg.shard_ranks}" if hybrid else "")]
    if cfg.zero_plus_plus:
        parts.append(cfg.zero_plus_plus)
    if cfg.offload is not Offload.NONE:
        parts.append(f"offload {cfg.offload}")
    parts.append(f"dp{cfg.dp} tp{cfg.tp} pp{cfg.pp}" + (f" cp{cfg.cp}" if cfg.cp > 1 else ""))
    parts.append(f"mb {cfg.micro_batch}x{cfg.grad_accum}")
    if cfg.pp > 1:
        engine = "Megatron" if cfg.pipeline_engine is PipelineEngine.MEGATRON else "DeepSpeed"
        schedule = str(cfg.pp_schedule)
        if cfg.virtual_stages > 1:
            schedule += f" v{cfg.virtual_stages}"
        parts.append(f"{engine} {schedule}")
    if cfg.precision.compute is not cfg.precision:
        parts.append(str(cfg.precision))
    if cfg.sequence_parallel:
        parts.append("SP")
    if str(cfg.recompute) != "none":
        parts.append(f"recompute {cfg.recompute}")
    return ", ".join(parts)


def row(c: Candidate, usable: float, bottleneck: str) -> dict[str, Any]:
    step = c.step_s
    exposed = c.report.exposed_comm_s if c.report else c.estimate.exposed_comm_s
    return {
        "layout": describe(c.cfg),
        "simulated": c.report is not None,
        "step_s": step,
        "closed_form_step_s": c.estimate.step_s,
        "tokens_per_s": c.tokens_per_s,
        "mfu": c.report.mfu if c.report else c.estimate.mfu,
        "memory_GB": c.memory.device_total / GB,
        "headroom_GB": (usable - c.memory.device_total) / GB,
        "exposed_comm_share": exposed / step,
        "bottleneck": bottleneck,
        "config": _config(c.cfg),
    }


def _config(cfg: ParallelConfig) -> dict[str, Any]:
    megatron = {"cp": cfg.cp, "overlap_grad_reduce": cfg.overlap_comm}
    megatron |= {"overlap_param_gather": cfg.overlap_param_gather}
    return (megatron if cfg.dp_engine is DpEngine.MEGATRON else {}) | {
        "dp": cfg.dp,
        "tp": cfg.tp,
        "pp": cfg.pp,
        "zero_stage": int(cfg.zero_stage),
        "dp_engine": str(cfg.dp_engine),
        "fsdp_sharding": str(cfg.fsdp_sharding),
        "fsdp_shard_size": cfg.fsdp_shard_size,
        "offload": str(cfg.offload),
        "micro_batch": cfg.micro_batch,
        "grad_accum": cfg.grad_accum,
        "recompute": str(cfg.recompute),
        "sequence_parallel": cfg.sequence_parallel,
        "pipeline_engine": str(cfg.pipeline_engine),
        "pp_schedule": str(cfg.pp_schedule),
        "virtual_stages": cfg.virtual_stages,
        "precision": str(cfg.precision),
        "flash_attention": cfg.flash_attention,
    }


def _megatron_rule(model: ModelSpec, cfg: ParallelConfig) -> str:
    """Megatron-Core's DDP holds ZeRO-0 (plain DDP) or ZeRO-1 (its distributed optimizer)."""
    stages = (ZeroStage.NONE, ZeroStage.OPTIMIZER)
    one = {
        s: replace(cfg, zero_stage=s, overlap_param_gather=s is ZeroStage.OPTIMIZER) for s in stages
    }
    states = {s: peak_ledger(model, c)[1].model_states / GB for s, c in one.items()}
    return (
        f"Megatron-Core: ZeRO-0 (DDP) {states[ZeroStage.NONE]:.2f} GB of model states, ZeRO-1 "
        f"(distributed optimizer) {states[ZeroStage.OPTIMIZER]:.2f} GB; it has no ZeRO-2 or 3."
    )


def stage_rule(
    model: ModelSpec, device: DeviceProfile, estimator: Estimator, best: Candidate
) -> str:
    """The seeds' rule for the winner's layout: each plain ZeRO stage's memory without offload
    (nor ZeRO++: the seeds' stages), the first that fits, and what ZeRO-3
    would cost in data-parallel traffic for how much more headroom."""
    if best.cfg.dp_engine is DpEngine.MEGATRON:
        return _megatron_rule(model, best.cfg)
    plain = replace(
        best.cfg.knobs, hpz_partition_size=1, quantized_weights=False, quantized_gradients=False
    )
    cfg = replace(  # the seeds' stages, as DeepSpeed runs them
        best.cfg,
        offload=Offload.NONE,
        knobs=plain,
        dp_engine=DpEngine.DEEPSPEED,
        fsdp_sharding=FsdpSharding.FULL,
        fsdp_shard_size=0,
    )
    if cfg.pp > 1:
        return "ZeRO-2 and ZeRO-3 do not run with pipeline parallelism (DeepSpeed): ZeRO-0/1 only."
    usable = device.usable_bytes
    ledgers = {s: peak_ledger(model, replace(cfg, zero_stage=s))[1] for s in ZeroStage}
    each = "; ".join(
        f"ZeRO-{int(s)} {x.model_states / GB:.2f} GB of model states, "
        f"{x.device_total / GB:.1f} total" + _squeeze(model, cfg, s, x, usable)
        for s, x in ledgers.items()
    )
    first = next((s for s in ZeroStage if ledgers[s].device_total <= usable), None)
    if first is None:
        return f"{each}. No ZeRO stage fits this layout without offload."
    line = f"{each}. ZeRO-{int(first)} is the first stage that fits it without offload"
    if first is ZeroStage.PARAMETERS or cfg.dp == 1:
        return line + "."
    mine = estimator.estimate(replace(cfg, zero_stage=first)).dp_traffic_bytes
    three = estimator.estimate(replace(cfg, zero_stage=ZeroStage.PARAMETERS)).dp_traffic_bytes
    more = (ledgers[first].device_total - ledgers[ZeroStage.PARAMETERS].device_total) / GB
    return line + (
        f"; ZeRO-3 would send {three / mine:.2f}x its data-parallel bytes per step "
        f"for {more:.1f} GB more headroom."
    )


def _squeeze(
    model: ModelSpec, cfg: ParallelConfig, stage: ZeroStage, ledger: Any, usable: float
) -> str:
    """'' when it fits; else what would make it fit: offloading the optimizer, recomputing."""
    if ledger.device_total <= usable:
        return ""
    tries: list[tuple[str, dict[str, Any]]] = [("full recompute", {"recompute": Recompute.FULL})]
    if stage >= ZeroStage.OPTIMIZER:
        tries.insert(0, ("optimizer offload", {"offload": Offload.OPTIMIZER}))
        tries.append(("both", {"offload": Offload.OPTIMIZER, "recompute": Recompute.FULL}))
    for name, change in tries:
        total = peak_ledger(model, replace(cfg, zero_stage=stage, **change))[1].device_total
        if total <= usable:
            return f" (does not fit; with {name}: {total / GB:.1f} GB)"
    return " (does not fit, not with offload or recompute either)"


def advice(model: ModelSpec, device: DeviceProfile, world: int, plan: Plan) -> list[str]:
    """For a request nothing fits: the closest misses and what would make them fit."""
    lines = []
    for miss in plan.misses[:3]:
        lines.append(
            f"{describe(miss.cfg)}: {miss.memory.device_total / GB:.1f} GB, "
            f"{miss.over_bytes / GB:.1f} GB over; most of it {miss.largest.replace('_', ' ')}"
        )
    params = model.total_params()
    need = math.ceil(16 * params / device.usable_bytes)  # ZeRO-3: 16 bytes per parameter / N
    lines.append(
        f"ZeRO-3's model states alone (16 bytes per parameter, mixed-precision Adam) need at "
        f"least {need:,} GPUs of {device.usable_bytes / GB:.1f} GB (this cluster has {world})"
    )
    if plan.misses and plan.misses[0].largest == "activations":
        lines.append("activations dominate the closest miss: a shorter sequence or full recompute")
    if not any(m.cfg.offload is Offload.OPTIMIZER_PARAMS for m in plan.misses[:3]):
        lines.append(
            "offload (--offload optimizer+params under ZeRO-3) moves the states to the host"
        )
    return lines


def miss_rows(misses: list[Miss]) -> list[dict[str, Any]]:
    return [
        {
            "layout": describe(m.cfg),
            "memory_GB": m.memory.device_total / GB,
            "over_GB": m.over_bytes / GB,
            "largest": m.largest,
        }
        for m in misses
    ]
