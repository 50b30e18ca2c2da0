"""The device model: memory, peak rates and the fitted time of each kernel.

A GPU preset is a spec sheet (peaks, memory) plus an efficiency fitted from public
microbenchmarks (`calibration/reference/microbenchmarks_gemm_hbm.csv`): never from end-to-end
training runs. A calibrated profile (`zsim calibrate`) replaces the fit with local measurements
and may carry measured times of whole layers, which take precedence.

Kernel time model (one place): a GEMM takes `overhead + max(flops / gemm_rate, bytes /
memory_rate)` (a roofline); a bandwidth-bound
kernel takes `overhead + bytes / memory_rate`; a fused attention kernel `overhead + flops /
attention_rate`. The rates are achieved rates at large sizes; the overhead is the fitted
intercept (launch plus tail effects).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from zsim.errors import InputError, positive_number, require
from zsim.model import ComputeOp, OpKind

GiB = 1024**3
GB = 1e9


@dataclass(frozen=True)
class ComputeRates:
    """Achieved rates of one dtype on one device."""

    gemm_flops_per_s: float
    gemm_overhead_s: float
    attention_flops_per_s: float
    memory_bytes_per_s: float
    memory_overhead_s: float

    def op_time_s(self, op: ComputeOp) -> float:
        if op.kind is OpKind.GEMM:  # roofline: thin GEMMs (attention's, small k) stream
            compute = op.flops / self.gemm_flops_per_s
            return self.gemm_overhead_s + max(compute, op.bytes_moved / self.memory_bytes_per_s)
        if op.kind is OpKind.ATTENTION:
            return self.gemm_overhead_s + op.flops / self.attention_flops_per_s
        return self.memory_overhead_s + op.bytes_moved / self.memory_bytes_per_s


@dataclass(frozen=True)
class LayerTime:
    """Measured forward and backward time of one layer at one shape (calibration)."""

    forward_s: float
    backward_s: float


@dataclass(frozen=True)
class LinkFit:
    """A link class's fitted latency and bandwidth (per direction), from calibration."""

    latency_s: float
    bandwidth_bytes_per_s: float


@dataclass(frozen=True)
class DeviceProfile:
    """What the simulator knows of one device (a GPU, or a CPU socket acting as one)."""

    name: str
    memory_bytes: float
    reserved_bytes: float
    peak_flops: Mapping[str, float]
    rates: Mapping[str, ComputeRates]  # by dtype name: fp16, bf16, fp32
    host_link_bytes_per_s: float  # device <-> host copies (offload)
    optimizer_bytes_per_s: float  # streaming rate of the fused Adam step on the device
    host_adam_params_per_s: float = 0.0  # CPU Adam rate for offload; 0 = unknown
    layer_times: Mapping[str, LayerTime] = field(default_factory=dict)
    links: Mapping[str, LinkFit] = field(default_factory=dict)  # by link class; overrides presets
    call_latency_s: float | None = None  # fitted fixed cost per collective call; None = preset's
    message_s: float | None = None  # fitted CPU per gloo message a rank handles; None = preset's
    first_touch_bytes_per_s: float | None = None  # fitted page faults of fresh memory (gloo)
    # fitted fixed cost of a gloo send/recv (posted on the caller's thread, not the process
    # group's worker queue); None = call_latency_s
    p2p_call_latency_s: float | None = None
    # fitted CPU seconds per byte a rank sends plus receives in each gloo op (by CollectiveOp
    # value) beyond the wire and the modelled copies and sums (fabric.LocalWork.op_s_per_byte)
    op_s_per_byte: Mapping[str, float] = field(default_factory=dict)
    # fitted CPU seconds per call of each gloo op beyond call_latency_s (fabric.LocalWork.op_call_s)
    op_call_s: Mapping[str, float] = field(default_factory=dict)
    backend: str = "nccl"  # "gloo" for CPU ranks: collectives and stream semantics differ
    notes: tuple[str, ...] = ()

    @property
    def usable_bytes(self) -> float:
        return self.memory_bytes - self.reserved_bytes

    def rates_for(self, dtype: str) -> ComputeRates:
        if dtype not in self.rates:
            raise InputError(
                "precision",
                dtype,
                f"one this device profile has rates for: {', '.join(self.rates)}",
            )
        return self.rates[dtype]

    def op_time_s(self, op: ComputeOp, dtype: str) -> float:
        return self.rates_for(dtype).op_time_s(op)

    def copy_time_s(self, nbytes: float, dtype: str) -> float:
        """A device-memory copy of `nbytes` (flatten, copy into a bucket, scale in place).

        A bandwidth-bound kernel's rate counts bytes read plus written, so a copy moves its
        bytes at half of it. On a CPU profile (gloo) the host link *is* the CPU's own copy:
        calibration times torch's `copy_` on the host, which is what DeepSpeed's copies are.
        """
        if self.backend == "gloo":
            return nbytes / self.host_link_bytes_per_s
        return 2 * nbytes / self.rates_for(dtype).memory_bytes_per_s

    def layer_time(self, key: str) -> LayerTime | None:
        return self.layer_times.get(key)


