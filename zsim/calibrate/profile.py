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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields, is_dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from zsim.calibrate.engine_fit import ENGINE_CALLS
from zsim.calibrate.fit import Residual, fit_profile
from zsim.calibrate.measurement import Kind, Measurement, algbw, busbw
from zsim.cluster.device import (
    ZERO3_HOST_COSTS,
    ComputeRates,
    DeviceProfile,
    LayerTime,
    LinkFit,
)
from zsim.errors import InputError, is_whole, require
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
    """Every field of `p` as JSON: records as objects, mappings sorted by key."""
    return {f.name: _plain(getattr(p, f.name)) for f in fields(DeviceProfile)}


def _plain(value: Any) -> Any:
    if is_dataclass(value):  # a field left unmeasured (None) is left out: its default
        numbers = set(_number_fields(type(value)))
        return {k: v for k, v in vars(value).items() if v is not None and k in numbers}
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in sorted(value.items())}
    if isinstance(value, tuple):
        return list(value)
    return value


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
    return _keyed(where, value, [str(op) for op in CollectiveOp])


def _keyed(where: str, value: Any, keys: Sequence[str]) -> dict[str, float]:
    """A mapping from some of `keys` to non-negative numbers."""
    out = _mapping(where, value)
    for k, v in out.items():
        require(k in keys, where, k, f"one of {list(keys)}")
        out[k] = _number(f"{where}.{k}", v, allow_zero=True)
    return out


def _number_fields(kind: type[Any]) -> list[str]:
    """A record's measured numbers (not what only presets set: ComputeRates' flash figure,
    which a calibrated attention rate, measured at its own shapes, goes without)."""
    plain = (int, float, type(None))
    return [f.name for f in fields(kind) if f.default is MISSING or isinstance(f.default, plain)]


def _records(kind: type[Any], zero_ok: Sequence[str] = ()) -> Parse:
    """A mapping of names to records of `kind` (a dataclass of numbers)."""
    names = _number_fields(kind)
    optional = {f.name for f in fields(kind) if f.default is not MISSING}

    def parse(where: str, value: Any) -> dict[str, Any]:
        out = {}
        for key, record in _mapping(where, value).items():
            data = _mapping(f"{where}.{key}", record)
            missing = [f for f in names if f not in data and f not in optional]
            extra = sorted(set(data) - set(names))
            require(
                not missing,
                f"{where}.{key}.{missing[0] if missing else ''}",
                None,
                "required (missing from the file)",
            )
            require(
                not extra, f"{where}.{key}.{extra[0] if extra else ''}", None, f"one of {names}"
            )
            out[str(key)] = kind(
                **{
                    f: _number(f"{where}.{key}.{f}", data[f], f in zero_ok)
                    for f in names
                    if f in data
                }
            )
        return out

    return parse


def _string(where: str, value: Any) -> str:
    require(isinstance(value, str), where, value, "a string")
    return str(value)


def _notes(where: str, value: Any) -> tuple[str, ...]:
    ok = isinstance(value, list) and all(isinstance(n, str) for n in value)
    require(ok, where, value, "a list of strings")
    return tuple(value)


def _backend(where: str, value: Any) -> str:
    require(value in ("nccl", "gloo"), where, value, "nccl or gloo")
    return str(value)


_positive: Parse = _number
_non_negative: Parse = partial(_number, allow_zero=True)


def _count(where: str, value: Any) -> int:
    require(is_whole(value), where, value, "a whole number >= 0")
    return int(value)


def _optional(parse: Parse) -> Parse:
    return lambda where, value: None if value is None else parse(where, value)


def _positive_map(where: str, value: Any) -> dict[str, float]:
    return {str(k): _number(f"{where}.{k}", v) for k, v in _mapping(where, value).items()}


Parse = Callable[[str, Any], Any]

_RATES = _records(ComputeRates, ("gemm_overhead_s", "memory_overhead_s", "gemm_s_per_output"))


def _some(where: str, rates: dict[str, Any]) -> dict[str, Any]:
    require(bool(rates), where, {}, "rates for at least one dtype")
    return rates


