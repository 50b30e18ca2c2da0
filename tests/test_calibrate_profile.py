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
# (Measured on a busy host: load 2.9 on 2 cores, provenance.load_before.)
_BMM = "one GEMM rate: at batch 48 the operands (6 MB) spill L2 and run at 64-72 GFLOP/s"
KNOWN_KERNEL_MISFITS = {
    "bmm 64x128x128 x48": _BMM + " (-24%)",
    "bmm 128x64x128 x48": _BMM + " (-30%)",
    "bmm 128x128x64 x48": _BMM + " (-22%)",
    "mm 256x256x256": "+12%: 102 GFLOP/s, the fastest GEMM measured (the peak), above the "
    "fitted 91.5",
    "mm 128x3072x768": "-10.4%: 82 GFLOP/s against the fitted 91.5 (its transpose "
    "768x3072x128 runs at 83, -9.1%)",
    "add 192 MiB": "+14%: 25.3 GB/s (third quartile 12.4 ms against the median 8.0 ms) and "
    "add 768 MiB 17.6 GB/s: the two DRAM-sized rows the rate is fitted on differ by 30%",
    "add 768 MiB": "-21%: as add 192 MiB",
    "sdpa mb4 2.01e+08 FLOP": "-11.5%: 57.5 GFLOP/s against the 65.0 fitted on three sizes",
    "memcpy 256 MiB": "-11.6%: 10.3 GB/s against 11.8 and 12.5 at the smaller copies",
}
# zsim's gloo model (half-duplex rank stacks, one latency per ring step, a cost per message, the
# ranks' copies and sums, each op's own CPU per byte it moves, send/recv's own call latency)
# against the measured loopback TCP of this host. Medians: all_gather 7.8%, reduce_scatter
# 7.5%, all_reduce 17.1%, broadcast 5.7%, sendrecv 8.2%; these rows are beyond 10% (model vs
# measured median, quartiles in the file):
KNOWN_COLLECTIVE_MISFITS = {
    "all_gather_into_tensor": "its bus bandwidth peaks at 16 MiB (0.84 GB/s) and falls at 64 "
    "and 256 MiB (0.45 GB/s): 74 ms at 64 MiB against 10 ms at 16 MiB, where sendrecv of the "
    "same bytes per direction grows linearly and the CPU ranks keep freed blocks (no page "
    "faults); one cost per byte cannot follow the fall: 4 and 16 MiB +12% and +27%, 64 and "
    "256 MiB -33% and -35%; 8 B -11% (third quartile 0.50 ms against the median 0.40)",
    "reduce_scatter_tensor": "1 KiB to 256 KiB: medians (0.53-0.85 ms) far above their first "
    "quartiles (0.42-0.65 ms) with third quartiles of 2.6-3.6 ms: contended, -10% to -19%; "
    "1 MiB +11% (its copies and transfers run from cache, faster than the DRAM rates)",
    "all_reduce": "8 B to 16 KiB +14% to +20% (0.30-0.44 ms against the common call latency "
    "219 us plus 4 to 8 messages); 256 KiB and 1 MiB -60%: medians 1.70 and 3.18 ms far above "
    "their first quartiles (0.75, 1.55 ms), contended; 4 MiB -23%; 64 and 256 MiB +23% and "
    "+12%: 128 and 512 segment messages at the 33 us fitted on small calls, where a "
    "streaming loop overlaps them",
    "broadcast": "8 B -14% (third quartile 0.34 ms against the median 0.29, the other small "
    "sizes 0.23-0.25 ms); 16 KiB +10.2%",
    "sendrecv": "its rate grows with size (2.9 GB/s both ways at 4 MiB, 4.25 at 256 MiB) where "
    "the model's is one: 64 KiB, 1 and 4 MiB -12%, -13%, -16%, 256 MiB +14%; 4 KiB +10.0%",
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
