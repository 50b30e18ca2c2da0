"""Link latency and bandwidth per link class, the call latency and the ranks' local work,
fitted so that zsim's own collective model (the simulator, `communicator.simulate_s`, on the
measured cluster's topology) reproduces the measured collective times.

The model's time of a call is linear in its unknowns as long as the bottleneck link class of a
route does not change: t = call_latency + sum_c a_c * latency_c + b * (1 / bandwidth_g)
+ m * message + f * (1 / first_touch) + v_op * s_op + c_op, where a_c counts the link
latencies of class c the algorithm pays, b the bytes it pushes through the group's bottleneck
class g, m the messages the busiest rank handles, f the bytes of fresh temporaries it faults in
and v_op the bytes the busiest rank sends plus receives, at its op's own CPU cost s_op per byte
(gloo); c_op is the own cost per call of an op torch wraps around gloo's (`WRAPPED_OPS`). On
gloo, send/recv has its own call latency (torch posts it on the caller's thread, not through
the process group's worker queue). The coefficients are read off the model itself by probing
it (every unknown at zero cost, then one at 1 s, 1 B/s or 1 s/B), so no formula of
zsim.network is copied here. The unknowns are then found by non-negative least squares on
relative error, and the residuals are computed with the real simulator at the fitted values.

The ops' own costs and the wire's bandwidth are not separable (each op's bytes on the wire and
bytes moved grow together): the wire is defined as what the op that moves bytes most cheaply
sees, i.e. one op's own cost is held at zero, and of the fits with each op as that reference
the one of least error is kept (with exact data: the only one whose other costs are all
non-negative). An op's cost is then its CPU per byte beyond that op's.

What the profile measures directly is not fitted here: a gloo rank's copies run at the
profile's memcpy rate and its sums at its elementwise rate (`local_rates`), so only the page
faults of fresh memory, the cost per message and the ops' own costs come from the
collective rows (microbenchmarks only: never end-to-end runs).

`zsim.cluster.calibrated.apply_profile` is how a profile's links, call latency and local work
override a topology: the simulator and this fit use the same function.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from zsim.calibrate.bounds import LinkBounds, concurrent_groups, group_gpus
from zsim.calibrate.measurement import Collective, Kind, Measurement
from zsim.cluster.calibrated import with_call_latency, with_link_class, with_links, with_local_work
from zsim.cluster.device import LinkFit
from zsim.cluster.fabric import Backend, LinkClass
from zsim.cluster.topology import Topology
from zsim.errors import require
from zsim.network.collective import CollectiveCall, CollectiveOp
from zsim.network.communicator import simulate_s

OPS = {
    Collective.ALL_GATHER: CollectiveOp.ALL_GATHER,
    Collective.REDUCE_SCATTER: CollectiveOp.REDUCE_SCATTER,
    Collective.ALL_REDUCE: CollectiveOp.ALL_REDUCE,
    Collective.BROADCAST: CollectiveOp.BROADCAST,
    Collective.SENDRECV: CollectiveOp.SEND_RECV,
}
WRAPPED_OPS = (CollectiveOp.ALL_GATHER, CollectiveOp.REDUCE_SCATTER)
"""The ops ProcessGroupGloo wraps around gloo's algorithm, with a cost of their own per call
(`LocalWork.op_call_s`): all_gather_into_tensor allocates a flat output and copies it out,
reduce_scatter_tensor clones its input and all-reduces it. all_reduce and broadcast run gloo's
algorithm on the tensor itself: theirs is the common call latency (send/recv has its own)."""
HUGE_BPS = 1e30  # a bandwidth that never limits (probing)
PROBE_FLOOR_S = 1e-3  # a unit unknown (1 s, 1 B/s) a row depends on adds at least this


def calls_of(topo: Topology, row: Measurement) -> tuple[CollectiveCall, ...]:
    """The calls a measured collective row runs at once, rank 0's first: in each of the
    groups measured together (`bounds.concurrent_groups`), one collective, or for send/recv
    one transfer per rank to the next (the worker posts them all before waiting), so that
    every rank sends and receives at once, as measured."""
    op = OPS[Collective(row.op)]
    calls: list[CollectiveCall] = []
    for gpus in concurrent_groups(topo, row.group, row.ranks):
        if op is CollectiveOp.SEND_RECV:
            n = len(gpus)
            calls += [
                CollectiveCall(op, row.size_bytes, (a, gpus[(i + 1) % n]))
                for i, a in enumerate(gpus)
            ]
        else:
            calls.append(CollectiveCall(op, row.size_bytes, gpus))
    return tuple(calls)


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
    `first_touch_bytes_per_s`, None where no row depends on it), send/recv's own call latency
    and the ops' own costs per byte (gloo: None and empty elsewhere, the reference op at 0) and
    per call (the `WRAPPED_OPS`), and the model's time of each fitted row."""

    call_latency_s: float
    links: dict[str, LinkFit]
    predictions: dict[int, float]  # row index -> seconds
    message_s: float | None = None
    first_touch_bytes_per_s: float | None = None
    p2p_call_latency_s: float | None = None
    op_s_per_byte: dict[str, float] = field(default_factory=dict)
    op_call_s: dict[str, float] = field(default_factory=dict)


