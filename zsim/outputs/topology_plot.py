"""A drawing of a topology: switches on top, NICs, then the node internals, GPUs at the bottom.

A pure function from a `Topology` to a matplotlib Figure (Agg backend); the caller saves it.
Edges are coloured by link class, and both directions of a link are drawn as one line.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from zsim.cluster.topology import Topology

_LAYER = {"spine": 5, "leaf": 4, "nic": 3, "host": 2, "pcie_switch": 1.5, "nvswitch": 0.5, "gpu": 0}
_LABEL = {"pcie_switch": "PCIe", "nvswitch": "NVSwitch", "gpu": "GPU", "nic": "NIC"}
_COLOUR = {
    "nvlink": "tab:green",
    "pcie": "tab:blue",
    "loopback": "tab:gray",
    "ib": "tab:red",
    "roce": "tab:orange",
    "ethernet": "tab:purple",
    "veth": "tab:brown",
}


def _positions(topo: Topology) -> dict[str, tuple[float, float]]:
    """x spreads each layer's vertices evenly in graph order (node-major), y is the layer."""
    layers: dict[float, list[str]] = {}
    for vertex, data in topo.graph.nodes(data=True):
        layers.setdefault(_LAYER.get(data["kind"], 1.0), []).append(vertex)
    return {
        vertex: ((i + 0.5) / len(vertices), y)
        for y, vertices in layers.items()
        for i, vertex in enumerate(vertices)
    }


def topology_figure(topo: Topology) -> Figure:
    positions = _positions(topo)
    fig, ax = plt.subplots(figsize=(min(4 + topo.world_size * 0.35, 40), 6))
    seen: set[str] = set()
    for (u, v), cls in zip(topo.edges, topo.link_class, strict=True):
        if u > v:
            continue  # the reverse direction of a link already drawn
        (x0, y0), (x1, y1) = positions[u], positions[v]
        label = None if str(cls) in seen else str(cls)
        seen.add(str(cls))
        ax.plot([x0, x1], [y0, y1], color=_COLOUR.get(str(cls), "black"), lw=0.6, label=label)
    for kind, marker in (("gpu", "s"), ("nic", "^"), ("leaf", "o"), ("spine", "o")):
        points = [positions[v] for v, d in topo.graph.nodes(data=True) if d["kind"] == kind]
        if points:
            xs, ys = zip(*points, strict=True)
            ax.scatter(xs, ys, marker=marker, s=18, color="black", zorder=3)
    ax.set_yticks(list(_LAYER.values()), [_LABEL.get(kind, kind) for kind in _LAYER])
    ax.set_xticks([])
    ax.set_title(f"{topo.name}: {topo.nodes} nodes x {topo.gpus_per_node} GPUs")
    ax.legend(loc="upper right", fontsize="small")
    fig.tight_layout()
    return fig
