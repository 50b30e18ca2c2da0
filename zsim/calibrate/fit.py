"""From measurement rows to a DeviceProfile: least-squares fits and their residuals.

Every fit minimises relative error (each row weighted by 1/t), so that a 10 us and a 1 s row
count alike; t is a row's mean (`Measurement.time_s`: what a step summing such calls pays).
What each fit feeds:

    GEMM rows           zsim.cluster.gpu_spec.fit_gemm -> gemm_flops_per_s, gemm_overhead_s
    ATTENTION rows      t = gemm_overhead + F/rate  -> attention_flops_per_s
    MEMORY rows         t = overhead + bytes/rate   -> memory_bytes_per_s, memory_overhead_s
    LAYER_* rows        the mean                    -> layer_times[key]
    HOST_COPY rows      t = a + bytes/rate          -> host_link_bytes_per_s
    OPTIMIZER rows      t = a + params/rate         -> host_adam_params_per_s and
                        optimizer_bytes_per_s = rate x ADAM_STEP_BYTES_PER_PARAM
    COLLECTIVE rows     zsim.network's model     -> links[link class] (LinkFit), call
                        latency, gloo's send/recv call latency, message_s,
                        first_touch_bytes_per_s and each op's own op_s_per_byte (its
                        copies and sums run at the memcpy and elementwise rates above)
    ENGINE_HOST rows    minus the simulated tiny step -> engine_host_s (`engine_fit`)

The predictions the residuals are computed from are the simulator's own functions
(`ComputeRates.op_time_s`, `DeviceProfile.layer_time`, the collectives' flow simulation), never a
copy of them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from zsim.calibrate.engine_fit import engine_host_s
from zsim.calibrate.measurement import FIT_TOLERANCE, LAYER_FIELDS, Kind, Measurement
from zsim.cluster.calibrated import apply_profile
from zsim.cluster.device import ADAM_STEP_BYTES_PER_PARAM, ComputeRates, DeviceProfile, LayerTime
from zsim.cluster.gpu_spec import fit_gemm
from zsim.errors import require
from zsim.workload.model import ComputeOp, OpKind

LinkPredict = Callable[[Measurement], float | None]
"""The fitted collective model's time of a (possibly synthetic) collective row."""


@dataclass(frozen=True)
class Residual:
    """How well the fitted model reproduces one group of rows (same kind, op and regime).

    `fitted` rows are those the model was fitted on; the others lie outside the model's regime
    (`in_model_regime`) and show how far off the kernel model is there."""

    kind: str
    op: str
    fitted: bool
    rows: int
    median_rel_err: float
    worst_rel_err: float
    worst_label: str
    over: int | None = None  # rows off by more than FIT_TOLERANCE (None: not recorded)
    over_launches_disagree: int | None = None  # of those, rows whose launches disagree as much
    held_out: bool = False  # predicted by a fit that did not see them (`holdout`)


@dataclass(frozen=True)
class Fit:
    """A fitted profile, the rows it was fitted on and the residuals per group."""

    profile: DeviceProfile
    residuals: tuple[Residual, ...]
    predictions: Mapping[int, float] = field(default_factory=dict)  # row index -> seconds
    collective_params: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    link_predict: LinkPredict = field(default=lambda _row: None)
    fitted: frozenset[int] = frozenset()  # indices of the rows the fit used


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


OVERHEAD_BYTES = 16 * 1024
"""A memory-bound kernel moving at most this many bytes times its fixed overhead alone."""
GEMV_DIM = 16
"""A GEMM with a dimension below this is a matrix-vector product: bandwidth-bound, outside the
GEMM model (t = overhead + flops / rate)."""
DEFAULT_CACHE_BYTES = 32 * 2**20


WIDE_OUTPUT = 32768
"""A GEMM writing an output this wide or wider (a vocabulary's logits) runs at about two
thirds of the efficiency of the others on the CPU measured: outside the one-rate model."""
ELEMENTWISE = "add"
"""The memory-bound op the rate and overhead are fitted on: the simulator's bandwidth-bound
kernels (norms, activations, dropout, residual adds) are elementwise; a copy has its own,
smaller overhead and is measured for reference (and as the host link)."""