Unknown = tuple[str, LinkClass | CollectiveOp | None]
"""("call" | "p2p_call" | "latency" | "inv_bandwidth" | "message" | "inv_first_touch" |
"op_s_per_byte" | "op_call", link class, op or None)."""


def _probe(
    topo: Topology, classes: Sequence[LinkClass], ops: Sequence[CollectiveOp], unit: Unknown | None
) -> Topology:
    """`topo` with every unknown at no cost (no call latency, latency 0, bandwidths that never
    limit, free messages, page faults and ops' own work) except `unit`, set to 1 (1 s, 1 B/s or
    1 s/B). On gloo, send/recv has its own call latency (`p2p_call`), else the common one."""
    gloo = topo.fabric.backend is Backend.GLOO
    p2p = (1.0 if unit == ("p2p_call", None) else 0.0) if gloo else None
    out = with_call_latency(topo, 1.0 if unit == ("call", None) else 0.0, p2p)
    for c in classes:
        out = with_link_class(
            out,
            c,
            latency_s=1.0 if unit == ("latency", c) else 0.0,
            bandwidth_bytes_per_s=1.0 if unit == ("inv_bandwidth", c) else HUGE_BPS,
        )
    return with_local_work(
        out,
        {op: 1.0 for op in ops if unit == ("op_s_per_byte", op)},
        {op: 1.0 for op in ops if unit == ("op_call", op)},
        message_s=1.0 if unit == ("message", None) else 0.0,
        first_touch_bytes_per_s=1.0 if unit == ("inv_first_touch", None) else HUGE_BPS,
    )


