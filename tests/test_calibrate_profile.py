"""The committed profile of this machine's CPU (calibration/cpu-2rank.json): zsim's own models,
with the fitted numbers, reproduce the microbenchmarks they were fitted on.

Predictions come from the simulator's functions, not from the fit's module
(`zsim.calibrate.replay.model_of`).
Measured = the mean of the stored repeats (`Measurement.time_s`, what the fits target).
"""

from pathlib import Path

import numpy as np
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
# 14:53, the Intel host, nothing else running, just before the 1x2 validation), refitted to
# the rows' means (16:22).
KNOWN_KERNEL_MISFITS = {
    "bmm 128x64x128 x6": "-13%: mean 0.0943 ms (median 0.0821 [0.0778-0.115]), "
    "launches 0.0837/0.0801/0.119 ms (launches apart)",
    "bmm 128x64x128 x12": "-16%: mean 0.193 ms (median 0.167 [0.155-0.236]), "
    "launches 0.163/0.168/0.247 ms (launches apart)",
    "bmm 128x64x128 x24": "-13%: mean 0.372 ms (median 0.349 [0.339-0.368]), "
    "launches 0.338/0.358/0.418 ms (launches apart)",
    "bmm 128x64x128 x48": "-13%: mean 0.736 ms (median 0.702 [0.684-0.743]), "
    "launches 0.705/0.712/0.792 ms (launches agree)",
    "mm 128x768x3072": "+14%: mean 3.39 ms (median 3.45 [3.11-3.53]), "
    "launches 3.02/3.47/3.67 ms (launches agree)",
    "mm 128x4096x768": "-50%: mean 10.3 ms (median 10.3 [9.69-10.7]), "
    "launches 10.6/11/9.4 ms (launches agree)",
    "mm 512x768x1152": "-20%: mean 7.18 ms (median 7.03 [6.72-7.9]), "
    "launches 7.92/6.68/6.95 ms (launches agree)",
    "mm 256x768x3072": "-20%: mean 9.63 ms (median 8 [7.57-13.5]), "
    "launches 13/7.61/8.3 ms (launches apart)",
    "mm 256x3072x768": "-14%: mean 8.94 ms (median 8.07 [7.66-8.63]), "
    "launches 10.9/7.73/8.21 ms (launches apart)",
    "mm 128x8192x768": "-54%: mean 22.3 ms (median 22 [20.5-23.5]), "
    "launches 22.7/20.8/23.2 ms (launches agree)",
    "mm 3072x768x512": "+13%: mean 13.6 ms (median 13.5 [12.7-14.5]), "
    "launches 12.8/13.3/14.6 ms (launches agree)",
    "mm 2048x2048x2048": "+15%: mean 95.4 ms (median 99.9 [86.8-102]), "
    "launches 84.6/99.5/104 ms (launches apart)",
    "memcpy 64 MiB": "+15%: mean 8.8 ms (median 8.52 [7.27-10.1]), "
    "launches 7.58/10.6/8.16 ms (launches apart)",
    "memcpy 128 MiB": "-10%: mean 22.5 ms (median 22.2 [20.6-23.7]), "
    "launches 20.5/24.2/22.8 ms (launches agree)",
    "adamw 4194304 params": "+27%: mean 12.1 ms (median 12.2 [11.1-12.9]), "
    "launches 10.7/12.9/12.9 ms (launches agree)",
    "adamw 16777216 params": "-21%: mean 77.6 ms (median 75 [73.7-80.1]), "
    "launches 75.3/73.7/84.3 ms (launches agree)",
    "adamw 33554432 params": "-18%: mean 149 ms (median 148 [147-153]), "
    "launches 150/148/150 ms (launches agree)",
}
KNOWN_COLLECTIVE_MISFITS = {
    "all_gather_into_tensor intra n=2 8 B": "+32%: mean 0.42 ms (median 0.149 [0.122-0.191]), "
    "launches 0.47/0.31/0.479 ms (launches apart)",
    "all_gather_into_tensor intra n=2 1 KiB": "+19%: mean 0.464 ms (median 0.16 [0.125-0.354]), "
    "launches 0.391/0.682/0.318 ms (launches apart)",
    "all_gather_into_tensor intra n=2 4 KiB": "+19%: mean 0.464 ms (median 0.141 [0.129-0.229]), "
    "launches 0.684/0.52/0.189 ms (launches apart)",
    "all_gather_into_tensor intra n=2 64 KiB": "-26%: mean 0.784 ms (median 0.217 [0.165-0.555]), "
    "launches 0.876/0.812/0.663 ms (launches apart)",
    "reduce_scatter_tensor intra n=2 8 B": "+33%: mean 0.548 ms (median 0.171 [0.127-0.3]), "
    "launches 0.637/0.643/0.364 ms (launches apart)",
    "reduce_scatter_tensor intra n=2 1 KiB": "-15%: mean 1.5 ms (median 0.332 [0.206-2.68]), "
    "launches 1.61/0.915/1.97 ms (launches apart)",
    "reduce_scatter_tensor intra n=2 4 KiB": "-17%: mean 1.54 ms (median 0.429 [0.221-3.18]), "
    "launches 1.7/1.44/1.48 ms (launches agree)",
    "reduce_scatter_tensor intra n=2 16 KiB": "-20%: mean 1.61 ms (median 0.342 [0.245-3.25]), "
    "launches 1.69/1.4/1.76 ms (launches apart)",
    "reduce_scatter_tensor intra n=2 64 KiB": "-19%: mean 1.62 ms (median 1.06 [0.298-2.42]), "
    "launches 1.56/1.99/1.33 ms (launches apart)",
    "reduce_scatter_tensor intra n=2 256 KiB": "-14%: mean 1.67 ms (median 0.891 [0.417-2.89]), "
    "launches 1.61/1.66/1.74 ms (launches agree)",
    "reduce_scatter_tensor intra n=2 1 MiB": "-19%: mean 2.39 ms (median 1.73 [0.932-3.74]), "
    "launches 2.33/2.44/2.4 ms (launches agree)",
    "reduce_scatter_tensor intra n=2 64 MiB": "+11%: mean 54.5 ms (median 54.5 [49.8-58.2]), "
    "launches 49.7/58.3/56 ms (launches agree)",
    "all_reduce intra n=2 8 B": "+10%: mean 0.506 ms (median 0.132 [0.11-0.378]), "
    "launches 0.478/0.611/0.431 ms (launches apart)",
    "all_reduce intra n=2 4 KiB": "-18%: mean 1.35 ms (median 0.297 [0.19-2.21]), "
    "launches 1.9/1.25/0.893 ms (launches apart)",
    "all_reduce intra n=2 16 KiB": "-25%: mean 1.48 ms (median 0.491 [0.175-2.94]), "
    "launches 1.02/1.91/1.5 ms (launches apart)",
    "all_reduce intra n=2 64 KiB": "-28%: mean 1.57 ms (median 0.375 [0.211-3.08]), "
    "launches 1.38/1.7/1.63 ms (launches apart)",
    "all_reduce intra n=2 256 KiB": "-36%: mean 1.89 ms (median 0.956 [0.293-3.43]), "
    "launches 1.64/1.94/2.08 ms (launches apart)",
    "all_reduce intra n=2 1 MiB": "-48%: mean 2.98 ms (median 2.8 [0.644-3.94]), "
    "launches 2.67/2.88/3.39 ms (launches apart)",
    "all_reduce intra n=2 16 MiB": "+32%: mean 8.56 ms (median 8.56 [7.34-9.85]), "
    "launches 7.84/9.33/8.52 ms (launches agree)",
    "all_reduce intra n=2 64 MiB": "+34%: mean 33.6 ms (median 33.6 [29.9-37.9]), "
    "launches 31.7/33.4/36.6 ms (launches agree)",
    "all_reduce intra n=2 256 MiB": "+28%: mean 142 ms (median 138 [129-148]), "
    "launches 126/155/142 ms (launches apart)",
    "broadcast intra n=2 8 B": "-33%: mean 0.213 ms (median 0.0879 [0.0787-0.109]), "
    "launches 0.118/0.305/0.216 ms (launches apart)",
    "broadcast intra n=2 1 KiB": "+34%: mean 0.107 ms (median 0.0836 [0.0778-0.0902]), "
    "launches 0.0829/0.137/0.1 ms (launches apart)",
    "broadcast intra n=2 256 KiB": "-27%: mean 0.269 ms (median 0.11 [0.0923-0.141]), "
    "launches 0.145/0.317/0.344 ms (launches apart)",
    "broadcast intra n=2 1 MiB": "-40%: mean 0.584 ms (median 0.268 [0.24-0.327]), "
    "launches 0.258/0.84/0.655 ms (launches apart)",
    "broadcast intra n=2 16 MiB": "+13%: mean 3.09 ms (median 2.92 [2.64-3.24]), "
    "launches 2.75/3.42/3.11 ms (launches apart)",
    "sendrecv intra n=2 8 B": "-55%: mean 0.867 ms (median 0.152 [0.0823-1.81]), "
    "launches 0.762/1.24/0.599 ms (launches apart)",
    "sendrecv intra n=2 1 KiB": "-28%: mean 0.542 ms (median 0.106 [0.0698-0.178]), "
    "launches 0.538/0.981/0.107 ms (launches apart)",
    "sendrecv intra n=2 4 KiB": "-43%: mean 0.679 ms (median 0.1 [0.0726-0.96]), "
    "launches 0.73/0.524/0.782 ms (launches apart)",
    "sendrecv intra n=2 256 KiB": "+48%: mean 0.324 ms (median 0.181 [0.145-0.206]), "
    "launches 0.393/0.381/0.198 ms (launches apart)",
    "sendrecv intra n=2 1 MiB": "+23%: mean 0.613 ms (median 0.476 [0.415-0.531]), "
    "launches 0.679/0.648/0.512 ms (launches apart)",
    "sendrecv intra n=2 64 MiB": "-17%: mean 28.7 ms (median 28.8 [27.4-30.2]), "
    "launches 27.5/29.8/28.9 ms (launches agree)",
    "sendrecv intra n=2 256 MiB": "-16%: mean 112 ms (median 114 [104-123]), "
    "launches 103/121/110 ms (launches agree)",
}


