"""What each modelled mechanism is worth on the published runs (the ablation), and the plots
of benchmarks/results/reference_runs.md: predicted against measured step time (log-log, one
colour per source) and the error against the GPU count.

The ablation simulates the same rows once per mechanism with that one switched off
(`ParallelConfig.without`, `zsim.workload.mechanisms`): a mechanism's share of the accuracy is
the change in MAPE and median error it makes, none of it fitted to these rows."""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from reference_report import mape

from zsim.workload.mechanisms import MECHANISMS, Mechanism


def ablation_table(base: list[dict[str, Any]], off: Mapping[str, list[dict[str, Any]]]) -> str:
    """One line per mechanism: MAPE and median error with it switched off, the change
    against everything on, and how many rows it moves by more than one point."""
    done = {r["row_id"]: r for r in base if r["status"] == "compared"}
    m0, med0, n0 = mape(done.values())
    lines = [
        f"All mechanisms on: MAPE {m0:.1f} %, median error {med0:+.1f} % over {n0} rows.",
        "",
        "| switched off | what it models | MAPE % | change | median error % | change "
        "| rows moved > 1 point | largest move (row, points) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, rows in off.items():
        mine = sorted(
            (r for r in rows if r["status"] == "compared" and r["row_id"] in done),
            key=lambda r: r["row_id"],  # ties in the largest move go to the first row
        )
        m, med, _ = mape(mine)
        moves = [(float(r["error_pct"]) - float(done[r["row_id"]]["error_pct"]), r) for r in mine]
        moved = sum(abs(d) > 1.0 for d, _ in moves)
        delta, row = max(moves, key=lambda dr: abs(dr[0]), default=(0.0, {"row_id": "-"}))
        lines.append(
            f"| {name} | {MECHANISMS[Mechanism(name)]} | {m:.1f} | {m - m0:+.1f} | {med:+.1f} "
            f"| {med - med0:+.1f} | {moved} | {row['row_id']}, {delta:+.1f} |"
        )
    return "\n".join(lines) + "\n"


def gpus(row: Mapping[str, Any]) -> int:
    return int(row["tp"]) * int(row["pp"]) * int(row["dp"])


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """Parity (log-log, coloured by source) and error against GPUs, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in results if r["status"] == "compared"]
    sources = sorted({r["source_id"] for r in done})
    fig, (parity, scale) = plt.subplots(1, 2, figsize=(13, 5.5))
    colours = plt.get_cmap("tab20")  # tab10's ten colours and their light twins: 20 sources
    for i, source in enumerate(sources):
        mine = [r for r in done if r["source_id"] == source]
        shade = 2 * (i % 10) + (i // 10) % 2
        kw = {"color": colours(shade), "marker": "os^D"[i // 10 % 4], "s": 22, "alpha": 0.85}
        med = statistics.median(float(r["error_pct"]) for r in mine)
        label = f"{source} ({len(mine)}, median {med:+.0f} %)"
        parity.scatter([r["measured_step_s"] for r in mine],
                       [r["predicted_step_s"] for r in mine], label=label, **kw)  # fmt: skip
        scale.scatter([gpus(r) for r in mine], [r["error_pct"] for r in mine], **kw)
    low = min(min(r["measured_step_s"], r["predicted_step_s"]) for r in done) / 1.5
    high = max(max(r["measured_step_s"], r["predicted_step_s"]) for r in done) * 1.5
    for factor, style in ((1.0, "-"), (1.1, ":"), (1 / 1.1, ":")):
        parity.plot([low, high], [low * factor, high * factor], "k" + style, lw=0.8)
    parity.set(xscale="log", yscale="log", xlim=(low, high), ylim=(low, high),
               xlabel="measured step time (s)", ylabel="zsim's predicted step time (s)",
               title="Published runs: predicted vs measured (dotted: +-10 %)")  # fmt: skip
    parity.legend(fontsize=7, loc="upper left")
    scale.axhline(0, color="k", lw=0.8)
    for bound in (-10, 10):
        scale.axhline(bound, color="k", lw=0.6, ls=":")
    scale.set(xscale="log", xlabel="GPUs", ylabel="error % ((predicted - measured) / measured)",
              title="Error against cluster size")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
