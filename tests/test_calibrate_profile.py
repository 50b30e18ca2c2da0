"""The committed profile of this machine's CPU (calibration/cpu-2rank.json): zsim's own models,
with the fitted numbers, reproduce the microbenchmarks they were fitted on.

Predictions come from the simulator's functions, not from the fit's module: a kernel from
`DeviceProfile.op_time_s`, a layer from `DeviceProfile.layer_time`, a copy or an Adam step from
the profile's rates, a collective from the flow simulation (`zsim.collectives.simulate_s`) of
the calls the microbenchmark ran, on the measured cluster's topology with the profile applied.
Measured = the median of the stored repeats.
"""

from pathlib import Path

import pytest

from zsim import presets
from zsim.calibrate.fit import DEFAULT_CACHE_BYTES, fitted_ids
from zsim.calibrate.keys import ADAM_STEP_BYTES_PER_PARAM
from zsim.calibrate.links import apply_profile, calls_of
from zsim.calibrate.plan import Kind
from zsim.calibrate.profile import load_calibration
from zsim.collectives import simulate_s
from zsim.model import ComputeOp, OpKind

PROFILE = Path(__file__).parent.parent / "calibration" / "cpu-2rank.json"
TOLERANCE = 0.10

if not PROFILE.exists():
    pytest.skip(f"{PROFILE} is not committed", allow_module_level=True)

CAL = load_calibration(PROFILE)
PROF = CAL.profile
CACHE = float(CAL.provenance.get("cache_bytes") or DEFAULT_CACHE_BYTES)
TOPO = apply_profile(presets.topology(CAL.provenance["topology"]), PROF)


def predicted_s(row):
    if row.kind is Kind.GEMM:
        op = ComputeOp(row.op, OpKind.GEMM, row.flops, 0.0, row.shape[:3], row.shape[3])
        return PROF.op_time_s(op, row.dtype)
    if row.kind is Kind.ATTENTION:
        return PROF.op_time_s(ComputeOp(row.op, OpKind.ATTENTION, row.flops, 0.0), row.dtype)
    if row.kind is Kind.MEMORY:
        return PROF.op_time_s(ComputeOp(row.op, OpKind.MEMORY, 0.0, row.size_bytes), row.dtype)
    if row.kind is Kind.LAYER_FORWARD:
        return PROF.layer_time(row.layer_key).forward_s
    if row.kind is Kind.LAYER_BACKWARD:
        return PROF.layer_time(row.layer_key).backward_s
    if row.kind is Kind.HOST_COPY:
        return row.size_bytes / PROF.host_link_bytes_per_s
    if row.kind is Kind.OPTIMIZER:
        return row.params * ADAM_STEP_BYTES_PER_PARAM / PROF.optimizer_bytes_per_s
    return max(simulate_s(TOPO, calls_of(TOPO, row)))


FITTED = [CAL.measurements[i] for i in sorted(fitted_ids(CAL.measurements, CACHE))]
KERNELS = [r for r in FITTED if r.kind is not Kind.COLLECTIVE]
COLLECTIVE_OPS = sorted({r.op for r in FITTED if r.kind is Kind.COLLECTIVE})


def test_profile_describes_this_setup():
    assert CAL.provenance["world_size"] == 2
    assert CAL.provenance["backend"] == "gloo"
    assert PROF.backend == "gloo"
    assert set(PROF.rates) == {"fp32"}
    assert "loopback" in PROF.links
    kinds = {r.kind for r in CAL.measurements}
    assert kinds == set(Kind)


# Rows the fitted kernel model misses by more than the tolerance, each with what it lacks.
# Strict: when a recalibration or a better model brings one within 10%, the test says so.
# (Measured 2026-11-29 13:17, load 0.5 on 2 cores, provenance.load_before; every recalibration
# moves a few rows across the 10% line, and this list is updated with it.) The DRAM-sized rows
# the memory and copy rates are fitted on disagree with each other by 30-40%.
KNOWN_KERNEL_MISFITS = {
    "bmm 128x64x128 x48": "-10.2%: quartiles 1.14-1.41 ms around the median 1.19 ms",
    "mm 128x3072x768": "-10.6%: one rate and one overhead for 37 GEMM shapes (median 3.3%)",
    "add 192 MiB": "+16.1%: 28 GB/s (quartiles 6.8-8.0 ms) against the 23.8 fitted with "
    "add 768 MiB, which ran at 18.2 GB/s",
    "add 768 MiB": "-25.0%: the other side of the same fit",
    "memcpy 256 MiB": "-10.5%: 10.2 GB/s against 11.7 at 64 MiB",
}
# zsim's gloo model (half-duplex rank stacks, one latency per ring step, a cost per message, the
# ranks' copies and sums, all_gather's flat output faulted in above a thread arena's 64 MiB heap,
# each op's own CPU per byte it moves, send/recv's own call latency) against this host's
# loopback TCP. Medians: all_gather 4.5%, reduce_scatter 3.1%, all_reduce 10.2%, broadcast
# 13.0%, sendrecv 4.9%. Rows beyond 10% (model vs measured median, first and third quartiles in
# brackets):
KNOWN_COLLECTIVE_MISFITS = {
    "all_gather_into_tensor": "1 MiB -17% [1.03-3.49 ms: contended], 16 MiB +10% [8.9-13.4 ms]",
    "reduce_scatter_tensor": "256 KiB -20% [0.78-3.53 ms: contended]; 64 MiB +11% [50.8-77.9 ms]",
    "all_reduce": "8 B to 16 KiB +10% to +11% (the common call latency plus messages); 1 and "
    "4 MiB -27%, -15% [1 MiB: 1.51-3.85 ms]; 64 MiB +16% [40.5-67.9 ms]",
    "broadcast": "4 KiB +12%, 256 KiB to 16 MiB -13% to -28% [16 MiB: 5.1-9.5 ms], 64 and "
    "256 MiB +15%, +17%",
    "sendrecv": "16 KiB +11%, 64 KiB -13% [0.20-0.28 ms], 256 MiB +12% [111-120 ms]",
}


def _known(reasons, key):
    reason = reasons.get(key)
    return [pytest.mark.xfail(strict=True, reason=reason)] if reason else []


@pytest.mark.parametrize(
    "row",
    [pytest.param(r, marks=_known(KNOWN_KERNEL_MISFITS, r.label), id=r.label) for r in KERNELS],
)
def test_model_reproduces_each_fitted_microbenchmark(row):
    assert predicted_s(row) == pytest.approx(row.median_s, rel=TOLERANCE)


@pytest.mark.parametrize(
    "op", [pytest.param(op, marks=_known(KNOWN_COLLECTIVE_MISFITS, op)) for op in COLLECTIVE_OPS]
)
def test_collective_model_reproduces_each_size(op):
    rows = [r for r in FITTED if r.kind is Kind.COLLECTIVE and r.op == op]
    errors = {r.label: predicted_s(r) / r.median_s - 1 for r in rows}
    assert max(abs(e) for e in errors.values()) <= TOLERANCE, errors
