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
# list is updated with it (`python -m tests.misfits` prints it). This calibration (2026-12-03
# 19:09, with the accumulating backward's rows) ran in a slow, noisy spell of the VM: most
# misfits are rows whose launches disagree among themselves by more than 10 %.
KNOWN_KERNEL_MISFITS = {
    "mm 64x64x64": "-16%: median 0.014 ms [0.0133-0.016], "
    "launches 0.0141/0.0134/0.014 ms (launches agree)",
    "bmm 128x128x64 x6": "-35%: median 0.304 ms [0.216-0.341], "
    "launches 0.21/0.323/0.419 ms (launches apart)",
    "bmm 64x128x128 x12": "-12%: median 0.447 ms [0.41-0.725], "
    "launches 0.424/0.422/0.804 ms (launches apart)",
    "bmm 128x64x128 x12": "-11%: median 0.44 ms [0.412-0.608], "
    "launches 0.426/0.414/0.756 ms (launches apart)",
    "bmm 128x128x64 x24": "-38%: median 1.26 ms [0.685-1.39], "
    "launches 1.32/0.666/1.54 ms (launches apart)",
    "mm 128x384x768": "+19%: median 0.985 ms [0.943-1.72], "
    "launches 0.97/0.945/1.98 ms (launches apart)",
    "mm 128x768x384": "+19%: median 0.985 ms [0.934-1.9], "
    "launches 0.972/0.931/1.97 ms (launches apart)",
    "mm 384x768x128": "+11%: median 1.05 ms [0.926-1.44], "
    "launches 1.05/0.919/1.82 ms (launches apart)",
    "bmm 64x128x128 x48": "-33%: median 2.33 ms [1.9-3.36], "
    "launches 2.33/1.72/3.59 ms (launches apart)",
    "bmm 128x64x128 x48": "-33%: median 2.32 ms [1.88-3.06], "
    "launches 2.32/1.8/3.43 ms (launches apart)",
    "bmm 128x128x64 x48": "-32%: median 2.28 ms [2.16-2.71], "
    "launches 2.23/2.16/3.02 ms (launches apart)",
    "mm 128x1536x768": "-11%: median 5.28 ms [4.86-5.93], "
    "launches 4.94/5.95/5.28 ms (launches agree)",
    "mm 512x384x768": "+13%: median 4.16 ms [3.82-4.62], "
    "launches 3.72/4.65/4.1 ms (launches apart)",
    "mm 768x768x256": "-13%: median 5.41 ms [4.73-7.13], "
    "launches 7.24/4.55/5.29 ms (launches apart)",
    "mm 128x2304x768": "-16%: median 8.33 ms [6.78-10.2], "
    "launches 6.67/11.3/8.37 ms (launches apart)",
    "mm 256x768x1152": "+17%: median 6 ms [5.7-7.38], launches 5.85/5.65/7.44 ms (launches apart)",
    "mm 768x1152x256": "+12%: median 6.25 ms [5.72-7.51], "
    "launches 6.09/5.69/7.58 ms (launches apart)",
    "mm 768x768x512": "+13%: median 8.3 ms [7.56-9.69], launches 7.8/7.49/9.73 ms (launches apart)",
    "mm 1536x768x256": "+11%: median 8.45 ms [7.9-11.9], "
    "launches 7.96/8.36/12.8 ms (launches apart)",
    "mm 3072x768x128": "+12%: median 8.34 ms [8.05-15.3], "
    "launches 8.04/8.19/15.6 ms (launches apart)",
    "mm 128x4096x768": "-23%: median 16.2 ms [13-17.5], "
    "launches 12.4/16.4/17.8 ms (launches apart)",
    "mm 768x1152x512": "+15%: median 12.2 ms [11.8-14.2], "
    "launches 12.1/12/14.3 ms (launches agree)",
    "mm 512x768x1536": "+20%: median 15.5 ms [15.1-18.7], "
    "launches 15.3/19/15.4 ms (launches apart)",
    "mm 512x1536x768": "+18%: median 15.8 ms [15.5-16.9], "
    "launches 15.8/15.7/19.2 ms (launches apart)",
    "mm 768x1536x512": "+15%: median 16.2 ms [15.6-18.2], "
    "launches 15.8/15.7/19.2 ms (launches apart)",
    "mm 1536x768x512": "+14%: median 16.5 ms [15.6-19.4], "
    "launches 15.9/16/19.7 ms (launches apart)",
    "mm 128x768x8192": "+10%: median 22.7 ms [22.1-24], launches 22.5/24/22.5 ms (launches agree)",
    "mm 128x8192x768": "-25%: median 33.5 ms [29.7-36.7], "
    "launches 29.1/40.3/34 ms (launches apart)",
    "mm 512x768x2304": "+10%: median 25.5 ms [22.9-26.7], "
    "launches 25.5/22.5/26.6 ms (launches agree)",
    "mm 512x768x3072": "+15%: median 32.5 ms [30.6-35.8], "
    "launches 35.9/31.7/31.3 ms (launches agree)",
    "mm 3072x768x512": "-11%: median 42.1 ms [37.2-47.3], "
    "launches 37.4/46.3/46.7 ms (launches apart)",
    "mm 256x8192x768": "-19%: median 61.9 ms [57.6-66.5], "
    "launches 62.1/60.7/88.3 ms (launches apart)",
    "mm 512x768x4096": "+17%: median 42.5 ms [40.7-47.8], "
    "launches 40.3/42.5/47.1 ms (launches agree)",
    "mm 768x8192x256": "-27%: median 68.6 ms [52.7-82.8], "
    "launches 84.8/51.5/70 ms (launches apart)",
    "mm 512x8192x768": "-18%: median 121 ms [111-128], launches 155/123/111 ms (launches apart)",
    "adamw 16777216 params": "-14%: median 104 ms [76.5-108], "
    "launches 73.7/108/106 ms (launches apart)",
}
# zsim's gloo model (half-duplex rank stacks, one latency per ring step, a cost per message, the
# ranks' copies and sums, all_gather's flat output faulted in above a thread arena's 64 MiB heap,
# each op's own CPU per byte it moves and per call, send/recv's own call latency) against this
# host's loopback TCP. Model vs median, [quartiles], the median of each of the 3 launches, and
# whether one time is within 10% of every launch's median. Small calls are bimodal (a ~4 ms
# stall in a quarter to half of them, which follows the host's scheduling of this VM:
# calibration_repeat.md), and whole launches sit in the slow mode or not.
KNOWN_COLLECTIVE_MISFITS = {
    "all_gather_into_tensor intra n=2 1 MiB": "+12%: median 1.19 ms [0.96-3.23], "
    "launches 1.39/1.21/0.994 ms (launches apart)",
    "reduce_scatter_tensor intra n=2 1 KiB": "-16%: median 1.1 ms [0.739-3.78], "
    "launches 0.784/1.22/3.37 ms (launches apart)",
    "reduce_scatter_tensor intra n=2 4 KiB": "+12%: median 0.834 ms [0.622-3.23], "
    "launches 0.633/0.981/1.28 ms (launches apart)",
    "reduce_scatter_tensor intra n=2 1 MiB": "-13%: median 2.46 ms [1.72-4.36], "
    "launches 1.92/3.05/2.81 ms (launches apart)",
    "reduce_scatter_tensor intra n=2 64 MiB": "+12%: median 78.6 ms [71.6-91.7], "
    "launches 69.8/81.8/91.8 ms (launches apart)",
    "all_reduce intra n=2 1 KiB": "-15%: median 1 ms [0.595-3.29], "
    "launches 0.67/0.711/2.17 ms (launches apart)",
    "all_reduce intra n=2 4 MiB": "-17%: median 4.33 ms [3.33-6.03], "
    "launches 4.32/4.31/4.5 ms (launches agree)",
    "all_reduce intra n=2 256 MiB": "+11%: median 194 ms [185-217], "
    "launches 190/201/188 ms (launches agree)",
    "broadcast intra n=2 8 B": "-18%: median 0.344 ms [0.278-0.438], "
    "launches 0.381/0.336/0.312 ms (launches agree)",
    "broadcast intra n=2 4 KiB": "+14%: median 0.247 ms [0.217-0.301], "
    "launches 0.287/0.245/0.226 ms (launches apart)",
    "sendrecv intra n=2 1 MiB": "+12%: median 0.794 ms [0.699-0.919], "
    "launches 0.74/0.853/0.75 ms (launches agree)",
    "sendrecv intra n=2 4 MiB": "-10%: median 3.02 ms [2.22-3.64], "
    "launches 2.04/3.56/2.72 ms (launches apart)",
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
