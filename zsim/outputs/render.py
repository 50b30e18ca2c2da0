"""Turning results into JSON-ready dicts and terminal tables. GB means 1e9 bytes."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from zsim.cluster.device import GB, DeviceProfile
from zsim.memory import MemoryLedger, overflow_bytes
from zsim.simulation import Report
from zsim.step.spans import Fold
from zsim.workload.model import ModelKind, ModelSpec
from zsim.workload.parallel import DpEngine, ParallelConfig, ZeroStage
from zsim.workload.te_overlap import TE_DEFAULT_SMS

# piped output is not cut to 80 columns (rich's default without a terminal); a narrow
# terminal wraps cells instead of truncating them
_console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)

LEDGER_ROWS = (
    "parameters",
    "gradients",
    "optimizer_states",
    "model_states",
    "activations",
    "comm_buffers",
    "step_buffers",
    "device_total",
    "host_offloaded",
)


def gb(value: float | None) -> float | None:
    return None if value is None else value / GB


def model_summary(model: ModelSpec) -> dict[str, Any]:
    out: dict[str, Any] = {"name": model.name, "params": model.total_params()}
    if model.kind is not ModelKind.PARAMS_ONLY:
        out |= {
            "layers": model.layers,
            "hidden": model.hidden,
            "heads": model.heads,
            "seq_len": model.seq_len,
            "vocab": model.vocab,
        }
    return out


def _cp(p: dict[str, Any]) -> str:
    """The context-parallel size where there is one (reports written before it have none)."""
    return f" cp={p['cp']}" if p.get("cp", 1) > 1 else ""


def parallel_summary(cfg: ParallelConfig) -> dict[str, Any]:
    return (
        ({"cp": cfg.cp} if cfg.cp > 1 else {})
        | {
            "dp": cfg.dp,
            "tp": cfg.tp,
            "pp": cfg.pp,
            "zero_stage": int(cfg.zero_stage),
            "micro_batch": cfg.micro_batch,
            "grad_accum": cfg.grad_accum,
            "global_batch": cfg.global_batch,
            "precision": str(cfg.precision),
            "recompute": str(cfg.recompute),
            "offload": str(cfg.offload),
            "sequence_parallel": cfg.sequence_parallel,
            "flash_attention": cfg.flash_attention,
        }
        | _non_default(cfg)
    )


def _non_default(cfg: ParallelConfig) -> dict[str, Any]:
    """What a layout turns on beyond DeepSpeed's defaults (absent otherwise)."""
    out: dict[str, Any] = {"zero_plus_plus": cfg.zero_plus_plus} if cfg.zero_plus_plus else {}
    if cfg.dp_engine is not DpEngine.DEEPSPEED:
        out["dp_engine"] = str(cfg.dp_engine)
    flags = [("--overlap-grad-reduce", cfg.dp_engine is DpEngine.MEGATRON and cfg.overlap_comm)]
    flags += [("--overlap-param-gather", cfg.overlap_param_gather)]
    flags += [("--tp-comm-overlap", cfg.tp_comm_overlap)]
    if any(on for _, on in flags):
        out["megatron_overlaps"] = [name for name, on in flags if on]
    if cfg.tp_comm_overlap and cfg.tp_overlap_sms != TE_DEFAULT_SMS:
        out["tp_overlap_sms"] = dict(cfg.tp_overlap_sms)
    if not cfg.async_tp_allreduce and cfg.tp > 1:
        out["async_tp_allreduce"] = False
    if not cfg.grad_accumulation_fusion:
        out["grad_accumulation_fusion"] = False
    if cfg.elementwise.eager:
        out["elementwise"] = str(cfg.elementwise)
    if cfg.without:
        out["without"] = sorted(str(m) for m in cfg.without)
    return out


def memory_report(
    model: ModelSpec,
    cfg: ParallelConfig,
    device: DeviceProfile,
    ledgers: Mapping[ZeroStage, tuple[int, MemoryLedger]],
) -> dict[str, Any]:
    stages = {}
    for stage, (pp_stage, ledger) in ledgers.items():
        row: dict[str, Any] = {f"{k}_GB": gb(v) for k, v in ledger.as_dict().items()}
        row["pipeline_stage"] = pp_stage
        row["fits"] = overflow_bytes(ledger, device) <= 0
        stages[str(int(stage))] = row
    first = next(
        (int(s) for s, (_, ledger) in ledgers.items() if overflow_bytes(ledger, device) <= 0),
        None,
    )
    parallel = parallel_summary(cfg)
    parallel.pop("zero_stage")
    return {
        "model": model_summary(model),
        "parallel": parallel,
        "gpu": {
            "name": device.name,
            "memory_GB": gb(device.memory_bytes),
            "usable_GB": gb(device.usable_bytes),
        },
        "stages": stages,
        "first_stage_that_fits": first,
    }


