"""The committed profile of this machine's CPU (calibration/cpu-2rank.json): zsim's own models,
with the fitted numbers, reproduce the microbenchmarks they were fitted on.

Predictions come from the simulator's functions, not from the fit's module
(`zsim.calibrate.replay.model_of`).
Measured = the median of the stored repeats.
"""

from pathlib import Path

import pytest

from zsim.calibrate.fit import fitted_rows
from zsim.calibrate.measurement import Kind
from zsim.calibrate.profile import load_calibration
from zsim.calibrate.replay import model_of

PROFILE = Path(__file__).parent.parent / "calibration" / "cpu-2rank.json"
TOLERANCE = 0.10

if not PROFILE.exists():
    pytest.skip(f"{PROFILE} is not committed", allow_module_level=True)

CAL = load_calibration(PROFILE)
PROF = CAL.profile
predicted_s = model_of(CAL)


FITTED = fitted_rows(CAL.measurements, CAL.provenance)
KERNELS = [r for r in FITTED if r.kind is not Kind.COLLECTIVE]
COLLECTIVES = [r for r in FITTED if r.kind is Kind.COLLECTIVE]


def test_profile_describes_this_setup():
    assert CAL.provenance["world_size"] == 2
    assert CAL.provenance["backend"] == "gloo"
    assert PROF.backend == "gloo"
    assert set(PROF.rates) == {"fp32"}
    assert "loopback" in PROF.links
    kinds = {r.kind for r in CAL.measurements}
    assert kinds == set(Kind)


# Rows the model misses by more than the tolerance, each with what was measured. Strict: when a
# recalibration or a better model brings one within 10%, the test says so. Every recalibration
# moves rows across the 10% line (benchmarks/results/calibration_repeat.md: 20-26 of the 55
# collective rows moved more than 10% between the four calibrations before this one), and this
# list is updated with it (`python -m tests.misfits` prints it). This calibration (2026-12-05
# 14:53, the Intel host, nothing else running, just before the 1x2 validation).
KNOWN_KERNEL_MISFITS = {
    "bmm 128x64x128 x48": "-10%: median 0.702 ms [0.684-0.743], "
    "launches 0.696/0.695/0.724 ms (launches agree)",
    "mm 128x4096x768": "-51%: median 10.3 ms [9.69-10.7], "
    "launches 10.5/10.6/9.33 ms (launches agree)",
    "mm 512x768x1152": "-20%: median 7.03 ms [6.72-7.9], "
    "launches 8.02/6.72/6.94 ms (launches agree)",
    "mm 128x8192x768": "-54%: median 22 ms [20.5-23.5], launches 23.2/20.7/23 ms (launches agree)",
    "mm 3072x768x512": "+11%: median 13.5 ms [12.7-14.5], "
    "launches 12.4/13.3/14.5 ms (launches agree)",
    "memcpy 64 MiB": "+16%: median 8.52 ms [7.27-10.1], launches 7.5/10.7/8.59 ms (launches apart)",
    "memcpy 128 MiB": "-11%: median 22.2 ms [20.6-23.7], "
    "launches 20.4/24.2/22.8 ms (launches agree)",
    "memcpy 256 MiB": "-10%: median 44.2 ms [43.4-45.2], "
    "launches 42.5/44.4/44.8 ms (launches agree)",
    "adamw 4194304 params": "+25%: median 12.2 ms [11.1-12.9], "
    "launches 10.6/12.6/12.8 ms (launches agree)",
    "adamw 16777216 params": "-19%: median 75 ms [73.7-80.1], "
    "launches 74.6/73.9/80.8 ms (launches agree)",
    "adamw 33554432 params": "-18%: median 148 ms [147-153], "
    "launches 150/147/150 ms (launches agree)",
}
KNOWN_COLLECTIVE_MISFITS = {
    "all_gather_into_tensor intra n=2 8 B": "+10%: median 0.149 ms [0.122-0.191], "
    "launches 0.129/0.166/0.153 ms (launches apart)",
    "all_gather_into_tensor intra n=2 4 KiB": "+17%: median 0.141 ms [0.129-0.229], "
    "launches 0.169/0.154/0.134 ms (launches apart)",
    "all_gather_into_tensor intra n=2 64 KiB": "-12%: median 0.217 ms [0.165-0.555], "
    "launches 0.178/0.193/0.234 ms (launches apart)",
    "reduce_scatter_tensor intra n=2 8 B": "+26%: median 0.171 ms [0.127-0.3], "
    "launches 0.198/0.183/0.153 ms (launches apart)",
    "reduce_scatter_tensor intra n=2 4 KiB": "-20%: median 0.429 ms [0.221-3.18], "
    "launches 0.377/0.386/0.582 ms (launches apart)",
    "reduce_scatter_tensor intra n=2 64 KiB": "-63%: median 1.06 ms [0.298-2.42], "
    "launches 1.61/0.397/1.32 ms (launches apart)",
    "reduce_scatter_tensor intra n=2 256 KiB": "-38%: median 0.891 ms [0.417-2.89], "
    "launches 0.456/0.636/1.45 ms (launches apart)",
    "reduce_scatter_tensor intra n=2 1 MiB": "-30%: median 1.73 ms [0.932-3.74], "
    "launches 1.91/1.72/1.58 ms (launches agree)",
    "reduce_scatter_tensor intra n=2 256 MiB": "+12%: median 212 ms [204-271], "
    "launches 205/217/237 ms (launches agree)",
    "all_reduce intra n=2 8 B": "+26%: median 0.132 ms [0.11-0.378], "
    "launches 0.104/0.147/0.141 ms (launches apart)",
    "all_reduce intra n=2 1 KiB": "+27%: median 0.227 ms [0.174-1.96], "
    "launches 0.999/1.52/0.179 ms (launches apart)",
    "all_reduce intra n=2 16 KiB": "-40%: median 0.491 ms [0.175-2.94], "
    "launches 0.186/1.03/1.15 ms (launches apart)",
    "all_reduce intra n=2 64 KiB": "-14%: median 0.375 ms [0.211-3.08], "
    "launches 0.258/0.375/0.816 ms (launches apart)",
    "all_reduce intra n=2 256 KiB": "-56%: median 0.956 ms [0.293-3.43], "
    "launches 0.465/0.557/1.38 ms (launches apart)",
    "all_reduce intra n=2 1 MiB": "-71%: median 2.8 ms [0.644-3.94], "
    "launches 2.63/2.76/3.39 ms (launches apart)",
    "all_reduce intra n=2 4 MiB": "-20%: median 3.05 ms [1.69-4.2], "
    "launches 2.52/3.83/2.57 ms (launches apart)",
    "all_reduce intra n=2 16 MiB": "+12%: median 8.56 ms [7.34-9.85], "
    "launches 8.24/8.9/8.24 ms (launches agree)",
    "all_reduce intra n=2 64 MiB": "+14%: median 33.6 ms [29.9-37.9], "
    "launches 32/31.8/36.4 ms (launches agree)",
    "all_reduce intra n=2 256 MiB": "+11%: median 138 ms [129-148], "
    "launches 126/156/139 ms (launches apart)",
    "broadcast intra n=2 8 B": "-18%: median 0.0879 ms [0.0787-0.109], "
    "launches 0.0834/0.0931/0.0952 ms (launches agree)",
    "broadcast intra n=2 1 KiB": "-13%: median 0.0836 ms [0.0778-0.0902], "
    "launches 0.0811/0.0899/0.0792 ms (launches agree)",
    "broadcast intra n=2 256 MiB": "-14%: median 57.2 ms [51.7-61.4], "
    "launches 51.1/61.4/58.1 ms (launches agree)",
    "sendrecv intra n=2 8 B": "-30%: median 0.152 ms [0.0823-1.81], "
    "launches 0.193/1.26/0.102 ms (launches apart)",
    "sendrecv intra n=2 256 KiB": "+14%: median 0.181 ms [0.145-0.206], "
    "launches 0.123/0.175/0.187 ms (launches apart)",
    "sendrecv intra n=2 64 MiB": "-12%: median 28.8 ms [27.4-30.2], "
    "launches 27.7/30.1/29.3 ms (launches agree)",
    "sendrecv intra n=2 256 MiB": "-11%: median 114 ms [104-123], "
    "launches 104/124/114 ms (launches agree)",
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
    "row",
    [
        pytest.param(r, marks=_known(KNOWN_COLLECTIVE_MISFITS, r.label), id=r.label)
        for r in COLLECTIVES
    ],
)
def test_collective_model_reproduces_each_size(row):
    assert predicted_s(row) == pytest.approx(row.median_s, rel=TOLERANCE)


