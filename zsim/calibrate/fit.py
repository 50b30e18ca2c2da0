"""From measurement rows to a DeviceProfile: least-squares fits and their residuals.

Every fit minimises relative error (each row weighted by 1/t), so that a 10 us and a 1 s row
count alike. What each fit feeds:

    GEMM rows           zsim.hardware.fit_gemm      -> gemm_flops_per_s, gemm_overhead_s
    ATTENTION rows      t = gemm_overhead + F/rate  -> attention_flops_per_s
    MEMORY rows         t = overhead + bytes/rate   -> memory_bytes_per_s, memory_overhead_s
    LAYER_* rows        the median                  -> layer_times[key]
    HOST_COPY rows      t = a + bytes/rate          -> host_link_bytes_per_s
    OPTIMIZER rows      t = a + params/rate         -> host_adam_params_per_s and
                        optimizer_bytes_per_s = rate x ADAM_STEP_BYTES_PER_PARAM
    COLLECTIVE rows     zsim.collectives' model     -> links[link class] (LinkFit)

The predictions the residuals are computed from are the simulator's own functions
(`ComputeRates.op_time_s`, `DeviceProfile.layer_time`, the collectives' closed forms), never a
copy of them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from zsim.calibrate.keys import ADAM_STEP_BYTES_PER_PARAM
from zsim.calibrate.plan import Kind, Measurement
from zsim.errors import require
from zsim.hardware import ComputeRates, DeviceProfile, LayerTime, LinkFit, fit_gemm
from zsim.model import ComputeOp, OpKind

LinkPredict = Callable[[DeviceProfile, Measurement], float | None]
LinkFitter = Callable[
    [Sequence[Measurement]],
    tuple[dict[str, LinkFit], dict[str, dict[str, float]], LinkPredict],
]


@dataclass(frozen=True)
class Residual:
    """How well the fitted model reproduces one group of rows (same kind and op)."""

    kind: str
    op: str
    rows: int
    median_rel_err: float
    worst_rel_err: float
    worst_label: str


@dataclass(frozen=True)
class Fit:
    """A fitted profile, the rows it was fitted on and the residuals per group."""

    profile: DeviceProfile
    residuals: tuple[Residual, ...]
    predictions: Mapping[int, float] = field(default_factory=dict)  # row index -> seconds
    collective_params: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    link_predict: LinkPredict = field(default=lambda _profile, _row: None)


def fit_affine(x: Sequence[float], t: Sequence[float]) -> tuple[float, float]:
    """(intercept >= 0, slope > 0) of t = intercept + slope * x, least squares on relative
    error. With fewer than two distinct x, the intercept is 0."""
    xa, ta = np.asarray(x, dtype=float), np.asarray(t, dtype=float)
    require(len(xa) >= 1 and bool(np.all(ta > 0)), "fit rows", len(xa), "positive times")
    if len(set(xa.tolist())) >= 2:
        a = np.stack([np.ones_like(xa), xa], axis=1) / ta[:, None]
        (intercept, slope), *_ = np.linalg.lstsq(a, np.ones_like(ta), rcond=None)
        if intercept >= 0 and slope > 0:
            return float(intercept), float(slope)
    # no intercept (or a negative one): t = slope * x
    w = xa / ta
    return 0.0, float(np.sum(w) / np.sum(w * w))


def _fixed_intercept_rate(intercept: float, x: Sequence[float], t: Sequence[float]) -> float:
    """rate of t = intercept + x / rate, least squares on relative error, intercept given."""
    xa, ta = np.asarray(x, dtype=float), np.asarray(t, dtype=float)
    w = xa / ta
    inv = float(np.sum(w * (1.0 - intercept / ta)) / np.sum(w * w))
    return 1.0 / inv if inv > 0 else float(np.max(xa / ta))


def _rows(rows: Iterable[Measurement], kind: Kind, op: str | None = None) -> list[Measurement]:
    return [r for r in rows if r.kind is kind and (op is None or r.op == op)]


def compute_rates(rows: Sequence[Measurement], dtype: str) -> ComputeRates:
    """The achieved rates of one dtype from its GEMM, ATTENTION and MEMORY rows."""
    gemm = [r for r in _rows(rows, Kind.GEMM) if r.dtype == dtype]
    require(len(gemm) >= 2, "calibration", f"{len(gemm)} GEMM rows", "at least two GEMM shapes")
    rate, overhead = fit_gemm(
        [(m * b, n, k, r.flops / r.median_s / 1e12) for r in gemm for m, n, k, b in [r.shape]]
    )
    attn = [r for r in _rows(rows, Kind.ATTENTION) if r.dtype == dtype]
    attn_rate = (
        _fixed_intercept_rate(overhead, [r.flops for r in attn], [r.median_s for r in attn])
        if attn
        else rate
    )
    mem = [r for r in _rows(rows, Kind.MEMORY) if r.dtype == dtype]
    require(bool(mem), "calibration", "no memory rows", "a memory-bound kernel sweep")
    mem_overhead, inv_bw = fit_affine([r.size_bytes for r in mem], [r.median_s for r in mem])
    return ComputeRates(rate, overhead, attn_rate, 1.0 / inv_bw, mem_overhead)


def layer_times(rows: Sequence[Measurement]) -> dict[str, LayerTime]:
    forward = {r.layer_key: r.median_s for r in _rows(rows, Kind.LAYER_FORWARD)}
    backward = {r.layer_key: r.median_s for r in _rows(rows, Kind.LAYER_BACKWARD)}
    return {k: LayerTime(forward[k], backward[k]) for k in forward if k in backward}


def rate_through_origin(
    rows: Sequence[Measurement], amount: Callable[[Measurement], float]
) -> float:
    """Units per second of rows timing `amount` units each, as t = amount / rate (the form the
    simulator charges copies and optimizer steps in), least squares on relative error."""
    x = np.array([amount(r) for r in rows])
    t = np.array([r.median_s for r in rows])
    w = x / t
    return float(np.sum(w * w) / np.sum(w))


# ---- predictions: the simulator's own functions ----------------------------------------------


def predict_compute(profile: DeviceProfile, row: Measurement) -> float | None:
    """The simulator's time for a compute row (None for rows of other kinds)."""
    if row.kind is Kind.GEMM:
        op = ComputeOp(row.op, OpKind.GEMM, row.flops, 0.0, row.shape[:3], row.shape[3])
    elif row.kind is Kind.ATTENTION:
        op = ComputeOp(row.op, OpKind.ATTENTION, row.flops, 0.0)
    elif row.kind is Kind.MEMORY:
        op = ComputeOp(row.op, OpKind.MEMORY, 0.0, row.size_bytes)
    elif row.kind in (Kind.LAYER_FORWARD, Kind.LAYER_BACKWARD):
        lt = profile.layer_time(row.layer_key)
        if lt is None:
            return None
        return lt.forward_s if row.kind is Kind.LAYER_FORWARD else lt.backward_s
    else:
        return None
    return profile.op_time_s(op, row.dtype)


