"""The throughput-memory frontier of a plan (matplotlib, Agg): the caller saves the figure."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.figure import Figure


def frontier(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other beats on both counts (less memory, more throughput),
    by memory."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], -points[i][1]))
    best, kept = float("-inf"), []
    for i in order:
        if points[i][1] > best:
            kept.append(i)
            best = points[i][1]
    return kept


def pareto_figure(
    points: Sequence[tuple[float, float]], labels: Sequence[str], usable_gb: float, title: str
) -> Figure:
    """Every fitting layout as (memory per GPU GB, tokens/s), the frontier joined and named."""
    fig, ax = plt.subplots(figsize=(9, 5.5))
    ax.scatter([p[0] for p in points], [p[1] for p in points], s=8, color="0.7", label="layouts")
    front = frontier(points)
    ax.plot(
        [points[i][0] for i in front],
        [points[i][1] for i in front],
        "o-",
        color="tab:blue",
        label="frontier (less memory or more throughput than any other)",
    )
    for n, i in enumerate(front, start=1):
        ax.annotate(str(n), points[i], textcoords="offset points", xytext=(4, 4), fontsize=7)
    key = "\n".join(f"{n}  {labels[i]}" for n, i in enumerate(front, start=1))
    ax.text(1.02, 1.0, key, transform=ax.transAxes, va="top", fontsize=6.5, family="monospace")
    ax.axvline(usable_gb, color="tab:red", lw=1, ls="--", label=f"usable {usable_gb:.1f} GB")
    ax.set_xlabel("memory per GPU (GB)")
    ax.set_ylabel("tokens/s (closed-form tier)")
    ax.set_title(title)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    return fig