# The repeatability study (benchmarks/results/calibration_repeat.md): four calibrations made
# before the allocator's top pad, within 82 minutes: 0 (committed before this one), a, b, c.
EARLIER = PROFILE.parent / "repeat" / "cpu-2rank-0.json"
REPEATS = sorted((PROFILE.parent / "repeat").glob("cpu-2rank-[abc].json"))


def test_the_repeat_calibrations_are_committed():
    assert EARLIER.exists()
    assert [p.stem for p in REPEATS] == ["cpu-2rank-a", "cpu-2rank-b", "cpu-2rank-c"]


@pytest.mark.parametrize("kind", ["kernel", "collective"])
@pytest.mark.parametrize("path", REPEATS, ids=[p.stem for p in REPEATS])
def test_a_profile_predicts_calibrations_it_was_not_fitted_on(path, kind):
    """The earlier profile against the three other calibrations of its setup, 12 minutes
    before to 70 after it: rows it never saw (the median error, the typical row; single rows
    vary between calibrations by more than the fit's tolerance)."""
    earlier = load_calibration(EARLIER)
    earlier_s = model_of(earlier)
    repeat = load_calibration(path)
    measured = {(r.kind, r.label): r.median_s for r in repeat.measurements}
    rows = fitted_rows(earlier.measurements, earlier.provenance)
    rows = [r for r in rows if (r.kind is Kind.COLLECTIVE) == (kind == "collective")]
    errors = [abs(earlier_s(r) / measured[(r.kind, r.label)] - 1) for r in rows]
    assert len(errors) > 50
    assert sorted(errors)[len(errors) // 2] <= TOLERANCE
