"""Terminal summary of a calibration: the fitted numbers and how well they fit."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table

from zsim.calibrate.fit import Residual
from zsim.calibrate.links import HUGE_BPS
from zsim.calibrate.measurement import Kind, algbw, busbw
from zsim.calibrate.profile import Calibration
from zsim.calibrate.replay import model_of
from zsim.workload.parallel import Precision

_console = Console(highlight=False, width=120)


def summary_rows(cal: Calibration) -> list[tuple[str, str]]:
    """(quantity, value) lines of the fitted profile, units spelled out."""
    p = cal.profile
    rows: list[tuple[str, str]] = []
    for dtype, r in p.rates.items():
        rows += [
            (
                f"{dtype} GEMM",
                f"{r.gemm_flops_per_s / 1e9:.1f} GFLOP/s + {r.gemm_overhead_s * 1e6:.1f} us",
            ),
            (f"{dtype} attention", f"{r.attention_flops_per_s / 1e9:.1f} GFLOP/s"),
            (
                f"{dtype} memory-bound",
                f"{r.memory_bytes_per_s / 1e9:.2f} GB/s + {r.memory_overhead_s * 1e6:.1f} us",
            ),
        ]
    rows += [
        ("host link", f"{p.host_link_bytes_per_s / 1e9:.2f} GB/s"),
        ("AdamW (device)", f"{p.optimizer_bytes_per_s / 1e9:.2f} GB/s streamed"),
        ("AdamW (host)", f"{p.host_adam_params_per_s / 1e6:.1f} M params/s"),
        ("layer times", f"{len(p.layer_times)} shapes"),
    ]
    timed = [r for r in cal.measurements if r.kind is not Kind.COLLECTIVE]
    dropped = sum(r.dropped for r in timed)
    if dropped:
        total = dropped + sum(len(r.samples_s) for r in timed)
        rows.append(("samples dropped (rank lost its core)", f"{dropped} of {total}"))
    if p.call_latency_s is not None:
        rows.append(("collective call latency", f"{p.call_latency_s * 1e6:.1f} us"))
    if p.p2p_call_latency_s is not None:
        rows.append(("send/recv call latency", f"{p.p2p_call_latency_s * 1e6:.1f} us"))
    if p.message_s is not None:
        rows.append(("CPU per message (gloo)", f"{p.message_s * 1e6:.1f} us"))
    if p.first_touch_bytes_per_s is not None:
        touch = p.first_touch_bytes_per_s
        shown = f"{touch / 1e9:.2f} GB/s" if touch < HUGE_BPS else "none: no row faulted"
        rows.append(("page faults (gloo)", shown))
    for op, call_s in sorted(p.op_call_s.items()):
        rows.append((f"{op} own call (gloo)", f"{call_s * 1e6:.1f} us"))
    for key, seconds in p.engine_host_s.items():
        call, per_tensor = key.removesuffix("_per_tensor"), key.endswith("_per_tensor")
        unit = "per parameter tensor" if per_tensor else "per call"
        rows.append((f"DeepSpeed {call} host ({unit})", f"{seconds * 1e3:.2f} ms"))
    for op, s_per_byte in sorted(p.op_s_per_byte.items()):
        rows.append((f"{op} own CPU (gloo)", f"{s_per_byte * 1e9:.3f} ns per byte moved"))
    for cls, link in p.links.items():
        rows.append(
            (
                f"link {cls}",
                f"{link.bandwidth_bytes_per_s / 1e9:.2f} GB/s, {link.latency_s * 1e6:.1f} us",
            )
        )
    return rows


def _over(r: Residual) -> str:
    if r.over is None:
        return "-"
    apart = r.over_launches_disagree
    return str(r.over) if apart is None else f"{r.over} ({apart})"


def print_summary(cal: Calibration, paths: Sequence[Path]) -> None:
    table = Table(title=f"profile {cal.name}")
    table.add_column("fitted")
    table.add_column("value", justify="right")
    for k, v in summary_rows(cal):
        table.add_row(k, v)
    _console.print(table)
    res = Table(title="fit residuals |predicted - measured| / measured")
    numbers = ("rows", "median", "worst", "over 10%")
    for col in ("kind", "op", "fitted", *numbers, "worst row"):
        res.add_column(col, justify="right" if col in numbers else "left")
    for r in sorted(cal.residuals, key=lambda r: (not r.fitted, r.kind, r.op, r.held_out)):
        res.add_row(
            r.kind,
            r.op,
            ("held out" if r.held_out else "yes") if r.fitted else "no (outside the model)",
            str(r.rows),
            f"{r.median_rel_err:.1%}",
            f"{r.worst_rel_err:.1%}",
            _over(r),
            r.worst_label,
        )
    _console.print(res)
    _console.print(
        "held out: the same rows, each predicted by a fit that did not see its size (k-fold,"
        " zsim.calibrate.holdout). over 10%: rows the model misses by more than 10%; in brackets,"
        " where the calibration"
        " recorded its worker launches: of them, the rows whose launches' means no one time is"
        " within 10% of ('-': a profile written before these counts)"
    )
    for path in paths:
        _console.print(f"wrote {path}")


def print_collectives(cal: Calibration) -> None:
    """The collective rows in nccl-tests' terms (size, count, time, algbw, busbw), one table
    per op and group, with the simulator's time under the fitted profile, its error, and how
    far each launch's mean lies from the row's mean."""
    rows = [r for r in cal.measurements if r.kind is Kind.COLLECTIVE]
    if not rows:
        _console.print(f"{cal.name}: no collectives measured")
        return
    model_s = model_of(cal)
    heads = ("size B", "count", "time us", "algbw GB/s", "busbw GB/s", "model us", "error")
    for key in dict.fromkeys((r.op, r.group, r.ranks, r.link_class) for r in rows):
        op, group, ranks, link = key
        title = f"{cal.name}: {op} ({group}, n={ranks}, {link or '?'}; mean, GB = 1e9 B)"
        table = Table(title=title)
        for col in (*heads, "launches"):
            table.add_column(col, justify="right" if col in heads else "left")
        for r in rows:
            if (r.op, r.group, r.ranks, r.link_class) != key:
                continue
            t, model = r.time_s, model_s(r)
            launches = r.launch_times_s if r.launch_samples else ()
            table.add_row(
                f"{r.size_bytes:.0f}",
                f"{r.size_bytes / Precision(r.dtype).bytes:.0f}",
                f"{t * 1e6:.1f}",
                f"{algbw(r, t) / 1e9:.3f}",
                f"{busbw(r, t) / 1e9:.3f}",
                f"{model * 1e6:.1f}",
                f"{model / t - 1:+.1%}",
                " ".join(f"{m / t - 1:+.0%}" for m in launches),
            )
        _console.print(table)
    _console.print("launches: each worker launch's mean against the row's mean")