def in_model_regime(row: Measurement, cache_bytes: float) -> bool:
    """Whether a compute row lies where its two-parameter kernel model applies.

    The model of a bandwidth-bound kernel (overhead + bytes / rate) has no cache: it is fitted
    on tiny elementwise kernels (the overhead) and on ones streaming four times the last-level
    cache or more (the DRAM / HBM rate); sizes in between run from cache, faster than the model
    says. A GEMM is in the model unless it is a matrix-vector product (a dimension below
    GEMV_DIM) or writes a vocabulary-wide output (n >= WIDE_OUTPUT). An Adam step is fitted
    where its state (16 B a parameter) streams from DRAM, like a kernel. Rows outside are
    measured, plotted and reported, not fitted; a layer measured at its own shape does not
    need the kernel model at all. (The last two GEMM rules and the elementwise-only rule were
    set after seeing this machine's measurements: they name where the model stops holding.)
    """
    if row.kind is Kind.MEMORY:
        tiny_or_dram = row.size_bytes <= OVERHEAD_BYTES or row.size_bytes >= 4 * cache_bytes
        return row.op == ELEMENTWISE and tiny_or_dram
    if row.kind is Kind.GEMM:
        return min(row.shape[:3]) >= GEMV_DIM and row.shape[1] < WIDE_OUTPUT
    if row.kind is Kind.OPTIMIZER:  # Adam streams weight, gradient, m and v: 16 B a parameter
        return row.params * 16 >= 4 * cache_bytes
    return True


def _regime(rows: Sequence[Measurement], cache_bytes: float) -> list[Measurement]:
    """The rows in the model's regime; for a memory sweep that never leaves the cache, its
    smallest and largest elementwise sizes instead (better a rough fit than none)."""
    inside = [r for r in rows if in_model_regime(r, cache_bytes)]
    if (
        rows
        and rows[0].kind is Kind.MEMORY
        and not any(r.size_bytes > OVERHEAD_BYTES for r in inside)
    ):
        elementwise = [r for r in rows if r.op == ELEMENTWISE] or list(rows)
        largest = max(r.size_bytes for r in elementwise)
        inside += [r for r in elementwise if r.size_bytes == largest]
    return inside or list(rows)


def cache_bytes_of(info: Mapping[str, Any]) -> float:
    """The last-level cache a calibration recorded in its provenance (a default if none)."""
    return float(info.get("cache_bytes") or DEFAULT_CACHE_BYTES)


def fitted_rows(rows: Sequence[Measurement], info: Mapping[str, Any]) -> list[Measurement]:
    """The rows the fit uses (`fitted_ids`), in order, for a calibration's provenance."""
    return [rows[i] for i in sorted(fitted_ids(rows, cache_bytes_of(info)))]


def fitted_ids(rows: Sequence[Measurement], cache_bytes: float) -> frozenset[int]:
    """Indices of the rows the fit uses: `_regime` of each kernel sweep (GEMMs, memory-bound
    kernels, each optimizer), every other row but the ping-pongs (floors) and the tiny
    engine steps (read off, `engine_fit`): no model predicts those."""
    chosen: set[int] = set()
    sweeps: dict[tuple[Kind, str, str], list[int]] = {}
    for i, r in enumerate(rows):
        if r.kind in (Kind.PINGPONG, Kind.ENGINE_HOST):
            continue
        if r.kind in (Kind.GEMM, Kind.MEMORY, Kind.OPTIMIZER):
            op = r.op if r.kind is Kind.OPTIMIZER else ""
            sweeps.setdefault((r.kind, op, r.dtype), []).append(i)
        else:
            chosen.add(i)
    for members in sweeps.values():
        inside = _regime([rows[i] for i in members], cache_bytes)
        chosen |= {i for i in members if rows[i] in inside}
    return frozenset(chosen)


