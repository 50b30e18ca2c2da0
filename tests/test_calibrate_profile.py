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
KNOWN_KERNEL_MISFITS = {
    "bmm 64x128x128 x48": "one GEMM rate: at batch 48 the operands (6 MB) spill L2 and run at "
    "82-85 GFLOP/s against 92 at batch 12 and 24 (-12 to -14%)",
    "bmm 128x128x64 x48": "as bmm 64x128x128 x48",
}
# zsim's gloo model against the measured loopback TCP of this host (per-op fits in the
# profile's fit.collectives show one link cannot serve all five ops):
KNOWN_COLLECTIVE_MISFITS = {
    "all_gather_into_tensor": "gloo allocates a temporary output and copies it into the user's "
    "tensor (notes/collectives_algorithms.md 1.2) and the loopback link is half duplex: the "
    "model has neither (measured 4x the model at 64 MiB)",
    "reduce_scatter_tensor": "gloo clones the input and copies the chunk out around a full "
    "all_reduce (1.3), the model has no local copies; loopback is half duplex",
    "all_reduce": "loopback TCP is CPU-bound: a rank's send and receive share one core, so a "
    "ring moving both ways at once gets half the one-way rate (sendrecv/all_reduce 1.5-1.8 "
    "GB/s vs broadcast 3.5-3.9 GB/s); the model's links are full duplex. Small sizes: gloo "
    "overlaps two segments, the model charges every segment's latency",
    "broadcast": "one direction per rank: the full loopback rate, above the compromise link",
    "sendrecv": "both directions at once: half duplex, as all_reduce",
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
