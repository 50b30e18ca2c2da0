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
# list is updated with it. This calibration (2026-12-02 13:37, with TP shards of the GPT's
# layers) ran on another VM than the ones before (its GEMMs 68 GFLOP/s), in a noisy spell:
# most misfits are rows whose launches disagree among themselves by more than 10 %.
KNOWN_KERNEL_MISFITS = {
    "mm 128x128x128": "+18%: median 0.0541 ms [0.0517-0.0569], "
    "launches 0.0569/0.0525/0.0519 ms (launches agree)",
    "bmm 64x128x128 x6": "+11%: median 0.169 ms [0.156-0.176], "
    "launches 0.17/0.173/0.153 ms (launches agree)",
    "mm 256x256x256": "+19%: median 0.416 ms [0.396-0.432], "
    "launches 0.43/0.399/0.399 ms (launches agree)",
    "bmm 128x128x64 x24": "+12%: median 0.66 ms [0.63-0.716], "
    "launches 0.593/0.671/0.694 ms (launches agree)",
    "mm 128x384x768": "+16%: median 0.955 ms [0.9-1.01], "
    "launches 0.837/0.955/1.01 ms (launches agree)",
    "mm 128x768x384": "+15%: median 0.965 ms [0.849-1.01], "
    "launches 0.8/0.993/0.988 ms (launches apart)",
    "mm 384x768x128": "+21%: median 0.919 ms [0.816-0.983], "
    "launches 0.808/0.969/0.94 ms (launches agree)",
    "bmm 64x128x128 x48": "-21%: median 1.88 ms [1.64-2.1], "
    "launches 1.28/2.01/2.08 ms (launches apart)",
    "bmm 128x64x128 x48": "-29%: median 2.07 ms [1.57-2.99], "
    "launches 1.51/3.06/2.07 ms (launches apart)",
    "bmm 128x128x64 x48": "-40%: median 2.47 ms [1.73-2.89], "
    "launches 1.6/2.93/2.49 ms (launches apart)",
    "mm 128x768x768": "+22%: median 1.81 ms [1.72-2.35], launches 1.7/1.8/2.48 ms (launches apart)",
    "mm 256x384x768": "+21%: median 1.83 ms [1.66-2.18], "
    "launches 1.59/1.83/2.31 ms (launches apart)",
    "mm 256x768x384": "+25%: median 1.78 ms [1.68-2.2], "
    "launches 1.66/1.74/2.32 ms (launches apart)",
    "mm 384x768x256": "+11%: median 2.01 ms [1.86-2.24], launches 1.78/2/2.31 ms (launches apart)",
    "mm 512x512x512": "+12%: median 3.51 ms [3.32-3.65], "
    "launches 3.38/3.44/3.71 ms (launches agree)",
    "mm 512x384x768": "+13%: median 3.93 ms [3.73-4.12], "
    "launches 3.87/3.64/4.09 ms (launches agree)",
    "mm 768x768x256": "+14%: median 3.88 ms [3.28-4.97], "
    "launches 3.22/3.88/5.19 ms (launches apart)",
    "mm 768x1536x128": "-20%: median 5.54 ms [3.77-6.57], "
    "launches 3.6/6.75/5.57 ms (launches apart)",
    "mm 1536x768x128": "-25%: median 5.92 ms [3.76-6.65], "
    "launches 3.59/6.56/5.94 ms (launches apart)",
    "mm 128x2304x768": "-14%: median 7.7 ms [5.71-8.45], "
    "launches 5.55/7.93/8.33 ms (launches apart)",
    "mm 768x2304x128": "-15%: median 7.78 ms [7.38-8.1], "
    "launches 7.67/7.26/7.99 ms (launches agree)",
    "mm 128x3072x768": "-28%: median 12.4 ms [9.06-13.5], "
    "launches 8.6/12.9/13.8 ms (launches apart)",
    "mm 768x1536x256": "-12%: median 10.1 ms [9.51-11.3], "
    "launches 9.66/12/9.73 ms (launches apart)",
    "mm 768x3072x128": "-14%: median 10.3 ms [9.74-11.1], "
    "launches 9.81/11.4/10.1 ms (launches agree)",
    "mm 3072x768x128": "-12%: median 10.1 ms [8.44-10.9], "
    "launches 7.32/10.9/10.4 ms (launches apart)",
    "mm 128x4096x768": "-25%: median 15.7 ms [12.4-16.8], "
    "launches 11.5/16.7/16.2 ms (launches apart)",
    "mm 768x4096x128": "-19%: median 14.6 ms [12.8-15.5], "
    "launches 12.6/14.6/15.7 ms (launches apart)",
    "mm 768x2304x256": "-11%: median 15 ms [14-15.7], launches 12.5/15.5/15.3 ms (launches apart)",
    "mm 256x3072x768": "-14%: median 20.6 ms [18.4-22.4], "
    "launches 17.5/20.8/23.2 ms (launches apart)",
    "mm 768x3072x256": "-12%: median 20.3 ms [19.1-21.8], "
    "launches 17.9/20.2/21.8 ms (launches agree)",
    "mm 1536x768x512": "-11%: median 19.9 ms [18.6-21.4], "
    "launches 19.2/19.8/21.7 ms (launches agree)",
    "mm 3072x768x256": "-14%: median 20.6 ms [18.3-23.4], "
    "launches 18.3/20.7/23 ms (launches apart)",
    "mm 128x8192x768": "-26%: median 32.2 ms [26.2-35.2], "
    "launches 24.8/33.8/35.8 ms (launches apart)",
    "mm 768x4096x256": "-16%: median 28 ms [25.9-29.3], launches 23/29.1/28.3 ms (launches apart)",
    "mm 768x8192x128": "-22%: median 30.3 ms [25.2-32.6], "
    "launches 24.1/30.8/32 ms (launches apart)",
    "mm 512x2304x768": "-10%: median 29.6 ms [27.8-31.3], "
    "launches 26/31.2/29.5 ms (launches agree)",
    "mm 512x768x3072": "+16%: median 30.6 ms [27.1-36.5], "
    "launches 26.8/31/39.1 ms (launches apart)",
    "mm 256x8192x768": "-18%: median 57.5 ms [53.9-59.9], "
    "launches 58.4/56.3/57.7 ms (launches agree)",
    "mm 768x8192x256": "-23%: median 61.3 ms [57.2-65.6], "
    "launches 63.7/56.4/66 ms (launches agree)",
    "mm 512x8192x768": "-14%: median 110 ms [99.6-156], launches 159/111/98.5 ms (launches apart)",
    "mm 768x8192x512": "-11%: median 106 ms [102-111], launches 112/102/106 ms (launches agree)",
    "mm 2048x2048x2048": "-10%: median 280 ms [256-287], launches 274/255/287 ms (launches agree)",
    "add 192 MiB": "+10%: median 13.1 ms [12.5-13.8], launches 12.7/13.5/13.3 ms (launches agree)",
    "add 768 MiB": "-12%: median 65.9 ms [55.5-75], launches 66.9/79.4/54.7 ms (launches apart)",
    "sdpa mb1 5.03e+07 FLOP": "+10%: median 0.985 ms [0.952-1.04], "
    "launches 0.986/0.977/1 ms (launches agree)",
    "memcpy 128 MiB": "+15%: median 14.5 ms [13.2-17.4], "
    "launches 17.6/13.3/14.2 ms (launches apart)",
    "memcpy 256 MiB": "-18%: median 41 ms [38.6-43.3], launches 39.6/40.4/42.9 ms (launches agree)",
    "adamw 8388608 params": "+14%: median 28.2 ms [26.8-30.8], "
    "launches 30.4/27.1/27.3 ms (launches agree)",
    "adamw 33554432 params": "-10%: median 144 ms [119-156], "
    "launches 144/157/115 ms (launches apart)",
}
# zsim's gloo model (half-duplex rank stacks, one latency per ring step, a cost per message, the
# ranks' copies and sums, all_gather's flat output faulted in above a thread arena's 64 MiB heap,
# each op's own CPU per byte it moves and per call, send/recv's own call latency) against this
# host's loopback TCP. Model vs median, [quartiles], the median of each of the 3 launches, and
# whether one time is within 10% of every launch's median. Small calls are bimodal (a ~4 ms
# stall in a quarter to half of them, which follows the host's scheduling of this VM:
# calibration_repeat.md), and whole launches sit in the slow mode or not.
KNOWN_COLLECTIVE_MISFITS = {
    "all_gather_into_tensor intra n=2 256 KiB": "+19%: median 0.616 ms [0.512-0.883], "
    "launches 0.63/0.53/0.665 ms (launches apart)",
    "reduce_scatter_tensor intra n=2 8 B": "+13%: median 0.626 ms [0.457-1.77], "
    "launches 0.781/0.447/1.06 ms (launches apart)",
    "reduce_scatter_tensor intra n=2 1 KiB": "-20%: median 1.21 ms [0.738-3.15], "
    "launches 1.18/1.2/1.25 ms (launches agree)",
    "reduce_scatter_tensor intra n=2 4 KiB": "-14%: median 1.14 ms [0.63-3.26], "
    "launches 1.41/0.592/2.31 ms (launches apart)",
    "reduce_scatter_tensor intra n=2 64 KiB": "+13%: median 0.933 ms [0.65-2.7], "
    "launches 1.05/0.689/1.43 ms (launches apart)",
    "reduce_scatter_tensor intra n=2 256 KiB": "-14%: median 1.53 ms [0.97-3.3], "
    "launches 2.44/1.02/1.2 ms (launches apart)",
    "reduce_scatter_tensor intra n=2 1 MiB": "-18%: median 2.84 ms [1.86-4.24], "
    "launches 3.41/2.39/2.64 ms (launches apart)",
    "reduce_scatter_tensor intra n=2 256 MiB": "+11%: median 344 ms [328-1.15e+03], "
    "launches 344/328/397 ms (launches agree)",
    "all_reduce intra n=2 8 B": "+36%: median 0.386 ms [0.311-0.577], "
    "launches 0.313/0.362/0.607 ms (launches apart)",
    "all_reduce intra n=2 1 KiB": "+24%: median 0.637 ms [0.517-1.39], "
    "launches 0.557/0.676/0.701 ms (launches apart)",
    "all_reduce intra n=2 4 KiB": "-14%: median 0.916 ms [0.547-3.11], "
    "launches 0.741/0.657/2.05 ms (launches apart)",
    "all_reduce intra n=2 64 KiB": "-52%: median 1.75 ms [0.661-3.95], "
    "launches 0.897/0.788/3.49 ms (launches apart)",
    "all_reduce intra n=2 256 KiB": "-42%: median 1.77 ms [0.774-3.72], "
    "launches 1.45/2.39/1.36 ms (launches apart)",
    "all_reduce intra n=2 4 MiB": "-13%: median 5.25 ms [3.98-7.01], "
    "launches 4.27/6.38/5.5 ms (launches apart)",
    "all_reduce intra n=2 64 MiB": "+13%: median 60.8 ms [55.9-67.9], "
    "launches 57.5/61.1/94.5 ms (launches apart)",
    "all_reduce intra n=2 256 MiB": "+14%: median 240 ms [221-303], "
    "launches 230/237/453 ms (launches apart)",
    "broadcast intra n=2 8 B": "-14%: median 0.376 ms [0.307-0.685], "
    "launches 0.339/0.372/0.85 ms (launches apart)",
    "broadcast intra n=2 64 KiB": "-11%: median 0.394 ms [0.309-0.974], "
    "launches 0.338/0.335/1.88 ms (launches apart)",
    "broadcast intra n=2 64 MiB": "+15%: median 24.5 ms [21.6-32.1], "
    "launches 23.3/25.8/89.2 ms (launches apart)",
    "sendrecv intra n=2 8 B": "-15%: median 0.433 ms [0.308-1.02], "
    "launches 0.309/0.413/1.01 ms (launches apart)",
    "sendrecv intra n=2 1 KiB": "-10%: median 0.412 ms [0.267-0.955], "
    "launches 0.268/0.447/0.842 ms (launches apart)",
    "sendrecv intra n=2 16 KiB": "+19%: median 0.321 ms [0.245-0.552], "
    "launches 0.269/0.421/0.373 ms (launches apart)",
    "sendrecv intra n=2 64 KiB": "+11%: median 0.381 ms [0.311-0.56], "
    "launches 0.381/0.398/0.364 ms (launches agree)",
    "sendrecv intra n=2 1 MiB": "-18%: median 1.56 ms [0.999-2.98], "
    "launches 1.11/1.18/2.33 ms (launches apart)",
    "sendrecv intra n=2 64 MiB": "+10%: median 52.6 ms [46-81.9], "
    "launches 45.6/52.2/124 ms (launches apart)",
    "sendrecv intra n=2 256 MiB": "+11%: median 209 ms [194-239], "
    "launches 186/216/396 ms (launches apart)",
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