def fit_links(
    topo: Topology, rows: Sequence[tuple[int, Measurement]], bounds: LinkBounds | None = None
) -> LinkModelFit:
    """Call latency (and on gloo send/recv's own), (latency, bandwidth) of every link class the
    rows exercise, the ranks' cost per message and page-fault rate, and each op's own cost per
    byte (one op, the cheapest, at zero: the module's doc) and per call (`WRAPPED_OPS`);
    `topo` carries the local rates the profile measures (`apply_profile`). With `bounds`,
    every link's latency stays at least its floor and its bandwidth at most its ceiling."""
    require(bool(rows), "collective rows", 0, "at least one collective measurement")
    names, a, y = _design(topo, [r for _, r in rows])
    low = _floors(names, bounds)
    y_above = y - a @ low  # the unknowns above their floors are non-negative
    own = [j for j, u in enumerate(names) if u[0] == "op_s_per_byte"]
    above = _least_error(
        [_without(a, y_above, j) for j in own] if own else [nonnegative_lstsq(a, y_above)],
        a,
        y_above,
    )
    solution = low + above
    values = dict(zip(names, solution.tolist(), strict=True))
    links: dict[str, LinkFit] = {}
    for cls in sorted(set(topo.link_class), key=str):
        inv = values.get(("inv_bandwidth", cls))
        if inv is None:
            continue  # no row's bandwidth depends on this class: not measured
        preset_bw = float(topo.bandwidth_bytes_per_s[[c is cls for c in topo.link_class]][0])
        links[str(cls)] = LinkFit(
            latency_s=float(values.get(("latency", cls), 0.0)),
            bandwidth_bytes_per_s=float(1.0 / inv) if inv > 0 else preset_bw,
        )
    call_latency = float(values.get(("call", None), topo.call_latency_s))  # unmeasured: preset
    p2p_call = values.get(("p2p_call", None))
    message = values.get(("message", None))
    inv_touch = values.get(("inv_first_touch", None))
    first_touch = None if inv_touch is None else (1.0 / inv_touch if inv_touch > 0 else HUGE_BPS)
    op_costs = {str(u[1]): v for u, v in values.items() if u[0] == "op_s_per_byte"}
    op_calls = {str(u[1]): v for u, v in values.items() if u[0] == "op_call"}
    local = {"message_s": message, "first_touch_bytes_per_s": first_touch}
    final = with_local_work(
        with_links(topo, links, call_latency, p2p_call),
        op_costs,
        op_calls,
        **{k: v for k, v in local.items() if v is not None},
    )
    predictions = {i: row_time_s(final, r) for i, r in rows}
    return LinkModelFit(
        call_latency, links, predictions, message, first_touch, p2p_call, op_costs, op_calls
    )


def _design(
    topo: Topology, measured: Sequence[Measurement]
) -> tuple[list[Unknown], np.ndarray, np.ndarray]:
    """The unknowns the rows depend on, and the linear system in them on relative error: each
    column is read off the model by probing it (every unknown at zero cost, then one at 1)."""
    classes = sorted(set(topo.link_class), key=str)
    ops = sorted({OPS[Collective(r.op)] for r in measured}, key=str)
    gloo = topo.fabric.backend is Backend.GLOO
    wrapped = [op for op in ops if gloo and op in WRAPPED_OPS]
    owners = [bottleneck_class(topo, calls_of(topo, r)[0].group) for r in measured]
    base = np.array([row_time_s(_probe(topo, classes, ops, None), r) for r in measured])
    columns: list[np.ndarray] = []
    names: list[Unknown] = []
    candidates: list[Unknown] = [
        ("call", None),
        ("p2p_call", None),
        *[(kind, cls) for cls in classes for kind in ("latency", "inv_bandwidth")],
        ("message", None),
        ("inv_first_touch", None),
        *[("op_s_per_byte", op) for op in ops],
        *[("op_call", op) for op in wrapped],
    ]
    for unknown in candidates:
        probe = _probe(topo, classes, ops, unknown)
        column = np.array([row_time_s(probe, r) for r in measured]) - base
        if unknown[0] == "inv_bandwidth":
            column = np.where([o is unknown[1] for o in owners], column, 0.0)
        if np.any(column > PROBE_FLOOR_S):
            columns.append(column)
            names.append(unknown)
    t = np.array([r.time_s for r in measured])
    return names, np.stack(columns, axis=1) / t[:, None], 1.0 - base / t


def _floors(names: Sequence[Unknown], bounds: LinkBounds | None) -> np.ndarray:
    """Each unknown's least value: a link's latency floor, the inverse of its bandwidth
    ceiling (`zsim.calibrate.bounds`); 0 for the rest."""
    out = np.zeros(len(names))
    if bounds is None:
        return out
    for j, (kind, what) in enumerate(names):
        if kind == "latency" and isinstance(what, LinkClass):
            out[j] = bounds.latency_floor(what)
        elif kind == "inv_bandwidth" and isinstance(what, LinkClass):
            ceiling = bounds.bandwidth_ceiling(what)
            out[j] = 0.0 if ceiling is None else 1.0 / ceiling
    return out


