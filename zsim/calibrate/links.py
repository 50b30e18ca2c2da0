"""Link latency and bandwidth per link class, the call latency and the ranks' local work,
fitted so that zsim's own collective model (the simulator, `zsim.collectives.simulate_s`, on the
measured cluster's topology) reproduces the measured collective times.

The model's time of a call is linear in its unknowns as long as the bottleneck link class of a
route does not change: t = call_latency + sum_c a_c * latency_c + b * (1 / bandwidth_g)
+ m * message + f * (1 / first_touch), where a_c counts the link latencies of class c the
algorithm pays, b the bytes it pushes through the group's bottleneck class g, m the messages the
busiest rank handles and f the bytes of fresh temporaries it faults in (gloo). The coefficients
are read off the model itself by probing it (every unknown at zero cost, then one at 1 s or
1 B/s), so no formula of zsim.collectives is copied here. The unknowns are then found by
non-negative least squares on relative error, and the residuals are computed with the real
simulator at the fitted values.

What the profile measures directly is not fitted here: a gloo rank's copies run at the
profile's memcpy rate and its sums at its elementwise rate (`local_rates`), so only the page
faults of fresh memory and the cost per message come from the collective rows.

`apply_profile` is how a profile's links, call latency and local work override a topology: the
simulator and this fit use the same function.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from zsim.calibrate.plan import Collective, Kind, Measurement
from zsim.collectives import CollectiveCall, CollectiveOp, simulate_s
from zsim.errors import require
from zsim.fabric import Backend, LinkClass
from zsim.hardware import DeviceProfile, LinkFit
from zsim.topology import Topology, with_call_latency, with_link_class, with_local_work

OPS = {
    Collective.ALL_GATHER: CollectiveOp.ALL_GATHER,
    Collective.REDUCE_SCATTER: CollectiveOp.REDUCE_SCATTER,
    Collective.ALL_REDUCE: CollectiveOp.ALL_REDUCE,
    Collective.BROADCAST: CollectiveOp.BROADCAST,
    Collective.SENDRECV: CollectiveOp.SEND_RECV,
}
HUGE_BPS = 1e30  # a bandwidth that never limits (probing)
PROBE_FLOOR_S = 1e-3  # a unit unknown (1 s, 1 B/s) a row depends on adds at least this


SUM_PASSES = 3
"""A sum out = a + b reads two operands and writes one: in output bytes it runs at a third of
the elementwise rate the profile measures (bytes moved)."""


def apply_profile(topo: Topology, profile: DeviceProfile) -> Topology:
    """`topo` with the profile's fitted links (by class) and call latency, and, for a gloo
    profile on a gloo fabric, its ranks' local work (`local_rates`)."""
    topo = _with_links(topo, profile.links, profile.call_latency_s)
    if profile.backend == "gloo" and topo.fabric.backend is Backend.GLOO:
        topo = with_local_work(topo, **local_rates(profile))
    return topo


def local_rates(profile: DeviceProfile) -> dict[str, float]:
    """A CPU profile's rates of a gloo rank's own work: copies at its memcpy rate (on the CPU
    the host-copy rows time copy_ between host buffers, torch's own copies), sums at its
    elementwise rate (fp32, the dtype gloo reduces here, when measured), and the fitted cost
    per message and page-fault rate when the profile has them."""
    rates = profile.rates.get("fp32") or next(iter(profile.rates.values()))
    out = {
        "copy_bytes_per_s": profile.host_link_bytes_per_s,
        "reduce_bytes_per_s": rates.memory_bytes_per_s / SUM_PASSES,
    }
    if profile.message_s is not None:
        out["message_s"] = profile.message_s
    if profile.first_touch_bytes_per_s is not None:
        out["first_touch_bytes_per_s"] = profile.first_touch_bytes_per_s
    return out


def _with_links(
    topo: Topology, links: Mapping[str, LinkFit], call_latency_s: float | None
) -> Topology:
    for cls in sorted(links):
        if any(str(c) == cls for c in topo.link_class):
            link = links[cls]
            topo = with_link_class(
                topo,
                LinkClass(cls),
                bandwidth_bytes_per_s=link.bandwidth_bytes_per_s,
                latency_s=link.latency_s,
            )
    if call_latency_s is not None:
        topo = with_call_latency(topo, call_latency_s)
    return topo


def group_gpus(topo: Topology, group: str, ranks: int) -> tuple[int, ...]:
    """The GPUs (ranks) of the measured group the calibration worker's rank 0 was in."""
    g = topo.gpus_per_node
    if group == "intra":
        return tuple(range(min(ranks, g)))
    if group == "inter":
        return tuple(range(0, topo.world_size, g))[:ranks]
    return tuple(range(ranks))


def calls_of(topo: Topology, row: Measurement) -> tuple[CollectiveCall, ...]:
    """The calls a measured collective row runs at once: one collective, or for send/recv one
    transfer per rank to the next (the worker posts them all before waiting), so that every
    rank sends and receives at once, as measured."""
    gpus = group_gpus(topo, row.group, row.ranks)
    op = OPS[Collective(row.op)]
    if op is CollectiveOp.SEND_RECV:
        n = len(gpus)
        return tuple(
            CollectiveCall(op, row.size_bytes, (a, gpus[(i + 1) % n])) for i, a in enumerate(gpus)
        )
    return (CollectiveCall(op, row.size_bytes, gpus),)


