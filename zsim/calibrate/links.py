"""Link latency and bandwidth per link class, fitted so that zsim's own collective model
(`zsim.collectives.estimate_s` on the measured cluster's topology) reproduces the measured
collective times.

The model's time of a call is linear in its unknowns as long as the bottleneck link class of a
route does not change: t = call_latency + sum_c a_c * latency_c + b * (1 / bandwidth_g), where
a_c counts the link latencies of class c the algorithm pays and b the bytes it pushes through
the group's bottleneck class g. The coefficients are read off the model itself by probing it
(every class at latency 0 and a huge bandwidth, then one class at latency 1 s or bandwidth
1 B/s), so no formula of zsim.collectives is copied here. The unknowns are then found by
non-negative least squares on relative error, and the residuals are computed with the real
`estimate_s` at the fitted values.

`apply_profile` is how a profile's links and call latency override a topology: the simulator
and this fit use the same function.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from zsim.calibrate.plan import Collective, Kind, Measurement
from zsim.collectives import CollectiveCall, CollectiveOp, estimate_s
from zsim.errors import require
from zsim.fabric import LinkClass
from zsim.hardware import DeviceProfile, LinkFit
from zsim.topology import Topology, with_call_latency, with_link_class

OPS = {
    Collective.ALL_GATHER: CollectiveOp.ALL_GATHER,
    Collective.REDUCE_SCATTER: CollectiveOp.REDUCE_SCATTER,
    Collective.ALL_REDUCE: CollectiveOp.ALL_REDUCE,
    Collective.BROADCAST: CollectiveOp.BROADCAST,
    Collective.SENDRECV: CollectiveOp.SEND_RECV,
}
HUGE_BPS = 1e30  # a bandwidth that never limits (probing)


def apply_profile(topo: Topology, profile: DeviceProfile) -> Topology:
    """`topo` with the profile's fitted links (by class) and call latency."""
    for cls in sorted(profile.links):
        if any(str(c) == cls for c in topo.link_class):
            link = profile.links[cls]
            topo = with_link_class(
                topo,
                LinkClass(cls),
                bandwidth_bytes_per_s=link.bandwidth_bytes_per_s,
                latency_s=link.latency_s,
            )
    if profile.call_latency_s is not None:
        topo = with_call_latency(topo, profile.call_latency_s)
    return topo


def group_gpus(topo: Topology, group: str, ranks: int) -> tuple[int, ...]:
    """The GPUs (ranks) of the measured group the calibration worker's rank 0 was in."""
    g = topo.gpus_per_node
    if group == "intra":
        return tuple(range(min(ranks, g)))
    if group == "inter":
        return tuple(range(0, topo.world_size, g))[:ranks]
    return tuple(range(ranks))


def call_of(topo: Topology, row: Measurement) -> CollectiveCall:
    """The CollectiveCall zsim simulates for a measured collective row."""
    gpus = group_gpus(topo, row.group, row.ranks)
    op = OPS[Collective(row.op)]
    if op is CollectiveOp.SEND_RECV:
        gpus = gpus[:2]  # each rank sends to the next: every flow alike, on its own links
    return CollectiveCall(op, row.size_bytes, gpus)


def bottleneck_class(topo: Topology, gpus: Sequence[int]) -> LinkClass:
    """The class of the narrowest link on the route from the first GPU to the others."""
    best: tuple[float, LinkClass] | None = None
    for dst in gpus[1:]:
        for e in topo.route(gpus[0], dst).links:
            cand = (float(topo.bandwidth_bytes_per_s[e]), topo.link_class[e])
            best = cand if best is None or cand[0] < best[0] else best
    require(best is not None, "group", list(gpus), "at least two GPUs")
    assert best is not None
    return best[1]


def link_class_of(topo: Topology, group: str, ranks: int) -> str:
    return str(bottleneck_class(topo, group_gpus(topo, group, ranks)))


@dataclass(frozen=True)
class LinkModelFit:
    """The fitted call latency and links, and the model's time of each fitted row."""

    call_latency_s: float
    links: dict[str, LinkFit]
    predictions: dict[int, float]  # row index -> seconds


def _probe(
    topo: Topology,
    classes: Sequence[LinkClass],
    latency: dict[LinkClass, float],
    bandwidth: dict[LinkClass, float],
) -> Topology:
    out = with_call_latency(topo, 0.0)
    for c in classes:
        out = with_link_class(
            out, c, latency_s=latency.get(c, 0.0), bandwidth_bytes_per_s=bandwidth.get(c, HUGE_BPS)
        )
    return out