def _without(a: np.ndarray, y: np.ndarray, reference: int) -> np.ndarray:
    """The non-negative least-squares solution with unknown `reference` held at zero."""
    keep = [j for j in range(a.shape[1]) if j != reference]
    out = np.zeros(a.shape[1])
    out[keep] = nonnegative_lstsq(a[:, keep], y)
    return out


def _least_error(solutions: Sequence[np.ndarray], a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The solution of least squared error (the first of equals)."""
    return min(solutions, key=lambda x: float(np.sum((a @ x - y) ** 2)))


def nonnegative_lstsq(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin |a x - y| with x >= 0: Lawson and Hanson's active-set method (Solving Least
    Squares Problems, 1974, ch. 23). Columns are solved at unit norm (seconds per second and
    per byte differ by 1e9)."""
    n = a.shape[1]
    norms = np.linalg.norm(a, axis=0)
    norms[norms == 0] = 1.0
    s = a / norms
    tol = 1e-10 * max(1.0, float(np.abs(s).max()))
    x, free = np.zeros(n), np.zeros(n, dtype=bool)
    for _ in range(3 * n):
        gradient = s.T @ (y - s @ x)
        if free.all() or gradient[~free].max() <= tol:
            break
        free[int(np.argmax(np.where(free, -np.inf, gradient)))] = True
        while True:  # solve on the free set; step back until every free value is positive
            z = np.zeros(n)
            z[free] = np.linalg.lstsq(s[:, free], y, rcond=None)[0]
            if np.all(z[free] > 0):
                x = z
                break
            blocked = free & (z <= 0)
            step = float(np.min(x[blocked] / (x[blocked] - z[blocked])))
            x = x + step * (z - x)
            free &= x > tol
            x[~free] = 0.0
    return x / norms


def predictor(fitted_topo: Topology) -> Callable[[Measurement], float | None]:
    """The model's time of a collective row on `fitted_topo` (a topology with the profile
    applied); None for other rows."""

    def predict(row: Measurement) -> float | None:
        if row.kind is not Kind.COLLECTIVE:
            return None
        return row_time_s(fitted_topo, row)

    return predict


def params_of(
    topo: Topology,
    fit: LinkModelFit,
    rows: Sequence[tuple[int, Measurement]],
    bounds: LinkBounds | None = None,
) -> dict[str, dict[str, float]]:
    """The joint fit (call latency, each link class, the ranks' local work), and, as a
    diagnostic, the same model fitted to each op alone: where the per-op numbers differ, one
    set of parameters cannot reproduce every op, and the difference says what the model of
    that op lacks."""
    out: dict[str, dict[str, float]] = {"backend": {"call_latency_s": fit.call_latency_s}}
    if fit.p2p_call_latency_s is not None:
        out["backend"]["p2p_call_latency_s"] = fit.p2p_call_latency_s
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
        alone = fit_links(topo, [(i, r) for i, r in rows if r.op == op], bounds)
        entry = {"call_latency_s": alone.call_latency_s, **_local_entry(alone)}
        if alone.p2p_call_latency_s is not None:
            entry["p2p_call_latency_s"] = alone.p2p_call_latency_s
        for cls, link in alone.links.items():
            entry[f"{cls}.latency_s"] = link.latency_s
            entry[f"{cls}.bandwidth_bytes_per_s"] = link.bandwidth_bytes_per_s
        out[f"only {op}"] = entry
    return out


def _local_entry(fit: LinkModelFit) -> dict[str, float]:
    fitted = {"message_s": fit.message_s, "first_touch_bytes_per_s": fit.first_touch_bytes_per_s}
    own = {f"op_s_per_byte.{op}": v for op, v in sorted(fit.op_s_per_byte.items())}
    own |= {f"op_call_s.{op}": v for op, v in sorted(fit.op_call_s.items())}
    return {k: v for k, v in fitted.items() if v is not None} | own