def predict_memory_traffic(
    profile: DeviceProfile, row: Measurement, host_adam: bool
) -> float | None:
    """Bandwidth-only predictions of copies and optimizer steps (no intercept: the simulator
    charges bytes / rate)."""
    if row.kind is Kind.HOST_COPY:
        return row.size_bytes / profile.host_link_bytes_per_s
    if row.kind is Kind.OPTIMIZER:
        if host_adam or row.op == "host_adamw":
            return row.params / profile.host_adam_params_per_s
        return row.params * ADAM_STEP_BYTES_PER_PARAM / profile.optimizer_bytes_per_s
    return None


def residuals(
    rows: Sequence[Measurement], predictions: Mapping[int, float]
) -> tuple[Residual, ...]:
    """Median and worst |predicted - measured| / measured per (kind, op)."""
    groups: dict[tuple[str, str], list[tuple[float, str]]] = {}
    for i, p in predictions.items():
        r = rows[i]
        groups.setdefault((str(r.kind), r.op), []).append(
            (abs(p - r.median_s) / r.median_s, r.label)
        )
    out = []
    for (kind, op), errs in groups.items():
        values = [e for e, _ in errs]
        worst = max(errs)
        out.append(Residual(kind, op, len(errs), float(np.median(values)), worst[0], worst[1]))
    return tuple(out)


def fit_profile(
    name: str,
    rows: Sequence[Measurement],
    info: Mapping[str, Any],
    links: LinkFitter | None = None,
) -> Fit:
    """The profile fitted to `rows`; `info` is the run's provenance (memory sizes, backend)."""
    dtypes = sorted({r.dtype for r in _rows(rows, Kind.GEMM)})
    require(bool(dtypes), "calibration", "no GEMM rows", "GEMM measurements")
    rates = {d: compute_rates(rows, d) for d in dtypes}
    peak = {
        d: max(r.flops / r.median_s for r in _rows(rows, Kind.GEMM) if r.dtype == d) for d in dtypes
    }
    copies = _rows(rows, Kind.HOST_COPY)
    require(bool(copies), "calibration", "no host copy rows", "host <-> device copies")
    device_adam = _rows(rows, Kind.OPTIMIZER, "adamw")
    host_adam = _rows(rows, Kind.OPTIMIZER, "host_adamw") or device_adam
    require(bool(device_adam), "calibration", "no optimizer rows", "AdamW steps")
    adam_params_per_s = rate_through_origin(device_adam, lambda r: float(r.params))
    fitted_links, link_params, link_predict = (links or fit_no_links)(rows)
    backend = str(info.get("backend", "nccl"))
    profile = DeviceProfile(
        name=name,
        memory_bytes=float(info["memory_bytes"]),
        reserved_bytes=float(info.get("reserved_bytes", 0.0)),
        peak_flops=peak,
        rates=rates,
        host_link_bytes_per_s=rate_through_origin(copies, lambda r: r.size_bytes),
        optimizer_bytes_per_s=adam_params_per_s * ADAM_STEP_BYTES_PER_PARAM,
        host_adam_params_per_s=rate_through_origin(host_adam, lambda r: float(r.params)),
        layer_times=layer_times(rows),
        links=fitted_links,
        backend=backend if backend in ("nccl", "gloo") else "nccl",
        notes=provenance_notes(info),
    )
    predictions: dict[int, float] = {}
    for i, row in enumerate(rows):
        p = predict_compute(profile, row)
        if p is None:
            p = predict_memory_traffic(profile, row, host_adam=False)
        if p is None:
            p = link_predict(profile, row)
        if p is not None:
            predictions[i] = p
    return Fit(profile, residuals(rows, predictions), predictions, link_params, link_predict)


def fit_no_links(
    rows: Sequence[Measurement],
) -> tuple[dict[str, LinkFit], dict[str, dict[str, float]], LinkPredict]:
    """No collective rows fitted (a single rank, or no collectives model)."""
    del rows
    return {}, {}, lambda _profile, _row: None


def provenance_notes(info: Mapping[str, Any]) -> tuple[str, ...]:
    """The few provenance facts a reader of a DeviceProfile should see."""
    keys = ("device_name", "backend", "world_size", "torch_num_threads", "load_before")
    return tuple(f"{k}={info[k]}" for k in keys if k in info)
