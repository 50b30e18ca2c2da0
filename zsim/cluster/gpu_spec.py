"""GPU presets: a spec sheet (`calibration/presets/*.yaml`: peaks, memory, HBM) and the public
microbenchmark rows (`calibration/reference/microbenchmarks_gemm_hbm.csv`) -> a `DeviceProfile`.
The efficiencies come from microbenchmarks only, never from end-to-end training runs."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from zsim.cluster.device import ADAM_STEP_BYTES_PER_PARAM, GB, ComputeRates, DeviceProfile, GiB
from zsim.cluster.flash_rates import family_of
from zsim.errors import positive_number, require

# DeepSpeedCPUAdam streams ADAM_STEP_BYTES_PER_PARAM per step (`Step_AVX`: fp32 parameters,
# gradients and both moments read; parameters and moments written) at 0.95 of a plain copy's
# bandwidth (benchmarks/results/cpu_adam.md, measured with DeepSpeed 0.19.8 on CPU)
CPU_ADAM_COPY_FRACTION = 0.95

# Maximum achievable matmul efficiency (the best shape of a sweep / the spec peak) by GPU and
# dtype, each GPU measured with one tool (mamf-finder.py): stas00/ml-engineering,
# compute/accelerator/README.md, "Maximum Achievable Matmul FLOPS comparison table" (H100 SXM
# BF16 794.5 / 989 TFLOP/s, FP8 1402.6 / 1979; H200 FP8 1453.4 / 1979, BF16 "the same" as
# the H100's). Only their ratio is used: it carries a GPU's GEMM rows of one dtype over to
# another (the reference rows of Hopper are FP8 only).
MAMF_EFFICIENCY: dict[str, dict[str, float]] = {
    "h100": {"bf16": 794.5 / 989, "fp8": 1402.6 / 1979},
    "h200": {"bf16": 794.5 / 989, "fp8": 1453.4 / 1979},
}
SIXTEEN_BIT = ("fp16", "bf16")  # one tensor-core rate on these GPUs (spec sheets)


def host_memory_bytes(spec: Mapping[str, Any]) -> float:
    """One GPU's rank's share of its host's DRAM (spec sheet), which offload fills; 0 when
    the preset gives none (then it is not checked)."""
    host = spec.get("host")
    if not isinstance(host, Mapping) or "memory_GB" not in host:
        return 0.0
    name = spec.get("name", "?")
    total = positive_number(f"{name}.host.memory_GB", host.get("memory_GB")) * GB
    return total / positive_number(f"{name}.host.gpus", host.get("gpus"))


def host_adam_params_per_s(spec: Mapping[str, Any]) -> float:
    """Offload's CPU Adam rate for one GPU's rank: its share of the host's DRAM bandwidth
    (spec sheet; the GPUs of one host share it) at the fraction CPU Adam reaches of a copy.
    An upper bound: a copy itself reaches only part of the spec bandwidth. 0 without a host."""
    host = spec.get("host")
    if host is None:
        return 0.0
    name = spec.get("name", "?")
    require(isinstance(host, Mapping), f"{name}.host", host, "memory_GBps and gpus")
    bandwidth = positive_number(f"{name}.host.memory_GBps", host.get("memory_GBps")) * GB
    gpus = positive_number(f"{name}.host.gpus", host.get("gpus"))
    return CPU_ADAM_COPY_FRACTION * bandwidth / gpus / ADAM_STEP_BYTES_PER_PARAM


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


def fit_gemm_tiles(shapes_tflops: list[tuple[int, int, int, float]]) -> tuple[float, float, float]:
    """(achieved FLOP/s, overhead s, s per output element) from (m, n, k, measured TFLOP/s)
    rows: t = overhead + flops / rate + m n x per_output, by least squares on relative error
    (a negative intercept is held at 0, as in fit_gemm).
    The last term is each output tile's fixed work (its epilogue and pipeline fill), which a
    GEMM of small k cannot amortize: cuBLASLt's 802816 x 192 x 768 runs at 62 % of the large
    squares' rate on an A100. A term the rows make negative is dropped (fit_gemm then)."""
    flops = np.array([2.0 * m * n * k for m, n, k, _ in shapes_tflops])
    outputs = np.array([float(m * n) for m, n, _, _ in shapes_tflops])
    times = flops / (np.array([r for *_, r in shapes_tflops]) * 1e12)
    require(len(shapes_tflops) >= 3, "gemm rows", len(shapes_tflops), "at least three shapes")
    a = np.stack([np.ones_like(flops), flops, outputs], axis=1) / times[:, None]
    (overhead, inv_rate, per_output), *_ = np.linalg.lstsq(a, np.ones_like(times), rcond=None)
    if overhead < 0 and per_output >= 0:  # no intercept, as fit_gemm clamps it
        (inv_rate, per_output), *_ = np.linalg.lstsq(a[:, 1:], np.ones_like(times), rcond=None)
        overhead = 0.0
    if per_output < 0 or inv_rate <= 0:
        rate, fixed = fit_gemm(shapes_tflops)
        return rate, fixed, 0.0
    return float(1.0 / inv_rate), float(overhead), float(per_output)