def layer_key(model_signature: str, layer_kind: str, micro_batch: int, tp: int, dtype: str) -> str:
    """The key under which calibration stores a measured layer time."""
    return f"{model_signature}|{layer_kind}|mb{micro_batch}|tp{tp}|{dtype}"


# ---- fitting from microbenchmarks ---------------------------------------------------------


def fit_gemm(shapes_tflops: list[tuple[int, int, int, float]]) -> tuple[float, float]:
    """(achieved FLOP/s, overhead s) from (m, n, k, measured TFLOP/s) rows, by least squares
    on t = overhead + flops / rate (t derived from each row as 2mnk / TFLOP/s)."""
    require(len(shapes_tflops) >= 2, "gemm rows", len(shapes_tflops), "at least two shapes")
    flops = np.array([2.0 * m * n * k for m, n, k, _ in shapes_tflops])
    times = flops / (np.array([r for *_, r in shapes_tflops]) * 1e12)
    # weight by 1/t so that small and large shapes count by relative error
    a = np.stack([np.ones_like(flops), flops], axis=1) / times[:, None]
    (overhead, inv_rate), *_ = np.linalg.lstsq(a, np.ones_like(times), rcond=None)
    return float(1.0 / inv_rate), float(max(overhead, 0.0))


def _number(row: dict[str, str], key: str) -> float:
    return float(row[key].replace(",", ""))


def profile_from_spec(
    spec: Mapping[str, Any],
    reference: list[dict[str, str]],
    measured_on: Mapping[str, Any] | None = None,
) -> DeviceProfile:
    """A GPU profile from its spec-sheet YAML and the reference microbenchmark rows.

    The rows were measured on `measured_on` (default: this GPU); efficiencies are fractions of
    that GPU's spec peaks, applied to this GPU's peaks.
    """
    source = measured_on or spec
    name = str(spec.get("name", "?"))
    peaks = _peaks(spec)
    source_peaks = _peaks(source)
    rows = [r for r in reference if r["gpu_type"].startswith(str(source["match"]))]
    require(bool(rows), f"{name}.match", source.get("match"), "a gpu_type in the reference rows")
    notes = [] if source is spec else [f"efficiencies borrowed from {source['name']} measurements"]

    gemm_rows = [r for r in rows if r["benchmark"] == "cuBLASLt GEMM"]
    gemm_dtype = gemm_rows[0]["dtype"].lower()
    rate, overhead = fit_gemm(
        [(int(r["m"]), int(r["n"]), int(r["k"]), _number(r, "value")) for r in gemm_rows]
    )
    gemm_eff = rate / source_peaks[gemm_dtype]
    if gemm_dtype not in ("fp16", "bf16"):
        notes.append(f"16-bit GEMM efficiency taken from {gemm_dtype.upper()} measurements")
    flash = [_number(r, "value") for r in rows if r["benchmark"].startswith("Flash Attention")]
    flash_eff = flash[0] * 1e12 / source_peaks["bf16"] if flash else gemm_eff / 2
    hbm = [
        _number(r, "value") for r in rows if re.match(r"HBM (Copy|Mul|Add|Triad)", r["benchmark"])
    ]
    hbm_frac = float(np.median(hbm)) * 1e12 / (float(source["hbm_GBps"]) * GB)
    mem_rate = hbm_frac * positive_number(f"{name}.hbm_GBps", spec["hbm_GBps"]) * GB
    rates = {
        dtype: ComputeRates(peak * gemm_eff, overhead, peak * flash_eff, mem_rate, overhead)
        for dtype, peak in peaks.items()
    }
    h2d = [_number(r, "value") for r in rows if r["benchmark"] == "nvbandwidth Host to Device"]
    host_link = (h2d[0] if h2d and source is spec else float(spec["host_link_GBps"])) * GB
    return DeviceProfile(
        name=name,
        memory_bytes=_memory_bytes(spec),
        reserved_bytes=float(spec.get("reserved_GiB", 0.0)) * GiB,
        peak_flops=peaks,
        rates=rates,
        host_link_bytes_per_s=host_link,
        optimizer_bytes_per_s=mem_rate,
        notes=tuple(notes),
    )


def _peaks(spec: Mapping[str, Any]) -> dict[str, float]:
    name = spec.get("name", "?")
    peaks = {
        str(k): positive_number(f"{name}.peak_TFLOPS.{k}", v) * 1e12
        for k, v in dict(spec.get("peak_TFLOPS") or {}).items()
    }
    require(bool(peaks), f"{name}.peak_TFLOPS", None, "peak TFLOP/s per dtype")
    return peaks


def _memory_bytes(spec: Mapping[str, Any]) -> float:
    if "memory_GiB" in spec:
        return positive_number("memory_GiB", spec["memory_GiB"]) * GiB
    return positive_number("memory_GB", spec.get("memory_GB")) * GB


def with_memory(profile: DeviceProfile, memory_bytes: float) -> DeviceProfile:
    return replace(profile, memory_bytes=memory_bytes)


def fits(total_bytes: float, profile: DeviceProfile) -> bool:
    return total_bytes <= profile.usable_bytes and math.isfinite(total_bytes)