def print_memory(report: dict[str, Any]) -> None:
    m, p, g = report["model"], report["parallel"], report["gpu"]
    _console.print(
        f"[bold]{m['name']}[/] ({m['params'] / 1e9:.3g}B parameters)  "
        f"dp={p['dp']} tp={p['tp']} pp={p['pp']}{_cp(p)}  {p['precision']}  "
        f"micro-batch {p['micro_batch']} x accum {p['grad_accum']} "
        f"= global batch {p['global_batch']}  offload {p['offload']}"
    )
    table = Table(
        title=f"Memory per GPU, GB (1e9 bytes); {g['name']}: {g['memory_GB']:.1f} GB, "
        f"{g['usable_GB']:.1f} usable"
    )
    table.add_column("")
    for stage in report["stages"]:
        table.add_column("DP" if stage == "0" else f"ZeRO-{stage}", justify="right")
    for key in LEDGER_ROWS:
        values = [s[f"{key}_GB"] for s in report["stages"].values()]
        cells = ["n/a" if v is None else f"{v:,.2f}" for v in values]
        style = "bold" if key in ("model_states", "device_total") else None
        table.add_row(key.replace("_", " "), *cells, style=style)
    table.add_row(
        "fits", *("yes" if s["fits"] else "[red]no[/]" for s in report["stages"].values())
    )
    _console.print(table)
    first = report["first_stage_that_fits"]
    offload = "" if p["offload"] == "none" else f" with offload {p['offload']}"
    if first is None:
        _console.print(
            f"No ZeRO stage fits {g['name']}{offload}: shard further (tp/pp), "
            "recompute activations, or offload."
        )
    else:
        label = "plain DP" if first == 0 else f"ZeRO-{first}"
        how = offload if offload and first else " without offload"  # DP cannot offload
        _console.print(
            f"First stage that fits {g['name']}{how}: [bold]{label}[/] "
            f"({report['stages'][str(first)]['device_total_GB']:.2f} GB "
            f"of {g['usable_GB']:.1f} GB usable)."
        )


def model_row(model: ModelSpec) -> dict[str, Any]:
    return model_summary(model)


def gpu_row(device: DeviceProfile) -> dict[str, Any]:
    fp16 = device.rates.get("bf16") or device.rates.get("fp16")
    return {
        "name": device.name,
        "memory_GB": round(device.memory_bytes / GB, 1),
        "peak_16bit_TFLOPS": round(
            device.peak_flops.get("bf16", device.peak_flops.get("fp16", 0)) / 1e12, 1
        ),
        "fitted_gemm_TFLOPS": round(fp16.gemm_flops_per_s / 1e12, 1) if fp16 else None,
        "fitted_hbm_GBps": round(fp16.memory_bytes_per_s / GB) if fp16 else None,
        "notes": "; ".join(device.notes),
    }


def print_rows(rows: Sequence[Mapping[str, Any]], title: str) -> None:
    if not rows:
        return
    table = Table(title=title)
    for key in rows[0]:
        table.add_column(key, overflow="fold")
    for row in rows:
        table.add_row(*("" if v is None else str(v) for v in row.values()))
    _console.print(table)


def note(text: str) -> None:
    _console.print(f"[dim]{text}[/]")


def run_report(
    model: ModelSpec, cfg: ParallelConfig, topology: str, device: DeviceProfile, report: Report
) -> dict[str, Any]:
    out = {
        "model": model_summary(model),
        "parallel": parallel_summary(cfg),
        "topology": topology,
        "device": device.name,
        **report.as_dict(),
    }
    out["memory_GB"] = {k: gb(v) for k, v in report.memory.as_dict().items()}
    out["usable_memory_GB"] = gb(device.usable_bytes)
    out["traffic_GB_per_gpu"] = {k: v / GB for k, v in report.traffic_bytes_per_gpu.items()}
    out["link_traffic_GB"] = {k: v / GB for k, v in report.link_traffic_bytes.items()}
    return out