def row_time_s(topo: Topology, row: Measurement) -> float:
    """The simulator's time of a measured collective row: its calls run together on a fresh
    network, the slowest one's duration."""
    return max(simulate_s(topo, calls_of(topo, row)))


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
    """The fitted call latency, links and ranks' local work (`message_s`,
    `first_touch_bytes_per_s`, None where no row depends on it), and the model's time of each
    fitted row."""

    call_latency_s: float
    links: dict[str, LinkFit]
    predictions: dict[int, float]  # row index -> seconds
    message_s: float | None = None
    first_touch_bytes_per_s: float | None = None


Unknown = tuple[str, LinkClass | None]
"""("call" | "latency" | "inv_bandwidth" | "message" | "inv_first_touch", link class or None)."""


def _probe(topo: Topology, classes: Sequence[LinkClass], unit: Unknown | None) -> Topology:
    """`topo` with every unknown at no cost (no call latency, latency 0, bandwidths that never
    limit, free messages and page faults) except `unit`, set to 1 (1 s, or 1 B/s)."""
    out = with_call_latency(topo, 0.0)
    for c in classes:
        out = with_link_class(
            out,
            c,
            latency_s=1.0 if unit == ("latency", c) else 0.0,
            bandwidth_bytes_per_s=1.0 if unit == ("inv_bandwidth", c) else HUGE_BPS,
        )
    return with_local_work(
        out,
        message_s=1.0 if unit == ("message", None) else 0.0,
        first_touch_bytes_per_s=1.0 if unit == ("inv_first_touch", None) else HUGE_BPS,
    )


def fit_links(topo: Topology, rows: Sequence[tuple[int, Measurement]]) -> LinkModelFit:
    """Call latency, (latency, bandwidth) of every link class the rows exercise, and the
    ranks' cost per message and page-fault rate; `topo` carries the local rates the profile
    measures (`apply_profile`)."""
    require(bool(rows), "collective rows", 0, "at least one collective measurement")
    classes = sorted(set(topo.link_class), key=str)
    measured = [r for _, r in rows]
    owners = [bottleneck_class(topo, calls_of(topo, r)[0].group) for r in measured]
    base = np.array([row_time_s(_probe(topo, classes, None), r) for r in measured])
    columns: list[np.ndarray] = [np.ones(len(measured))]
    names: list[Unknown] = [("call", None)]
    candidates: list[Unknown] = [
        (kind, cls) for cls in classes for kind in ("latency", "inv_bandwidth")
    ]
    for unknown in [*candidates, ("message", None), ("inv_first_touch", None)]:
        probe = _probe(topo, classes, unknown)
        column = np.array([row_time_s(probe, r) for r in measured]) - base
        if unknown[0] == "inv_bandwidth":
            column = np.where([o is unknown[1] for o in owners], column, 0.0)
        if np.any(column > PROBE_FLOOR_S):
            columns.append(column)
            names.append(unknown)
    t = np.array([r.median_s for r in measured])
    solution = nonnegative_lstsq(np.stack(columns, axis=1) / t[:, None], 1.0 - base / t)
    values = dict(zip(names, solution.tolist(), strict=True))
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
    message = values.get(("message", None))
    inv_touch = values.get(("inv_first_touch", None))
    first_touch = None if inv_touch is None else (1.0 / inv_touch if inv_touch > 0 else HUGE_BPS)
    local = {"message_s": message, "first_touch_bytes_per_s": first_touch}
    final = with_local_work(
        _with_links(topo, links, call_latency), **{k: v for k, v in local.items() if v is not None}
    )
    predictions = {i: row_time_s(final, r) for i, r in rows}
    return LinkModelFit(call_latency, links, predictions, message, first_touch)


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
        return row_time_s(fitted_topo, row)

    return predict


def params_of(
    topo: Topology, fit: LinkModelFit, rows: Sequence[tuple[int, Measurement]]
) -> dict[str, dict[str, float]]:
    """The joint fit (call latency, each link class, the ranks' local work), and, as a
    diagnostic, the same model fitted to each op alone: where the per-op numbers differ, one
    set of parameters cannot reproduce every op, and the difference says what the model of
    that op lacks."""
    out: dict[str, dict[str, float]] = {"backend": {"call_latency_s": fit.call_latency_s}}
    for cls, link in fit.links.items():
        out[cls] = {
            "latency_s": link.latency_s,
            "bandwidth_bytes_per_s": link.bandwidth_bytes_per_s,
        }
    work = topo.local_work
    out["local_work"] = {
        "copy_bytes_per_s": work.copy_bytes_per_s,
        "reduce_bytes_per_s": work.reduce_bytes_per_s,
        **_local_entry(fit),
    }
    for op in sorted({r.op for _, r in rows}):
        alone = fit_links(topo, [(i, r) for i, r in rows if r.op == op])
        entry = {"call_latency_s": alone.call_latency_s, **_local_entry(alone)}
        for cls, link in alone.links.items():
            entry[f"{cls}.latency_s"] = link.latency_s
            entry[f"{cls}.bandwidth_bytes_per_s"] = link.bandwidth_bytes_per_s
        out[f"only {op}"] = entry
    return out


def _local_entry(fit: LinkModelFit) -> dict[str, float]:
    fitted = {"message_s": fit.message_s, "first_touch_bytes_per_s": fit.first_touch_bytes_per_s}
    return {k: v for k, v in fitted.items() if v is not None}