PROFILE_FIELDS: dict[str, Parse] = {
    "name": _string,
    "memory_bytes": _positive,
    "reserved_bytes": _non_negative,
    "peak_flops": _positive_map,
    "rates": lambda where, value: _some(where, _RATES(where, value)),
    "host_link_bytes_per_s": _positive,
    "optimizer_bytes_per_s": _positive,
    "host_adam_params_per_s": _non_negative,
    "host_memory_bytes": _non_negative,
    "sm_count": _count,
    "layer_times": _records(LayerTime),
    "links": _records(LinkFit, ("latency_s",)),
    "call_latency_s": _optional(_non_negative),
    "message_s": _optional(_non_negative),
    "first_touch_bytes_per_s": _optional(_positive),
    "p2p_call_latency_s": _optional(_non_negative),
    "op_s_per_byte": _per_op,
    "op_call_s": _per_op,
    "engine_host_s": lambda where, value: _keyed(where, value, ENGINE_CALLS),
    "zero3_rank_host_s": lambda where, value: _keyed(where, value, ZERO3_HOST_COSTS),
    "backend": _backend,
    "notes": _notes,
}
"""How each field of a DeviceProfile is read from a file (every field has one: a test)."""


def profile_from_dict(d: Any, where: str = "profile.device") -> DeviceProfile:
    """A DeviceProfile from its JSON form; every missing or bad field is an InputError that
    names it. A field with a default may be absent."""
    data = _mapping(where, d)
    values = {}
    for f in fields(DeviceProfile):
        if f.name not in data:
            required = f.default is MISSING and f.default_factory is MISSING
            require(not required, f"{where}.{f.name}", None, "required (missing from the file)")
            continue
        values[f.name] = PROFILE_FIELDS[f.name](f"{where}.{f.name}", data[f.name])
    return DeviceProfile(**values)


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


def _ds_like(data: Mapping[str, Any]) -> bool:
    keys = ("zero_optimization", "train_batch_size", "train_micro_batch_size_per_gpu")
    return any(k in data for k in keys)


def calibration_from_dict(d: Any, source: str = "profile") -> Calibration:
    data = _mapping(source, d)
    version = data.get("zsim_profile")
    if version is None:
        looks = (
            " (it looks like a DeepSpeed config: give it to --ds-config)" if _ds_like(data) else ""
        )
        name = source.removeprefix("profile ")
        raise InputError("profile", name, f"a file written by `zsim calibrate`{looks}")
    require(
        version == FORMAT_VERSION,
        f"{source}.zsim_profile",
        version,
        f"{FORMAT_VERSION} (a file written by this version of `zsim calibrate`)",
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
    """Write `path` (JSON) and the CSV of its rows (median, quartiles, mean) beside it, each
    via a temporary file renamed into place (a reader never sees half a file). The paths
    written."""
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
        "link_class,samples,inner,median_s,q1_s,q3_s,algbw_GBps,busbw_GBps,mean_s"
    )
    lines = [head]
    for r in rows:
        plain = [r.kind, r.op, r.dtype, r.size_bytes, r.flops, *r.shape, r.params, r.layer_key]
        plain += [r.micro_batch, r.group, r.ranks, r.link_class, len(r.samples_s), r.inner]
        times = [f"{t:.6e}" for t in (r.median_s, r.q1_s, r.q3_s)]
        values = [*plain, *times, *_bandwidths_gbps(r), f"{r.time_s:.6e}"]
        lines.append(",".join(str(v) for v in values))
    return "\n".join(lines) + "\n"


def _bandwidths_gbps(row: Measurement) -> tuple[str, str]:
    """nccl-tests' algbw and busbw of a collective row's mean time (nccl-tests' own "time"),
    GB/s (blank for others)."""
    if row.kind is not Kind.COLLECTIVE:
        return "", ""
    return f"{algbw(row, row.time_s) / 1e9:.6g}", f"{busbw(row, row.time_s) / 1e9:.6g}"


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
        out.append(fit_profile(cal.name, rows, cal.provenance, diagnostics=False).profile)
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
