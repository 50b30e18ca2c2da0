"""Measured vs fitted: one figure of a calibration (pure function of the fit, Agg backend)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from zsim.calibrate.fit import Fit, predict_compute, predict_memory_traffic
from zsim.calibrate.plan import Kind, Measurement, busbw
from zsim.calibrate.profile import Calibration


def _panel(
    ax: Any,
    rows: Sequence[Measurement],
    x: Callable[[Measurement], float],
    y_of_time: Callable[[Measurement, float], float],
    predict: Callable[[Measurement], float | None],
    label: str,
    color: str,
    fitted: Callable[[Measurement], bool] = lambda _row: True,
) -> None:
    """Measured medians with IQR bars (hollow: not fitted, outside the model's regime), each
    worker launch's median as a cross where the calibration recorded them, and the model's
    curve over the same x range."""
    rows = sorted(rows, key=x)
    crosses = [
        (x(r), y_of_time(r, m)) for r in rows if r.launch_samples for m in r.launch_medians_s
    ]
    if crosses:
        cx, cy = zip(*crosses, strict=True)
        ax.plot(cx, cy, "x", ms=4, color=color, alpha=0.6, label=f"{label} launch medians")
    xs = np.array([x(r) for r in rows])
    for inside in (True, False):
        sel = [r for r in rows if fitted(r) is inside]
        if not sel:
            continue
        med = np.array([y_of_time(r, r.median_s) for r in sel])
        lo = np.array([y_of_time(r, r.q3_s) for r in sel])  # slower time = lower rate
        hi = np.array([y_of_time(r, r.q1_s) for r in sel])
        ax.errorbar(
            [x(r) for r in sel],
            med,
            yerr=[med - lo, hi - med],
            fmt="o",
            ms=4,
            color=color,
            mfc=color if inside else "none",
            label=f"{label} measured" + ("" if inside else ", not fitted"),
            capsize=2,
        )
    dense = np.geomspace(xs.min(), xs.max(), 60) if len(xs) > 1 else xs
    curve = []
    for value in dense:
        # the row nearest in x, rescaled to this x: the model is evaluated on a synthetic row
        near = min(rows, key=lambda r: abs(np.log(x(r) / value)))
        scaled = _scaled(near, value / x(near))
        t = predict(scaled)
        curve.append(np.nan if t is None else y_of_time(scaled, t))
    ax.plot(dense, curve, "-", color=color, alpha=0.8, label=f"{label} fitted")


def _scaled(row: Measurement, factor: float) -> Measurement:
    """`row` with its size-like quantity multiplied by `factor` (for a smooth model curve)."""
    if row.kind is Kind.GEMM:
        m, n, k, b = row.shape
        return dataclasses.replace(row, flops=row.flops * factor, shape=(m, n, k, b))
    if row.kind is Kind.OPTIMIZER:
        return dataclasses.replace(row, params=max(1, round(row.params * factor)))
    return dataclasses.replace(row, size_bytes=row.size_bytes * factor)


def save_fit_png(cal: Calibration, fit: Fit, path: Path) -> Path:
    """`calibration/NAME-fit.png`: GEMM FLOP/s, memory and copy bandwidth, AdamW rate, and
    busbw of every collective, measured (points, IQR bars) and fitted (lines)."""
    rows = cal.measurements
    prof = fit.profile
    used = {rows[i] for i in fit.fitted}

    def fitted(r: Measurement) -> bool:
        return r in used

    colls = sorted({(r.op, r.group) for r in rows if r.kind is Kind.COLLECTIVE})
    ncols = 4
    nrows = 1 + (len(colls) + ncols - 1) // ncols
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.4 * nrows), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]

    def compute(r: Measurement) -> float | None:
        return predict_compute(prof, r)

    def traffic(r: Measurement) -> float | None:
        return predict_memory_traffic(prof, r, host_adam=False)

    ax = axes[0][0]
    for i, op in enumerate(("mm", "bmm")):
        sel = [r for r in rows if r.kind is Kind.GEMM and r.op == op]
        if sel:
            _panel(
                ax,
                sel,
                lambda r: r.flops,
                lambda r, t: r.flops / t / 1e9,
                compute,
                op,
                colors[i],
                fitted,
            )
    _style(ax, "GEMM (hollow: matrix-vector, not fitted)", "FLOPs per call", "GFLOP/s")
    ax = axes[0][1]
    for i, op in enumerate(sorted({r.op for r in rows if r.kind is Kind.MEMORY})):
        sel = [r for r in rows if r.kind is Kind.MEMORY and r.op == op]
        _panel(
            ax,
            sel,
            lambda r: r.size_bytes,
            lambda r, t: r.size_bytes / t / 1e9,
            compute,
            op,
            colors[i],
            fitted,
        )
    _style(ax, "memory-bound kernels", "bytes moved", "GB/s")
    ax.set_yscale("log")
    ax = axes[0][2]
    for i, op in enumerate(sorted({r.op for r in rows if r.kind is Kind.HOST_COPY})):
        sel = [r for r in rows if r.kind is Kind.HOST_COPY and r.op == op]
        _panel(
            ax,
            sel,
            lambda r: r.size_bytes,
            lambda r, t: r.size_bytes / t / 1e9,
            traffic,
            op,
            colors[i],
        )
    _style(ax, "host <-> device copy", "bytes", "GB/s")
    ax = axes[0][3]
    for i, op in enumerate(sorted({r.op for r in rows if r.kind is Kind.OPTIMIZER})):
        sel = [r for r in rows if r.kind is Kind.OPTIMIZER and r.op == op]
        _panel(
            ax,
            sel,
            lambda r: float(r.params),
            lambda r, t: r.params / t / 1e6,
            traffic,
            op,
            colors[i],
            fitted,
        )
    _style(ax, "AdamW step", "parameters", "M params/s")
    for j, (op, group) in enumerate(colls):
        ax = axes[1 + j // ncols][j % ncols]
        sel = [r for r in rows if r.kind is Kind.COLLECTIVE and r.op == op and r.group == group]

        def busbw_gbps(r: Measurement, t: float) -> float:
            return busbw(r, t) / 1e9

        def coll(r: Measurement) -> float | None:
            return fit.link_predict(r)

        _panel(
            ax,
            sel,
            lambda r: r.size_bytes,
            busbw_gbps,
            coll,
            f"n={sel[0].ranks}",
            colors[0],
            fitted,
        )
        _style(ax, f"{op} ({group}, {sel[0].link_class or '?'})", "size S (bytes)", "busbw GB/s")
        ax.set_yscale("log")
    for j in range(len(colls), (nrows - 1) * ncols):
        axes[1 + j // ncols][j % ncols].set_visible(False)
    fig.suptitle(f"zsim calibration {cal.name}: measured (median, IQR) vs fitted model")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp.png")
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    tmp.replace(path)
    return path


def _style(ax: Any, title: str, xlabel: str, ylabel: str) -> None:
    ax.set_xscale("log")
    ax.set_title(title, fontsize=9)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=6)
