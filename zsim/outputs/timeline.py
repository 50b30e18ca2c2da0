"""Figures as pure functions of results (matplotlib, Agg): they draw, the caller saves."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from zsim.step.program import Category, Stream
from zsim.step.spans import FusedPass, Span

COLORS = {
    Category.FORWARD: "#4C72B0",
    Category.BACKWARD: "#55A868",
    Category.RECOMPUTE: "#8172B3",
    Category.OPTIMIZER: "#937860",
    Category.TP_COMM: "#DD8452",
    Category.CP_COMM: "#E8A87C",
    Category.FP8_AMAX: "#64B5CD",
    Category.GRAD_REDUCE: "#C44E52",
    Category.PARAM_GATHER: "#DA8BC3",
    Category.PP_COMM: "#8C8C8C",
    Category.OFFLOAD: "#CCB974",
    Category.HOST: "#2F2F2F",
}


def timeline(
    spans: Sequence[Span], title: str, max_ranks: int = 4, passes: Sequence[FusedPass] = ()
) -> Figure:
    """One lane per (rank, stream) with a bar per task, coloured by category; a fused pass is
    one bar (its kernels and TP collectives are too short to see at a step's scale)."""
    spans = [
        *spans,
        *(Span(p.rank, p.stream, p.name, p.category, p.start_s, p.end_s) for p in passes),
    ]
    every = sorted({s.rank for s in spans})
    ranks = _spread(every, max_ranks)
    if len(ranks) < len(every):
        shown = ", ".join(map(str, ranks))
        title += f"\n{len(ranks)} of {len(every)} simulated ranks shown: {shown}"
    lanes = [
        (r, st)
        for r in ranks
        for st in Stream
        if any(s.rank == r and s.stream is st for s in spans)
    ]
    fig, ax = plt.subplots(figsize=(12, 0.45 * len(lanes) + 1.5))
    scale, unit = _time_unit(max((s.end_s for s in spans), default=1.0))
    for y, (rank, stream) in enumerate(lanes):
        mine = [s for s in spans if s.rank == rank and s.stream is stream]
        bars = [(s.start_s * scale, max((s.end_s - s.start_s) * scale, 1e-9)) for s in mine]
        colors = [COLORS[Category(s.category)] for s in mine]
        ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=colors, edgecolor="none")
    ax.set_yticks(range(len(lanes)), [f"rank {r} {st}" for r, st in lanes])
    ax.invert_yaxis()
    ax.set_xlabel(f"time ({unit})")
    ax.set_title(title)
    used = {Category(s.category) for s in spans}
    ax.legend(
        handles=[Patch(color=COLORS[c], label=str(c)) for c in Category if c in used],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.12 - 0.3 / max(len(lanes), 1)),
        ncol=5,
        frameon=False,
    )
    fig.tight_layout()
    return fig


def _spread(ranks: list[int], most: int) -> list[int]:
    """At most `most` ranks, evenly spread from the first to the last."""
    if len(ranks) <= most:
        return ranks
    picks = {round(i * (len(ranks) - 1) / (most - 1)) for i in range(most)}
    return [ranks[i] for i in sorted(picks)]


def _time_unit(end_s: float) -> tuple[float, str]:
    if end_s < 1e-3:
        return 1e6, "µs"
    if end_s < 1.0:
        return 1e3, "ms"
    return 1.0, "s"