def fit_links(topo: Topology, rows: Sequence[tuple[int, Measurement]]) -> LinkModelFit:
    """Call latency and (latency, bandwidth) of every link class the rows exercise."""
    require(bool(rows), "collective rows", 0, "at least one collective measurement")
    classes = sorted(set(topo.link_class), key=str)
    calls = [call_of(topo, r) for _, r in rows]
    owners = [bottleneck_class(topo, c.group) for c in calls]
    zero = _probe(topo, classes, {}, {})
    base = np.array([estimate_s(zero, c) for c in calls])
    columns: list[np.ndarray] = [np.ones(len(calls))]
    names: list[tuple[str, LinkClass | None]] = [("call", None)]
    for cls in classes:
        lat = _probe(topo, classes, {cls: 1.0}, {})
        a = np.array([estimate_s(lat, c) for c in calls]) - base
        bw = _probe(topo, classes, {}, {cls: 1.0})
        b = np.array([estimate_s(bw, c) for c in calls]) - base
        b = np.where([o is cls for o in owners], b, 0.0)
        if np.any(a > 0):
            columns.append(a)
            names.append(("latency", cls))
        if np.any(b > 0):
            columns.append(b)
            names.append(("inv_bandwidth", cls))
    t = np.array([r.median_s for _, r in rows])
    solution = nonnegative_lstsq(np.stack(columns, axis=1) / t[:, None], 1.0 - base / t)
    values = dict(zip(names, solution, strict=True))
    links: dict[str, LinkFit] = {}
    for cls in classes:
        inv = values.get(("inv_bandwidth", cls))
        if inv is None:
            continue  # no row's bandwidth depends on this class: not measured
        preset_bw = float(topo.bandwidth_bytes_per_s[[c is cls for c in topo.link_class]][0])
        links[str(cls)] = LinkFit(
            latency_s=float(values.get(("latency", cls), 0.0)),
            bandwidth_bytes_per_s=float(1.0 / inv) if inv > 0 else preset_bw,
        )
    call_latency = float(values[("call", None)])
    fitted = DeviceProfile(
        name="links",
        memory_bytes=1.0,
        reserved_bytes=0.0,
        peak_flops={},
        rates={},
        host_link_bytes_per_s=1.0,
        optimizer_bytes_per_s=1.0,
        links=links,
        call_latency_s=call_latency,
    )
    final = apply_profile(topo, fitted)
    predictions = {i: float(estimate_s(final, c)) for (i, _), c in zip(rows, calls, strict=True)}
    return LinkModelFit(call_latency, links, predictions)


def nonnegative_lstsq(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin |a x - y| with x >= 0, by trying every set of free variables (few unknowns)."""
    n = a.shape[1]
    require(n <= 12, "unknowns", n, "at most 12 (one call latency and a few link classes)")
    best, best_err = np.zeros(n), float(np.sum(y * y))
    for k in range(1, n + 1):
        for free in itertools.combinations(range(n), k):
            sub = a[:, free]
            x, *_ = np.linalg.lstsq(sub, y, rcond=None)
            if np.any(x < 0):
                continue
            err = float(np.sum((sub @ x - y) ** 2))
            if err < best_err:
                best_err, best = err, np.zeros(n)
                best[list(free)] = x
    return best


def predictor(fitted_topo: Topology) -> Callable[[Measurement], float | None]:
    """The model's time of a collective row on `fitted_topo` (a topology with the profile
    applied); None for other rows."""

    def predict(row: Measurement) -> float | None:
        if row.kind is not Kind.COLLECTIVE:
            return None
        return estimate_s(fitted_topo, call_of(fitted_topo, row))

    return predict


def params_of(
    topo: Topology, fit: LinkModelFit, rows: Sequence[tuple[int, Measurement]]
) -> dict[str, dict[str, float]]:
    """The joint fit (call latency, each link class), and, as a diagnostic, the same model
    fitted to each op alone: where the per-op numbers differ, one set of links cannot
    reproduce every op, and the difference says what the model of that op lacks."""
    out: dict[str, dict[str, float]] = {"backend": {"call_latency_s": fit.call_latency_s}}
    for cls, link in fit.links.items():
        out[cls] = {
            "latency_s": link.latency_s,
            "bandwidth_bytes_per_s": link.bandwidth_bytes_per_s,
        }
    for op in sorted({r.op for _, r in rows}):
        alone = fit_links(topo, [(i, r) for i, r in rows if r.op == op])
        entry = {"call_latency_s": alone.call_latency_s}
        for cls, link in alone.links.items():
            entry[f"{cls}.latency_s"] = link.latency_s
            entry[f"{cls}.bandwidth_bytes_per_s"] = link.bandwidth_bytes_per_s
        out[f"only {op}"] = entry
    return out