def compute_rates(
    rows: Sequence[Measurement], dtype: str, cache_bytes: float = DEFAULT_CACHE_BYTES
) -> ComputeRates:
    """The achieved rates of one dtype from its GEMM, ATTENTION and MEMORY rows (those in the
    model's regime, `in_model_regime`)."""
    gemm = _regime([r for r in _rows(rows, Kind.GEMM) if r.dtype == dtype], cache_bytes)
    require(len(gemm) >= 2, "calibration", f"{len(gemm)} GEMM rows", "at least two GEMM shapes")
    rate, overhead = fit_gemm(
        [(m * b, n, k, r.flops / r.time_s / 1e12) for r in gemm for m, n, k, b in [r.shape]]
    )
    attn = [r for r in _rows(rows, Kind.ATTENTION) if r.dtype == dtype]
    attn_rate = (
        _fixed_intercept_rate(overhead, [r.flops for r in attn], [r.time_s for r in attn])
        if attn
        else rate
    )
    mem = _regime([r for r in _rows(rows, Kind.MEMORY) if r.dtype == dtype], cache_bytes)
    require(bool(mem), "calibration", "no memory rows", "a memory-bound kernel sweep")
    mem_overhead, inv_bw = fit_affine([r.size_bytes for r in mem], [r.time_s for r in mem])
    return ComputeRates(rate, overhead, attn_rate, 1.0 / inv_bw, mem_overhead)


def layer_times(rows: Sequence[Measurement]) -> dict[str, LayerTime]:
    forward = {r.layer_key: r.time_s for r in _rows(rows, Kind.LAYER_FORWARD)}
    backward = {r.layer_key: r.time_s for r in _rows(rows, Kind.LAYER_BACKWARD)}
    accumulate = {r.layer_key: r.time_s for r in _rows(rows, Kind.LAYER_ACCUMULATE)}
    return {
        k: LayerTime(forward[k], backward[k], accumulate.get(k)) for k in forward if k in backward
    }


def rate_through_origin(
    rows: Sequence[Measurement], amount: Callable[[Measurement], float]
) -> float:
    """Units per second of rows timing `amount` units each, as t = amount / rate (the form the
    simulator charges copies and optimizer steps in), least squares on relative error."""
    x = np.array([amount(r) for r in rows])
    t = np.array([r.time_s for r in rows])
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
    elif row.kind in LAYER_FIELDS:
        lt = profile.layer_time(row.layer_key)
        seconds = None if lt is None else getattr(lt, LAYER_FIELDS[row.kind])
        return None if seconds is None else float(seconds)
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
    rows: Sequence[Measurement], predictions: Mapping[int, float], fitted: frozenset[int]
) -> tuple[Residual, ...]:
    """Median and worst |predicted - measured| / measured per (kind, op, fitted or not), and
    how many rows are off by more than the tolerance, of them how many rows no one time could
    reproduce within it in every launch (`Measurement.launches_agree`)."""
    groups: dict[tuple[str, str, bool], list[tuple[float, str, bool | None]]] = {}
    for i, p in predictions.items():
        r = rows[i]
        key = (str(r.kind), r.op, i in fitted)
        err = abs(p - r.time_s) / r.time_s
        groups.setdefault(key, []).append((err, r.label, r.launches_agree))
    out = []
    for (kind, op, was_fitted), errs in groups.items():
        worst = max(errs)
        over = [agree for e, _, agree in errs if e > FIT_TOLERANCE]
        known = any(agree is not None for _, _, agree in errs)
        out.append(
            Residual(
                kind,
                op,
                was_fitted,
                len(errs),
                float(np.median([e for e, _, _ in errs])),
                worst[0],
                worst[1],
                len(over),
                over.count(False) if known else None,
            )
        )
    return tuple(out)