def _known(reasons, key):
    reason = reasons.get(key)
    return [pytest.mark.xfail(strict=True, reason=reason)] if reason else []


@pytest.mark.parametrize(
    "row",
    [pytest.param(r, marks=_known(KNOWN_KERNEL_MISFITS, r.label), id=r.label) for r in KERNELS],
)
def test_model_reproduces_each_fitted_microbenchmark(row):
    assert predicted_s(row) == pytest.approx(row.time_s, rel=TOLERANCE)


@pytest.mark.parametrize(
    "row",
    [
        pytest.param(r, marks=_known(KNOWN_COLLECTIVE_MISFITS, r.label), id=r.label)
        for r in COLLECTIVES
    ],
)
def test_collective_model_reproduces_each_size(row):
    assert predicted_s(row) == pytest.approx(row.time_s, rel=TOLERANCE)


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
    vary between calibrations by more than the fit's tolerance). The bar is the fit's 10 %,
    or how far the other calibration's rows lie from the earlier one's own rows where that is
    more: a model cannot predict a row better than the row repeats. The collective rows' means
    move 13-20 % (median) between these calibrations (their medians 8-10 %: a quarter to half
    of the small calls wait a scheduler tick, `Measurement.time_s`); the model's error on them
    is 10-15 %, the kernel rows' within 10 %."""
    earlier = load_calibration(EARLIER)
    earlier_s = model_of(earlier)
    repeat = {(r.kind, r.label): r.time_s for r in load_calibration(path).measurements}
    rows = fitted_rows(earlier.measurements, earlier.provenance)
    rows = [r for r in rows if (r.kind is Kind.COLLECTIVE) == (kind == "collective")]
    errors = [abs(earlier_s(r) / repeat[(r.kind, r.label)] - 1) for r in rows]
    moved = [abs(r.time_s / repeat[(r.kind, r.label)] - 1) for r in rows]
    assert len(errors) > 50
    assert float(np.median(errors)) <= max(TOLERANCE, float(np.median(moved)))
