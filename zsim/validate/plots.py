"""The validation figure: a pure function of the compared cases (matplotlib, Agg).

Left: step time per case, measured beside predicted, the prediction's band as an error bar;
a case that failed shows its status instead of a bar. Right: predicted against measured on
log axes, the diagonal and the +-10% band.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from zsim.validate.compare import Compared, mape

PARITY_BAND = 0.10


def figure(rows: Sequence[Compared], title: str) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, (bars, parity) = plt.subplots(1, 2, figsize=(12, 4.8), constrained_layout=True)
    _bars(bars, rows)
    _parity(parity, rows)
    error = mape(rows)
    suffix = f"  (MAPE {error:.1f}%)" if error is not None else "  (no predictions)"
    fig.suptitle(title + suffix)
    return fig


def _bars(ax: Any, rows: Sequence[Compared]) -> None:
    from matplotlib.patches import Patch

    width = 0.38
    for i, r in enumerate(rows):
        m, p = r.measurement, r.prediction
        if m.step_time_s is not None:
            ax.bar(i - width / 2, m.step_time_s, width, color="tab:blue")
            steps = m.step_times_s
            ax.plot([i - width / 2] * len(steps), steps, "k.", ms=3)
        else:
            ax.text(i, 0, str(m.status), ha="center", va="bottom", rotation=90, color="tab:red")
        if p is not None:
            err = [[p.step_time_s - p.low_s], [p.high_s - p.step_time_s]]
            ax.bar(i + width / 2, p.step_time_s, width, color="tab:orange", yerr=err, capsize=4)
    handles = [
        Patch(color="tab:blue", label="measured (median step; dots: each step)"),
        Patch(color="tab:orange", label="predicted (bar: 5-95% band)"),
    ]
    ax.legend(handles=handles, loc="upper left", fontsize=8)
    ax.set_xticks(range(len(rows)), [_label(r) for r in rows])
    ax.set_ylabel("step time (s)")
    notes = {r.prediction_note for r in rows if r.prediction is None and r.prediction_note}
    if notes:
        ax.set_xlabel("no prediction: " + "; ".join(sorted(notes))[:110], fontsize=8)


def _parity(ax: Any, rows: Sequence[Compared]) -> None:
    points = [
        (r.measurement.step_time_s, r.prediction, r.case.name)
        for r in rows
        if r.measurement.step_time_s is not None and r.prediction is not None
    ]
    ax.set_xlabel("measured step time (s)")
    ax.set_ylabel("predicted step time (s)")
    if not points:
        ax.text(0.5, 0.5, "no case has both numbers", ha="center", transform=ax.transAxes)
        return
    values = [v for m, p, _ in points for v in (m, p.low_s, p.high_s) if v is not None]
    lo, hi = min(values) / 1.5, max(values) * 1.5
    line = [lo, hi]
    ax.plot(line, line, color="black", lw=1, label="predicted = measured")
    ax.fill_between(
        line,
        [v * (1 - PARITY_BAND) for v in line],
        [v * (1 + PARITY_BAND) for v in line],
        color="grey",
        alpha=0.25,
        label=f"±{PARITY_BAND:.0%}",
    )
    for number, (measured, p, _) in enumerate(points, start=1):
        err = [[p.step_time_s - p.low_s], [p.high_s - p.step_time_s]]
        ax.errorbar(measured, p.step_time_s, yerr=err, fmt="o", capsize=3, color="tab:orange")
        # points of similar time sit on each other: numbers at alternating sides, names in a key
        side = (6, 4) if number % 2 else (-12, -10)
        ax.annotate(str(number), (measured, p.step_time_s), textcoords="offset points", xytext=side)
    key = "\n".join(f"{n}  {label}" for n, (*_, label) in enumerate(points, start=1))
    ax.text(0.98, 0.02, key, transform=ax.transAxes, ha="right", va="bottom", fontsize=7)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.legend(loc="upper left", fontsize=8)


def _label(r: Compared) -> str:
    return f"{r.case.name}\nZeRO-{int(r.case.parallel.zero_stage)}"
