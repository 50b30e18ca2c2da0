"""A sweep's figure (matplotlib, Agg): tokens/s per GPU against the cluster's GPUs, one line
per model, fabric and ZeRO stage (the best of the other settings at each size); and the
winner per model and cluster. The caller saves the figure."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from zsim.cluster.names import fabric_of


def sweep_figure(rows: Sequence[Mapping[str, str]]) -> Figure:
    ok = [r for r in rows if r.get("status") == "ok" and r.get("tokens_per_s_per_gpu")]
    lines: dict[tuple[str, str, str], dict[int, float]] = defaultdict(dict)
    best: dict[tuple[str, str], tuple[float, str]] = {}
    for r in ok:
        rate, gpus = float(r["tokens_per_s_per_gpu"]), int(r["gpus"])
        line = lines[(r["model"], fabric_of(r["topology"]), r.get("stage") or "plan")]
        line[gpus] = max(rate, line.get(gpus, 0.0))
        label = r.get("layout") or f"ZeRO-{r.get('stage', '?')} tp{r.get('tp') or 1}"
        label += f" pp{r.get('pp') or 1}" if not r.get("layout") else ""
        cluster = (r["model"], r["topology"])
        if rate > best.get(cluster, (0.0, ""))[0]:
            best[cluster] = (rate, label)
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    for (model, fabric, stage), points in sorted(lines.items()):
        sizes = sorted(points)
        name = f"{model}, {fabric}, " + (f"ZeRO-{stage}" if stage != "plan" else "planned")
        left.plot(sizes, [points[g] for g in sizes], "o-", label=name)
    left.set(xscale="log", xlabel="GPUs", ylabel="tokens/s per GPU", title="throughput per GPU")
    left.legend(fontsize=7)
    names = [f"{m}\n{t}" for m, t in best]
    right.barh(names, [v[0] for v in best.values()], color="tab:blue")
    for i, (rate, label) in enumerate(best.values()):
        right.text(rate, i, f" {label}", va="center", fontsize=7)
    right.set(xlabel="tokens/s per GPU", title="the winner per model and cluster")
    right.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    return fig