def _host_link(rows: list[dict[str, str]], spec: Mapping[str, Any], own_rows: bool) -> float:
    """Host-to-device bytes/s: the GPU's nvbandwidth row, else its spec sheet's link."""
    h2d = [_number(r, "value") for r in rows if r["benchmark"] == "nvbandwidth Host to Device"]
    return (h2d[0] if h2d and own_rows else float(spec["host_link_GBps"])) * GB


def _flash(
    rows: list[dict[str, str]], match: str, bf16_peak: float
) -> tuple[float, str, tuple[int, int]]:
    """The FlashAttention-2 row's efficiency (0 without one), the figure that scales it by
    shape and mask, and the (head dim, sequence) it was measured at, from its notes ("head dim
    64, batch 2, seq 8192")."""
    row = next((r for r in rows if r["benchmark"].startswith("Flash Attention")), None)
    if row is None:
        return 0.0, "", (0, 0)
    eff = _number(row, "value") * 1e12 / bf16_peak
    dims = [re.search(rf"{key} (\d+)", row.get("notes", "")) for key in ("head dim", "seq")]
    family = family_of(match)
    if not family or dims[0] is None or dims[1] is None:
        return eff, "", (0, 0)
    return eff, family, (int(dims[0].group(1)), int(dims[1].group(1)))


def dtype_ratios(match: str, rows_dtype: str, dtypes: list[str]) -> dict[str, float]:
    """Each dtype's GEMM efficiency relative to that of the rows' dtype: the ratio of the two
    dtypes' maximum achievable efficiencies on this GPU (MAMF_EFFICIENCY), 1 where either is
    not measured."""
    text = match.lower()
    mamf = next((e for gpu, e in MAMF_EFFICIENCY.items() if gpu in text), {})

    def measured(dtype: str) -> float:
        return mamf.get("bf16" if dtype in SIXTEEN_BIT else dtype, 0.0)

    base = measured(rows_dtype)
    return {d: measured(d) / base if base and measured(d) else 1.0 for d in dtypes}


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

    gemm_dtype, rate, overhead, per_output = _gemm_fit(rows)
    gemm_eff = rate / source_peaks[gemm_dtype]
    ratio = dtype_ratios(str(source["match"]), gemm_dtype, list(peaks))
    if gemm_dtype not in SIXTEEN_BIT:
        carried = f"x {ratio['bf16']:.3f} (MAMF)" if ratio.get("bf16", 1.0) != 1.0 else "as is"
        notes.append(f"16-bit GEMM efficiency from {gemm_dtype.upper()} measurements, {carried}")
    flash_eff, family, anchor = _flash(rows, str(source["match"]), source_peaks["bf16"])
    flash_eff = flash_eff or gemm_eff / 2
    hbm = [
        _number(r, "value") for r in rows if re.match(r"HBM (Copy|Mul|Add|Triad)", r["benchmark"])
    ]
    hbm_frac = float(np.median(hbm)) * 1e12 / (float(source["hbm_GBps"]) * GB)
    mem_rate = hbm_frac * positive_number(f"{name}.hbm_GBps", spec["hbm_GBps"]) * GB
    # the per-output cost scales as the rate does: the same tiles at this dtype's rate
    rates = {
        dtype: ComputeRates(
            peak * gemm_eff * ratio[dtype],
            overhead,
            peak * flash_eff,
            mem_rate,
            overhead,
            per_output * source_peaks[gemm_dtype] / (peak * ratio[dtype]),
            *(family, anchor),
        )
        for dtype, peak in peaks.items()
    }
    return DeviceProfile(
        name=name,
        memory_bytes=_memory_bytes(spec),
        reserved_bytes=float(spec.get("reserved_GiB", 0.0)) * GiB,
        peak_flops=peaks,
        rates=rates,
        host_link_bytes_per_s=_host_link(rows, spec, source is spec),
        optimizer_bytes_per_s=mem_rate,
        host_adam_params_per_s=host_adam_params_per_s(spec),
        host_memory_bytes=host_memory_bytes(spec),
        sm_count=int(spec.get("sm_count", 0)),
        notes=tuple(notes),
    )


def _gemm_fit(rows: list[dict[str, str]]) -> tuple[str, float, float, float]:
    """The cuBLASLt rows' dtype and their fit: rate, overhead, cost per output element."""
    gemm_rows = [r for r in rows if r["benchmark"] == "cuBLASLt GEMM"]
    shapes = [(int(r["m"]), int(r["n"]), int(r["k"]), _number(r, "value")) for r in gemm_rows]
    return (gemm_rows[0]["dtype"].lower(), *fit_gemm_tiles(shapes))


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