def print_run(r: dict[str, Any]) -> None:
    _console.print(_run_header(r))
    t = Table(
        title=f"One training step (simulated); its time on rank {r['critical_rank']}, "
        "the rank that sets it",
        show_header=False,
    )
    t.add_column("")
    t.add_column("", justify="right")
    step = r["step_time_s"]
    rows = [
        ("step time", f"{step * 1e3:,.2f} ms"),
        ("throughput", f"{r['samples_per_s']:,.2f} samples/s, {r['tokens_per_s']:,.0f} tokens/s"),
        (
            "model TFLOP/s per GPU",
            f"{r['model_tflops_per_gpu']:,.1f} (MFU {r['mfu']:.1%}, HFU {r['hfu']:.1%})",
        ),
        ("compute", f"{r['compute_s'] * 1e3:,.2f} ms ({r['compute_s'] / step:.0%})"),
        (
            "exposed communication",
            f"{r['exposed_comm_s'] * 1e3:,.2f} ms ({r['exposed_comm_s'] / step:.0%})",
        ),
        *_host_row(r),
        (
            "idle (pipeline bubble, waits)",
            f"{r['bubble_s'] * 1e3:,.2f} ms ({r['bubble_s'] / step:.0%})",
        ),
    ]
    for key, value in sorted(r["traffic_GB_per_gpu"].items()):
        rows.append((f"sent per GPU: {key}", f"{value:,.3f} GB"))
    for key, value in sorted(r["link_traffic_GB"].items()):
        rows.append((f"carried by {key} links (sum)", f"{value:,.3f} GB"))
    for row in rows:
        t.add_row(*row)
    _console.print(t)
    _console.print(bottleneck(r))
    mem = r["memory_GB"]
    lines = ", ".join(
        f"{k.replace('_', ' ')} {mem[k]:,.2f}"
        for k in (
            "parameters",
            "gradients",
            "optimizer_states",
            "activations",
            "comm_buffers",
            "step_buffers",
        )
        if mem.get(k) is not None
    )
    verdict = "fits" if r["fits"] else "[red bold]does NOT fit (OOM)[/]"
    _console.print(
        f"Memory per GPU (pipeline stage {r['memory_pipeline_stage']}), GB: {lines}; "
        f"total [bold]{mem['device_total']:,.2f}[/] of {r['usable_memory_GB']:,.1f} "
        f"usable: {verdict}"
        + (f"; {mem['host_offloaded']:,.2f} GB on the host" if mem["host_offloaded"] else "")
    )


def _run_header(r: dict[str, Any]) -> str:
    m, p = r["model"], r["parallel"]
    seq = f", seq {m['seq_len']}" if "seq_len" in m else ""
    extras = [x for x in ("sequence_parallel", "flash_attention") if p[x]]
    return (
        f"[bold]{m['name']}[/] ({m['params'] / 1e9:.3g}B{seq}) on [bold]{r['topology']}[/] "
        f"({r['device']}): ZeRO-{p['zero_stage']} dp={p['dp']} tp={p['tp']} pp={p['pp']}{_cp(p)}, "
        f"{p['precision']}, micro-batch {p['micro_batch']} x accum {p['grad_accum']} = "
        f"global batch {p['global_batch']}, recompute {p['recompute']}, offload {p['offload']}"
        + "".join(f", {x.replace('_', ' ')}" for x in extras)
        + (f", ZeRO++ {p['zero_plus_plus']}" if p.get("zero_plus_plus") else "")
        + (f", {p['dp_engine']} DP" if p.get("dp_engine") else "")
        + (f", {p['elementwise']} elementwise ops" if p.get("elementwise") else "")
        + "".join(f" {flag}" for flag in p.get("megatron_overlaps", []))
        + (" --no-async-tensor-model-parallel-allreduce" if "async_tp_allreduce" in p else "")
        + (" --no-gradient-accumulation-fusion" if "grad_accumulation_fusion" in p else "")
        + (f", without {', '.join(p['without'])}" if p.get("without") else "")
    )


def _host_row(r: dict[str, Any]) -> list[tuple[str, str]]:
    """The host's own work, counted in the exposed time (the GPU waits for it as for a
    collective): a row of its own where there is any."""
    host, step = r["exposed_by_category_s"].get("host", 0.0), r["step_time_s"]
    if host <= 0:
        return []
    return [("  of it the host's own work", f"{host * 1e3:,.2f} ms ({host / step:.0%})")]


HOST_WORK = "the host's own work (DeepSpeed's per-rank bookkeeping: zsim.step.zero3_host)"


def bottleneck(r: dict[str, Any]) -> str:
    """One line: what the step's time mostly goes to on the rank that sets it, and the
    largest loss (the time that is not compute)."""
    step, rank = r["step_time_s"], r["critical_rank"]
    idle, exposed = r["bubble_s"], r["exposed_comm_s"]
    if idle >= exposed:
        loss = f"idle time {idle / step:.0%} (pipeline bubble, waiting on other ranks)"
    else:
        by = r["exposed_by_category_s"]
        top = max(by, key=lambda k: by[k]) if by else "communication"
        top = HOST_WORK if top == "host" else top
        loss = f"exposed communication {exposed / step:.0%}, mostly {top}"
    if r["compute_s"] >= max(idle, exposed):
        head = f"compute, {r['compute_s'] / step:.0%} of the step on rank {rank}"
        return f"Bottleneck: {head} (MFU {r['mfu']:.1%}); the largest loss: {loss}."
    return f"Bottleneck: {loss} on rank {rank}; compute {r['compute_s'] / step:.0%}."


def fold_note(fold: Fold | None, micro_batches: int) -> list[str]:
    """What a folded step simulated (`zsim.step.fold`), for the run's notes."""
    if fold is None:
        return []
    return [
        f"pipeline steady state: {fold.micro_batches} of {micro_batches} micro-batches "
        f"simulated, then {fold.periods} periods of {fold.period_s * 1e3:.3g} ms repeated "
        "(checked periodic on every simulated rank; --trace or --plot simulates them all)"
    ]
