"""The committed profile of this machine's CPU (calibration/cpu-2rank.json): zsim's own models,
with the fitted numbers, reproduce the microbenchmarks they were fitted on.

Predictions come from the simulator's functions, not from the fit's module: a kernel from
`DeviceProfile.op_time_s`, a layer from `DeviceProfile.layer_time`, a copy or an Adam step from
the profile's rates, a collective from `zsim.collectives.estimate_s` on the measured cluster's
topology with the profile applied. Measured = the median of the stored repeats.
"""

from pathlib import Path

import pytest

from zsim import presets
from zsim.calibrate.fit import DEFAULT_CACHE_BYTES, fitted_ids
from zsim.calibrate.keys import ADAM_STEP_BYTES_PER_PARAM
from zsim.calibrate.links import apply_profile, call_of
from zsim.calibrate.plan import Kind
from zsim.calibrate.profile import load_calibration
from zsim.collectives import estimate_s
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
    return estimate_s(TOPO, call_of(TOPO, row))


FITTED = [CAL.measurements[i] for i in sorted(fitted_ids(CAL.measurements, CACHE))]


def test_profile_describes_this_setup():
    assert CAL.provenance["world_size"] == 2
    assert CAL.provenance["backend"] == "gloo"
    assert PROF.backend == "gloo"
    assert set(PROF.rates) == {"fp32"}
    assert "loopback" in PROF.links
    kinds = {r.kind for r in CAL.measurements}
    assert kinds == set(Kind)


@pytest.mark.parametrize("row", FITTED, ids=lambda r: r.label)
def test_model_reproduces_each_fitted_microbenchmark(row):
    assert predicted_s(row) == pytest.approx(row.median_s, rel=TOLERANCE)
