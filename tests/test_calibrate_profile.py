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
# list is updated with it. This calibration (2026-11-29 17:17) is the first with the allocator's
# top pad (zsim/validate/procs.py) and with each worker launch recorded. It ran in a noisier
# spell than the four before: its kernel medians lie 1.5-2.0% from theirs (median), where
# those lay 0.7-0.9% from one another.
KNOWN_KERNEL_MISFITS = {
    "add 192 MiB": "+18%: median 7.11 ms [6.76-10.6], launches 10.8/7.1/6.63 ms (launches apart)",
    "add 768 MiB": "-32%: median 49.1 ms [46.5-51.9], launches 52.2/49.2/46.2 ms (launches agree)",
    "adamw 33554432 params": "-25%: median 109 ms [105-113], "
    "launches 110/76.5/113 ms (launches apart)",
}
# zsim's gloo model (half-duplex rank stacks, one latency per ring step, a cost per message, the
# ranks' copies and sums, all_gather's flat output faulted in above a thread arena's 64 MiB heap,
# each op's own CPU per byte it moves and per call, send/recv's own call latency) against this
# host's loopback TCP. Model vs median, [quartiles], the median of each of the 3 launches, and
# whether one time is within 10% of every launch's median. Small calls are bimodal (a ~4 ms
# stall in a quarter to half of them, which follows the host's scheduling of this VM:
# calibration_repeat.md), and whole launches sit in the slow mode or not.
KNOWN_COLLECTIVE_MISFITS = {
    "all_gather_into_tensor intra n=2 256 KiB": "-13%: median 0.575 ms [0.374-1.3], "
    "launches 0.366/0.746/0.447 ms (launches apart)",
    "reduce_scatter_tensor intra n=2 8 B": "-14%: median 0.397 ms [0.324-0.486], "
    "launches 0.397/0.373/0.444 ms (launches agree)",
    "reduce_scatter_tensor intra n=2 4 MiB": "-10%: median 4.16 ms [3.47-5.46], "
    "launches 3.84/4.39/4.29 ms (launches agree)",
    "all_reduce intra n=2 8 B": "+27%: median 0.267 ms [0.234-0.319], "
    "launches 0.257/0.277/0.276 ms (launches agree)",
    "all_reduce intra n=2 4 KiB": "+17%: median 0.431 ms [0.36-3.36], "
    "launches 0.412/0.404/0.515 ms (launches apart)",
    "all_reduce intra n=2 16 KiB": "-74%: median 1.95 ms [0.391-3.82], "
    "launches 0.461/3.12/0.499 ms (launches apart)",
    "all_reduce intra n=2 64 KiB": "-16%: median 0.642 ms [0.439-3.71], "
    "launches 1.24/0.524/1.42 ms (launches apart)",
    "all_reduce intra n=2 256 KiB": "-34%: median 1.01 ms [0.496-3.75], "
    "launches 2.41/0.565/1.04 ms (launches apart)",
    "all_reduce intra n=2 1 MiB": "-23%: median 1.52 ms [0.713-3.6], "
    "launches 0.711/0.861/3.46 ms (launches apart)",
    "all_reduce intra n=2 4 MiB": "-25%: median 4.22 ms [2.74-5.57], "
    "launches 2.41/4.29/5.44 ms (launches apart)",
    "all_reduce intra n=2 64 MiB": "+18%: median 41 ms [38-44], "
    "launches 41.4/41.6/39.8 ms (launches agree)",
    "all_reduce intra n=2 256 MiB": "+18%: median 163 ms [151-169], "
    "launches 161/157/171 ms (launches agree)",
    "broadcast intra n=2 8 B": "-11%: median 0.246 ms [0.202-0.297], "
    "launches 0.253/0.19/0.268 ms (launches apart)",
    "sendrecv intra n=2 16 KiB": "+19%: median 0.168 ms [0.149-0.227], "
    "launches 0.162/0.165/0.196 ms (launches agree)",
    "sendrecv intra n=2 1 MiB": "-28%: median 1.03 ms [0.799-1.1], "
    "launches 0.879/0.858/1.09 ms (launches apart)",
    "sendrecv intra n=2 4 MiB": "-20%: median 3 ms [2.27-3.82], "
    "launches 2.79/2.32/3.77 ms (launches apart)",
    "sendrecv intra n=2 64 MiB": "+10%: median 32.2 ms [29.5-34.3], "
    "launches 32.5/32.6/31.4 ms (launches agree)",
    "sendrecv intra n=2 256 MiB": "+18%: median 119 ms [115-123], "
    "launches 122/119/119 ms (launches agree)",
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