def fit_profile(
    name: str, rows: Sequence[Measurement], info: Mapping[str, Any], diagnostics: bool = True
) -> Fit:
    """The profile fitted to `rows`; `info` is the run's provenance (memory sizes, backend,
    cache size, and the topology name the collectives were measured on). Without
    `diagnostics`, the per-op link fits (`links.params_of`) are skipped: only the profile."""
    dtypes = sorted({r.dtype for r in _rows(rows, Kind.GEMM)})
    require(bool(dtypes), "calibration", "no GEMM rows", "GEMM measurements")
    cache = cache_bytes_of(info)
    rates = {d: compute_rates(rows, d, cache) for d in dtypes}
    peak = {
        d: max(r.flops / r.time_s for r in _rows(rows, Kind.GEMM) if r.dtype == d) for d in dtypes
    }
    copies = _rows(rows, Kind.HOST_COPY)
    require(bool(copies), "calibration", "no host copy rows", "host <-> device copies")
    device_adam = _regime(_rows(rows, Kind.OPTIMIZER, "adamw"), cache)
    host_adam = _regime(_rows(rows, Kind.OPTIMIZER, "host_adamw"), cache) or device_adam
    require(bool(device_adam), "calibration", "no optimizer rows", "AdamW steps")
    adam_params_per_s = rate_through_origin(device_adam, lambda r: float(r.params))
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
        sm_count=int(info.get("sm_count", 0)),  # CUDA devices only (the worker's info)
        backend=backend if backend in ("nccl", "gloo") else "nccl",
        notes=provenance_notes(info),
    )
    profile, link_params, link_predict = _fit_collectives(profile, rows, info, diagnostics)
    if info.get("topology"):  # after the links: the tiny steps' collectives are charged first
        host = engine_host_s(profile, rows, str(info["topology"]))
        profile = replace(profile, engine_host_s=host)
    predictions: dict[int, float] = {}
    for i, row in enumerate(rows):
        p = predict_compute(profile, row)
        if p is None:
            p = predict_memory_traffic(profile, row, host_adam=False)
        if p is None:
            p = link_predict(row)
        if p is not None:
            predictions[i] = p
    used = fitted_ids(rows, cache)
    return Fit(
        profile, residuals(rows, predictions, used), predictions, link_params, link_predict, used
    )


def _fit_collectives(
    profile: DeviceProfile, rows: Sequence[Measurement], info: Mapping[str, Any], diagnostics: bool
) -> tuple[DeviceProfile, Mapping[str, Mapping[str, float]], LinkPredict]:
    """The profile with its links, call latencies and (gloo) local work fitted to the
    collective rows, on the topology they were measured on; the fitted parameters and the
    model's time of each collective row."""
    collectives = [(i, r) for i, r in enumerate(rows) if r.kind is Kind.COLLECTIVE]
    if not collectives or not info.get("topology"):
        return profile, {}, lambda _row: None  # no collectives measured
    from zsim.calibrate import links
    from zsim.calibrate.bounds import as_params, link_bounds
    from zsim.inputs import presets

    # the profile's measured copy and sum rates are the ranks' local work (gloo)
    topo = apply_profile(presets.topology(str(info["topology"])), profile)
    bounds = link_bounds(topo, rows)
    fitted = links.fit_links(topo, collectives, bounds)
    profile = replace(
        profile,
        links=fitted.links,
        call_latency_s=fitted.call_latency_s,
        message_s=fitted.message_s,
        first_touch_bytes_per_s=fitted.first_touch_bytes_per_s,
        p2p_call_latency_s=fitted.p2p_call_latency_s,
        op_s_per_byte=fitted.op_s_per_byte,
        op_call_s=fitted.op_call_s,
    )
    params = links.params_of(topo, fitted, collectives, bounds) if diagnostics else {}
    if diagnostics:
        params["bounds"] = as_params(bounds)
    return profile, params, links.predictor(apply_profile(topo, profile))


def provenance_notes(info: Mapping[str, Any]) -> tuple[str, ...]:
    """The few provenance facts a reader of a DeviceProfile should see."""
    keys = ("device_name", "backend", "world_size", "torch_num_threads", "load_before")
    return tuple(f"{k}={info[k]}" for k in keys if k in info)
