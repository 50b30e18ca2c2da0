"""Calibration files: save_profile, load_profile, sample_profiles.

A calibration file (`calibration/<name>.json`) holds, in one JSON object:

    zsim_profile   the format version (1)
    name           the profile's name
    device         the fitted model: every field of a zsim.cluster.device.DeviceProfile
    fit            residuals of the fit per (kind, op) and the fitted collective parameters
    provenance     device, count, backend, versions, date, host, load, threads
    plan           what was measured (sizes, shapes, repeats)
    measurements   every raw row with all its repeat times (zsim.calibrate.plan.Measurement)

`load_profile` reads `device` only; `sample_profiles` refits from bootstrap resamples of the
measurements (whole worker launches first where they were recorded), so it draws profiles as
spread as the measurements were. A CSV beside the JSON (one line per row: median, quartiles,
a collective's algbw and busbw) is for people; the JSON is what zsim reads.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from zsim.calibrate.fit import Residual, fit_profile
from zsim.calibrate.plan import Kind, Measurement, algbw, busbw
from zsim.cluster.device import ComputeRates, DeviceProfile, LayerTime, LinkFit
from zsim.errors import InputError, require
from zsim.inputs.files import load_json
from zsim.network.collective import CollectiveOp

FORMAT_VERSION = 1


@dataclass(frozen=True)
class Calibration:
    """A whole calibration file: the fitted profile and what it was fitted from."""

    name: str
    profile: DeviceProfile
    measurements: tuple[Measurement, ...]
    residuals: tuple[Residual, ...] = ()
    collective_params: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    provenance: Mapping[str, Any] = field(default_factory=dict)
    plan: Mapping[str, Any] = field(default_factory=dict)


# ---- DeviceProfile <-> dict -------------------------------------------------------------------


def profile_to_dict(p: DeviceProfile) -> dict[str, Any]:
    return {
        "name": p.name,
        "memory_bytes": p.memory_bytes,
        "reserved_bytes": p.reserved_bytes,
        "peak_flops": dict(p.peak_flops),
        "rates": {k: vars(v).copy() for k, v in p.rates.items()},
        "host_link_bytes_per_s": p.host_link_bytes_per_s,
        "optimizer_bytes_per_s": p.optimizer_bytes_per_s,
        "host_adam_params_per_s": p.host_adam_params_per_s,
        "layer_times": {k: vars(v).copy() for k, v in sorted(p.layer_times.items())},
        "links": {k: vars(v).copy() for k, v in sorted(p.links.items())},
        "call_latency_s": p.call_latency_s,
        "message_s": p.message_s,
        "first_touch_bytes_per_s": p.first_touch_bytes_per_s,
        "p2p_call_latency_s": p.p2p_call_latency_s,
        "op_s_per_byte": dict(sorted(p.op_s_per_byte.items())),
        "op_call_s": dict(sorted(p.op_call_s.items())),
        "backend": p.backend,
        "notes": list(p.notes),
    }


def _number(where: str, value: Any, allow_zero: bool = False) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value >= 0 if allow_zero else value > 0)
    require(ok, where, value, "a non-negative number" if allow_zero else "a positive number")
    return float(value)


def _mapping(where: str, value: Any) -> dict[str, Any]:
    require(isinstance(value, dict), where, type(value).__name__, "a JSON object")
    return dict(value)


def _per_op(where: str, value: Any) -> dict[str, float]:
    """A mapping from collective op names to non-negative numbers."""
    out = _mapping(where, value)
    ops = [str(op) for op in CollectiveOp]
    for k, v in out.items():
        require(k in ops, where, k, f"one of {ops}")
        out[k] = _number(f"{where}.{k}", v, allow_zero=True)
    return out


def _record(
    where: str, value: Any, fields: Sequence[str], zero_ok: Sequence[str] = ()
) -> dict[str, float]:
    data = _mapping(where, value)
    missing = [f for f in fields if f not in data]
    require(
        not missing,
        f"{where}.{missing[0] if missing else ''}",
        None,
        "required (missing from the file)",
    )
    extra = sorted(set(data) - set(fields))
    require(not extra, f"{where}.{extra[0] if extra else ''}", None, f"one of {list(fields)}")
    return {f: _number(f"{where}.{f}", data[f], f in zero_ok) for f in fields}


_RATE_FIELDS = (
    "gemm_flops_per_s",
    "gemm_overhead_s",
    "attention_flops_per_s",
    "memory_bytes_per_s",
    "memory_overhead_s",
)


def profile_from_dict(d: Any, where: str = "profile.device") -> DeviceProfile:
    """A DeviceProfile from its JSON form; every missing or bad field is an InputError that
    names it."""
    data = _mapping(where, d)
    required = (
        "name",
        "memory_bytes",
        "reserved_bytes",
        "peak_flops",
        "rates",
        "host_link_bytes_per_s",
        "optimizer_bytes_per_s",
    )
    for key in required:
        require(key in data, f"{where}.{key}", None, "required (missing from the file)")
    require(isinstance(data["name"], str), f"{where}.name", data["name"], "a string")
    rates = {
        str(k): ComputeRates(
            **_record(
                f"{where}.rates.{k}", v, _RATE_FIELDS, ("gemm_overhead_s", "memory_overhead_s")
            )
        )
        for k, v in _mapping(f"{where}.rates", data["rates"]).items()
    }
    require(bool(rates), f"{where}.rates", {}, "rates for at least one dtype")
    layers = {
        str(k): LayerTime(**_record(f"{where}.layer_times.{k}", v, ("forward_s", "backward_s")))
        for k, v in _mapping(f"{where}.layer_times", data.get("layer_times", {})).items()
    }
    links = {
        str(k): LinkFit(
            **_record(
                f"{where}.links.{k}", v, ("latency_s", "bandwidth_bytes_per_s"), ("latency_s",)
            )
        )
        for k, v in _mapping(f"{where}.links", data.get("links", {})).items()
    }
    notes = data.get("notes", [])
    require(
        isinstance(notes, list) and all(isinstance(n, str) for n in notes),
        f"{where}.notes",
        notes,
        "a list of strings",
    )
    call_latency = data.get("call_latency_s")
    if call_latency is not None:
        call_latency = _number(f"{where}.call_latency_s", call_latency, allow_zero=True)
    message = data.get("message_s")
    if message is not None:
        message = _number(f"{where}.message_s", message, allow_zero=True)
    first_touch = data.get("first_touch_bytes_per_s")
    if first_touch is not None:
        first_touch = _number(f"{where}.first_touch_bytes_per_s", first_touch)
    p2p_call = data.get("p2p_call_latency_s")
    if p2p_call is not None:
        p2p_call = _number(f"{where}.p2p_call_latency_s", p2p_call, allow_zero=True)
    op_costs = _per_op(f"{where}.op_s_per_byte", data.get("op_s_per_byte", {}))
    op_calls = _per_op(f"{where}.op_call_s", data.get("op_call_s", {}))
    backend = data.get("backend", "nccl")
    require(backend in ("nccl", "gloo"), f"{where}.backend", backend, "nccl or gloo")
    return DeviceProfile(
        name=data["name"],
        memory_bytes=_number(f"{where}.memory_bytes", data["memory_bytes"]),
        reserved_bytes=_number(f"{where}.reserved_bytes", data["reserved_bytes"], True),
        peak_flops={
            str(k): _number(f"{where}.peak_flops.{k}", v)
            for k, v in _mapping(f"{where}.peak_flops", data["peak_flops"]).items()
        },
        rates=rates,
        host_link_bytes_per_s=_number(
            f"{where}.host_link_bytes_per_s", data["host_link_bytes_per_s"]
        ),
        optimizer_bytes_per_s=_number(
            f"{where}.optimizer_bytes_per_s", data["optimizer_bytes_per_s"]
        ),
        host_adam_params_per_s=_number(
            f"{where}.host_adam_params_per_s", data.get("host_adam_params_per_s", 0.0), True
        ),
        layer_times=layers,
        links=links,
        call_latency_s=call_latency,
        message_s=message,
        first_touch_bytes_per_s=first_touch,
        p2p_call_latency_s=p2p_call,
        op_s_per_byte=op_costs,
        op_call_s=op_calls,
        backend=backend,
        notes=tuple(notes),
    )


# ---- files ------------------------------------------------------------------------------------


def calibration_to_dict(cal: Calibration, csv_name: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "zsim_profile": FORMAT_VERSION,
        "name": cal.name,
        "device": profile_to_dict(cal.profile),
        "fit": {
            "residuals": [vars(r).copy() for r in cal.residuals],
            "collectives": {k: dict(v) for k, v in cal.collective_params.items()},
        },
        "provenance": dict(cal.provenance),
        "plan": dict(cal.plan),
        "measurements": [m.to_dict() for m in cal.measurements],
    }
    if csv_name:
        out["measurements_csv"] = csv_name
    return out


def calibration_from_dict(d: Any, source: str = "profile") -> Calibration:
    data = _mapping(source, d)
    version = data.get("zsim_profile")
    require(
        version == FORMAT_VERSION,
        f"{source}.zsim_profile",
        version,
        f"{FORMAT_VERSION} (a file written by `zsim calibrate`)",
    )
    require("device" in data, f"{source}.device", None, "required (missing from the file)")
    profile = profile_from_dict(data["device"], f"{source}.device")
    rows = data.get("measurements", [])
    require(isinstance(rows, list), f"{source}.measurements", type(rows).__name__, "a list")
    measurements = []
    for i, row in enumerate(rows):
        try:
            measurements.append(Measurement.from_dict(_mapping(f"{source}.measurements[{i}]", row)))
        except (TypeError, ValueError) as exc:
            if isinstance(exc, InputError):
                where = f"{source}.measurements[{i}].{exc.field}"
                raise InputError(where, exc.value, exc.allowed) from None
            raise InputError(f"{source}.measurements[{i}]", row, f"a measurement ({exc})") from None
    fit = _mapping(f"{source}.fit", data.get("fit", {}))
    try:
        res = [Residual(**r) for r in fit.get("residuals", [])]
    except TypeError as exc:
        where = f"{source}.fit.residuals"
        raise InputError(where, "...", f"rows of {Residual.__name__} ({exc})") from None
    return Calibration(
        name=str(data.get("name", profile.name)),
        profile=profile,
        measurements=tuple(measurements),
        residuals=tuple(res),
        collective_params=dict(fit.get("collectives", {})),
        provenance=dict(_mapping(f"{source}.provenance", data.get("provenance", {}))),
        plan=dict(_mapping(f"{source}.plan", data.get("plan", {}))),
    )


def save_profile(cal: Calibration, path: Path) -> list[Path]:
    """Write `path` (JSON) and the CSV of medians beside it, each via a temporary file renamed
    into place (a reader never sees half a file). The paths written."""
    import json

    csv_path = path.with_suffix(".csv")
    data = calibration_to_dict(cal, csv_path.name)
    rows = data.pop("measurements")
    head = json.dumps(data, indent=1)
    # one line per measurement: the file stays readable and diffs stay small
    body = ",\n".join("  " + json.dumps(r, separators=(",", ":")) for r in rows)
    text = head[:-2] + ',\n "measurements": [\n' + body + "\n ]\n}\n"
    _atomic_write(csv_path, measurements_csv(cal.measurements))
    _atomic_write(path, text)
    return [path, csv_path]


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def measurements_csv(rows: Sequence[Measurement]) -> str:
    head = (
        "kind,op,dtype,size_bytes,flops,m,n,k,batch,params,layer_key,micro_batch,group,ranks,"
        "link_class,samples,inner,median_s,q1_s,q3_s,algbw_GBps,busbw_GBps"
    )
    lines = [head]
    for r in rows:
        m, n, k, b = r.shape
        lines.append(
            ",".join(
                str(v)
                for v in (
                    r.kind,
                    r.op,
                    r.dtype,
                    r.size_bytes,
                    r.flops,
                    m,
                    n,
                    k,
                    b,
                    r.params,
                    r.layer_key,
                    r.micro_batch,
                    r.group,
                    r.ranks,
                    r.link_class,
                    len(r.samples_s),
                    r.inner,
                    f"{r.median_s:.6e}",
                    f"{r.q1_s:.6e}",
                    f"{r.q3_s:.6e}",
                    *_bandwidths_gbps(r),
                )
            )
        )
    return "\n".join(lines) + "\n"


def _bandwidths_gbps(row: Measurement) -> tuple[str, str]:
    """nccl-tests' algbw and busbw of a collective row's median, GB/s (blank for others)."""
    if row.kind is not Kind.COLLECTIVE:
        return "", ""
    return f"{algbw(row, row.median_s) / 1e9:.6g}", f"{busbw(row, row.median_s) / 1e9:.6g}"


def load_calibration(path: Path | str) -> Calibration:
    path = Path(path)
    return calibration_from_dict(load_json(path, "profile"), f"profile {path.name}")


def load_profile(path: Path | str) -> DeviceProfile:
    """The fitted DeviceProfile of a calibration file (`--profile FILE`)."""
    return load_calibration(path).profile


# ---- prediction bands -------------------------------------------------------------------------


def sample_profiles(
    profile: Path | str | Calibration, n: int, seed: int = 0
) -> list[DeviceProfile]:
    """`n` profiles consistent with the measured spread: each is refitted from a bootstrap
    resample (with replacement) of every measurement (`resampled`). Deterministic for a seed."""
    cal = profile if isinstance(profile, Calibration) else load_calibration(profile)
    require(bool(cal.measurements), "profile.measurements", [], "raw measurements to resample")
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        rows = tuple(resampled(r, rng) for r in cal.measurements)
        out.append(fit_profile(cal.name, rows, cal.provenance).profile)
    return out


def resampled(row: Measurement, rng: np.random.Generator) -> Measurement:
    """A bootstrap resample of a row's repeats. Where the calibration recorded its worker
    launches, whole launches are drawn first (with replacement), then repeats within each: a
    launch's repeats share its process's thread placement, so they are not independent draws
    (the cluster bootstrap), and drawing them as if they were understates the spread."""
    if not row.launch_samples:
        return row.with_samples(
            tuple(float(x) for x in rng.choice(row.samples_s, len(row.samples_s)))
        )
    ends = np.cumsum(row.launch_samples)[:-1]
    launches = np.split(np.asarray(row.samples_s), ends)
    drawn = [launches[i] for i in rng.integers(0, len(launches), len(launches))]
    samples = tuple(float(x) for launch in drawn for x in rng.choice(launch, len(launch)))
    return replace(row, samples_s=samples, launch_samples=tuple(len(d) for d in drawn))
