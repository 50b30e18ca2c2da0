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
# list is updated with it (`python -m tests.misfits` prints it). This calibration (2026-12-04
# 03:18, a freshly booted VM with nothing else running, just before the 1x2 validation): most
# misfits are still rows whose launches disagree among themselves by more than 10 %.
KNOWN_KERNEL_MISFITS = {
    "mm 128x128x128": "+14%: median 0.0512 ms [0.0473-0.0532], "
    "launches 0.0437/0.0513/0.0533 ms (launches agree)",
    "mm 256x256x256": "+18%: median 0.386 ms [0.349-0.406], "
    "launches 0.33/0.404/0.389 ms (launches apart)",
    "mm 128x384x768": "+10%: median 0.924 ms [0.779-0.979], "
    "launches 0.758/0.97/0.94 ms (launches apart)",
    "mm 384x768x128": "+14%: median 0.894 ms [0.786-0.955], "
    "launches 0.759/0.914/0.956 ms (launches apart)",
    "bmm 64x128x128 x48": "-31%: median 1.97 ms [1.51-2.29], "
    "launches 1.45/2.38/1.97 ms (launches apart)",
    "bmm 128x64x128 x48": "-31%: median 1.98 ms [1.22-2.14], "
    "launches 1.17/2.12/2.03 ms (launches apart)",
    "bmm 128x128x64 x48": "-28%: median 1.9 ms [1.52-2.09], "
    "launches 1.39/1.99/2.05 ms (launches apart)",
    "mm 256x384x768": "+14%: median 1.79 ms [1.71-1.93], "
    "launches 1.66/1.96/1.74 ms (launches agree)",
    "mm 256x768x1152": "+14%: median 5.37 ms [5.08-5.8], "
    "launches 5.13/5.19/5.91 ms (launches agree)",
    "mm 768x2304x128": "-15%: median 7.22 ms [6.8-8.95], "
    "launches 9.04/6.86/6.99 ms (launches apart)",
    "mm 128x3072x768": "-19%: median 10.1 ms [8.51-12.6], "
    "launches 13/9.96/8.38 ms (launches apart)",
    "mm 512x768x768": "-30%: median 11.6 ms [8.54-12.1], "
    "launches 11.6/12.3/8.34 ms (launches apart)",
    "mm 768x3072x128": "-13%: median 9.36 ms [8.83-9.9], "
    "launches 8.95/9.74/9.27 ms (launches agree)",
    "mm 3072x768x128": "-16%: median 9.75 ms [8.44-10.3], "
    "launches 7.73/10.4/9.83 ms (launches apart)",
    "mm 128x4096x768": "-23%: median 14 ms [13.3-18.5], launches 12.5/19/14 ms (launches apart)",
    "mm 768x2304x256": "-11%: median 13.7 ms [13.1-17.7], "
    "launches 13/13.6/17.9 ms (launches apart)",
    "mm 256x768x3072": "+10%: median 14.8 ms [14.6-15.1], "
    "launches 14.6/15.4/14.8 ms (launches agree)",
    "mm 128x8192x768": "-16%: median 25.7 ms [23-28.3], "
    "launches 22.2/26.5/27.9 ms (launches apart)",
    "mm 256x4096x768": "-10%: median 24.2 ms [19.6-25.8], "
    "launches 18.7/25.8/24.6 ms (launches apart)",
    "mm 768x4096x256": "-16%: median 25.8 ms [19.2-29.1], "
    "launches 18.6/26/29.5 ms (launches apart)",
    "mm 768x8192x128": "-15%: median 25.6 ms [22.1-31.1], "
    "launches 21.5/25.8/32 ms (launches apart)",
    "mm 256x768x8192": "+11%: median 39.1 ms [37.8-40.4], "
    "launches 34.5/39.3/40.7 ms (launches agree)",
    "add 192 MiB": "+19%: median 7.79 ms [6.8-11.1], launches 6.71/12.4/7.67 ms (launches apart)",
    "add 768 MiB": "-33%: median 54.9 ms [52.5-58.3], launches 58.4/55/52.4 ms (launches agree)",
    "sdpa mb1 5.03e+07 FLOP": "+14%: median 0.842 ms [0.761-0.908], "
    "launches 0.774/0.908/0.812 ms (launches agree)",
    "sdpa mb2 1.01e+08 FLOP": "-12%: median 2.18 ms [1.94-2.24], "
    "launches 1.89/2.2/2.23 ms (launches agree)",
    "memcpy 256 MiB": "-13%: median 40.4 ms [37.3-42.7], "
    "launches 40.3/40.6/40.4 ms (launches agree)",
    "adamw 16777216 params": "+11%: median 48 ms [46.8-50.1], "
    "launches 50.1/47.2/47.4 ms (launches agree)",
    "adamw 33554432 params": "-10%: median 119 ms [107-131], "
    "launches 106/132/112 ms (launches apart)",
}
# zsim's gloo model (half-duplex rank stacks, one latency per ring step, a cost per message, the
# ranks' copies and sums, all_gather's flat output faulted in above a thread arena's 64 MiB heap,
# each op's own CPU per byte it moves and per call, send/recv's own call latency) against this
# host's loopback TCP. Model vs median, [quartiles], the median of each of the 3 launches, and
# whether one time is within 10% of every launch's median. Small calls are bimodal (a ~4 ms
# stall in a quarter to half of them, which follows the host's scheduling of this VM:
# calibration_repeat.md), and whole launches sit in the slow mode or not.
KNOWN_COLLECTIVE_MISFITS = {
    "all_gather_into_tensor intra n=2 16 KiB": "+13%: median 0.505 ms [0.421-0.822], "
    "launches 0.491/0.468/0.687 ms (launches apart)",
    "all_gather_into_tensor intra n=2 64 KiB": "+12%: median 0.535 ms [0.439-0.692], "
    "launches 0.484/0.573/0.502 ms (launches agree)",
    "all_gather_into_tensor intra n=2 256 KiB": "+13%: median 0.639 ms [0.519-0.969], "
    "launches 0.63/0.572/0.772 ms (launches apart)",
    "all_gather_into_tensor intra n=2 1 MiB": "-11%: median 1.37 ms [0.796-3.76], "
    "launches 1/0.989/2.09 ms (launches apart)",
    "reduce_scatter_tensor intra n=2 8 B": "+24%: median 0.605 ms [0.464-1.14], "
    "launches 0.451/0.899/0.653 ms (launches apart)",
    "reduce_scatter_tensor intra n=2 1 KiB": "-16%: median 1.26 ms [0.716-3.78], "
    "launches 0.823/1.26/1.6 ms (launches apart)",
    "reduce_scatter_tensor intra n=2 64 KiB": "-47%: median 2.18 ms [0.881-4.55], "
    "launches 0.762/2.57/3.82 ms (launches apart)",
    "reduce_scatter_tensor intra n=2 1 MiB": "-25%: median 3.15 ms [1.68-5.06], "
    "launches 1.41/2.98/4.25 ms (launches apart)",
    "reduce_scatter_tensor intra n=2 64 MiB": "+25%: median 75.6 ms [64.2-95.5], "
    "launches 64.1/99.5/86.7 ms (launches apart)",
    "all_reduce intra n=2 8 B": "+12%: median 0.539 ms [0.422-1.08], "
    "launches 0.432/0.983/0.487 ms (launches apart)",
    "all_reduce intra n=2 4 KiB": "+18%: median 0.787 ms [0.545-2.47], "
    "launches 0.586/0.982/0.633 ms (launches apart)",
    "all_reduce intra n=2 16 KiB": "-21%: median 1.18 ms [0.636-3.71], "
    "launches 0.678/2.37/0.838 ms (launches apart)",
    "all_reduce intra n=2 256 KiB": "-14%: median 1.36 ms [0.766-3.55], "
    "launches 2.16/1.52/0.963 ms (launches apart)",
    "all_reduce intra n=2 1 MiB": "-16%: median 2.26 ms [1.32-4.31], "
    "launches 1.25/2.24/3 ms (launches apart)",
    "all_reduce intra n=2 4 MiB": "-16%: median 5.66 ms [4.37-6.82], "
    "launches 5.05/6.06/5.56 ms (launches agree)",
    "all_reduce intra n=2 64 MiB": "+12%: median 64.6 ms [55-77.9], "
    "launches 54.6/71.1/80.2 ms (launches apart)",
    "all_reduce intra n=2 256 MiB": "+11%: median 260 ms [247-293], "
    "launches 248/288/294 ms (launches agree)",
    "broadcast intra n=2 16 KiB": "-18%: median 0.4 ms [0.301-0.845], "
    "launches 0.359/0.498/0.387 ms (launches apart)",
    "broadcast intra n=2 64 KiB": "-12%: median 0.396 ms [0.327-0.511], "
    "launches 0.382/0.362/0.428 ms (launches agree)",
    "broadcast intra n=2 1 MiB": "+12%: median 0.674 ms [0.523-0.891], "
    "launches 0.648/0.663/0.815 ms (launches apart)",
    "broadcast intra n=2 256 MiB": "-16%: median 131 ms [104-158], "
    "launches 157/103/147 ms (launches apart)",
    "sendrecv intra n=2 4 KiB": "+12%: median 0.3 ms [0.217-0.676], "
    "launches 0.295/0.218/0.453 ms (launches apart)",
    "sendrecv intra n=2 1 MiB": "-16%: median 1.3 ms [1.04-1.65], "
    "launches 1.27/1.22/1.41 ms (launches agree)",
    "sendrecv intra n=2 4 MiB": "-21%: median 4.27 ms [3.25-5.16], "
    "launches 4.69/3.6/4.51 ms (launches apart)",
    "sendrecv intra n=2 256 MiB": "+23%: median 159 ms [145-249], "
    "launches 163/144/249 ms (launches apart)",
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
