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
from zsim.calibrate.measurement import Kind, Measurement, busbw
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
    """Measured means (what the models are fitted to) with the samples' interquartile range
    as a bar (hollow: not fitted, outside the model's regime; a mean can lie outside its IQR
    where the samples are bimodal), each worker launch's mean as a cross where the calibration
    recorded them, and the model's curve over the same x range."""
    rows = sorted(rows, key=x)
    crosses = [(x(r), y_of_time(r, m)) for r in rows if r.launch_samples for m in r.launch_times_s]
    if crosses:
        cx, cy = zip(*crosses, strict=True)
        ax.plot(cx, cy, "x", ms=4, color=color, alpha=0.6, label=f"{label} launch means")
    xs = np.array([x(r) for r in rows])
    for inside in (True, False):
        sel = [r for r in rows if fitted(r) is inside]
        if not sel:
            continue
        at = [x(r) for r in sel]
        lo = [y_of_time(r, r.q3_s) for r in sel]  # slower time = lower rate
        hi = [y_of_time(r, r.q1_s) for r in sel]
        ax.vlines(at, lo, hi, color=color, lw=1)
        ax.plot(
            at,
            [y_of_time(r, r.time_s) for r in sel],
            "o",
            ms=4,
            color=color,
            mfc=color if inside else "none",
            label=f"{label} measured mean" + ("" if inside else ", not fitted"),
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


@dataclasses.dataclass(frozen=True)
class _Top:
    """One of the figure's first-row panels: a kind of row, drawn as a rate against a size."""

    kind: Kind
    x: Callable[[Measurement], float]
    rate: Callable[[Measurement, float], float]
    title: str
    xlabel: str
    ylabel: str
    traffic: bool = False  # predicted as memory traffic (copies, Adam) rather than compute
    mark_fitted: bool = True
    log_rate: bool = False


_TOP_PANELS = (
    _Top(
        Kind.GEMM,
        lambda r: r.flops,
        lambda r, t: r.flops / t / 1e9,
        "GEMM (hollow: matrix-vector, not fitted)",
        "FLOPs per call",
        "GFLOP/s",
    ),
    _Top(
        Kind.MEMORY,
        lambda r: r.size_bytes,
        lambda r, t: r.size_bytes / t / 1e9,
        "memory-bound kernels",
        "bytes moved",
        "GB/s",
        log_rate=True,
    ),
    _Top(
        Kind.HOST_COPY,
        lambda r: r.size_bytes,
        lambda r, t: r.size_bytes / t / 1e9,
        "host <-> device copy",
        "bytes",
        "GB/s",
        traffic=True,
        mark_fitted=False,
    ),
    _Top(
        Kind.OPTIMIZER,
        lambda r: float(r.params),
        lambda r, t: r.params / t / 1e6,
        "AdamW step",
        "parameters",
        "M params/s",
        traffic=True,
    ),
)


def fit_figure(cal: Calibration, fit: Fit) -> Any:
    """GEMM FLOP/s, memory and copy bandwidth, AdamW rate, and busbw of every collective,
    measured (means, IQR bars) and fitted (lines)."""
    rows = cal.measurements
    used = {rows[i] for i in fit.fitted}
    colls = sorted({(r.op, r.group) for r in rows if r.kind is Kind.COLLECTIVE})
    ncols = 4
    nrows = 1 + (len(colls) + ncols - 1) // ncols
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.4 * nrows), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, top in zip(axes[0], _TOP_PANELS, strict=True):
        _top_panel(ax, top, rows, fit, used, colors)
    for j, (op, group) in enumerate(colls):
        ax = axes[1 + j // ncols][j % ncols]
        sel = [r for r in rows if r.kind is Kind.COLLECTIVE and r.op == op and r.group == group]
        _panel(
            ax,
            sel,
            lambda r: r.size_bytes,
            lambda r, t: busbw(r, t) / 1e9,
            fit.link_predict,
            f"n={sel[0].ranks}",
            colors[0],
            lambda r: r in used,
        )
        _style(ax, f"{op} ({group}, {sel[0].link_class or '?'})", "size S (bytes)", "busbw GB/s")
        ax.set_yscale("log")
    for j in range(len(colls), (nrows - 1) * ncols):
        axes[1 + j // ncols][j % ncols].set_visible(False)
    fig.suptitle(f"zsim calibration {cal.name}: measured (mean; bars: IQR) vs fitted model")
    fig.tight_layout()
    return fig


def _top_panel(
    ax: Any,
    top: _Top,
    rows: Sequence[Measurement],
    fit: Fit,
    used: set[Measurement],
    colors: Sequence[str],
) -> None:
    def predict(r: Measurement) -> float | None:
        if top.traffic:
            return predict_memory_traffic(fit.profile, r, host_adam=False)
        return predict_compute(fit.profile, r)

    ops = (
        ("mm", "bmm")
        if top.kind is Kind.GEMM
        else sorted({r.op for r in rows if r.kind is top.kind})
    )
    for i, op in enumerate(ops):
        sel = [r for r in rows if r.kind is top.kind and r.op == op]
        if sel:
            marks = (lambda r: r in used) if top.mark_fitted else (lambda _r: True)
            _panel(ax, sel, top.x, top.rate, predict, op, colors[i], marks)
    _style(ax, top.title, top.xlabel, top.ylabel)
    if top.log_rate:
        ax.set_yscale("log")


def save_fit_png(cal: Calibration, fit: Fit, path: Path) -> Path:
    """`calibration/NAME-fit.png` (`fit_figure`), renamed into place when complete."""
    fig = fit_figure(cal, fit)
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
