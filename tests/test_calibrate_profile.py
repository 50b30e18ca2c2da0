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
# list is updated with it (`python -m tests.misfits` prints it). This calibration (2026-12-06
# 06:34, the Intel host, fitted to the rows' means, nothing else running, just before the
# 1x2 validation).
KNOWN_KERNEL_MISFITS = {
    "mm 128x768x384": "+11%: mean 0.344 ms (median 0.337 [0.316-0.373]), "
    "launches 0.319/0.381/0.331 ms (launches agree)",
    "mm 128x768x768": "+10%: mean 0.691 ms (median 0.675 [0.642-0.748]), "
    "launches 0.644/0.76/0.67 ms (launches agree)",
    "mm 128x3072x768": "-26%: mean 4.13 ms (median 3.8 [3.66-4.8]), "
    "launches 3.76/4.92/3.71 ms (launches apart)",
    "mm 128x4096x768": "-52%: mean 8.39 ms (median 8.18 [7.92-8.89]), "
    "launches 7.86/8.97/8.34 ms (launches agree)",
    "mm 128x8192x768": "-57%: mean 18.8 ms (median 19.4 [16-20.4]), "
    "launches 20.4/20/15.9 ms (launches apart)",
    "memcpy 64 MiB": "+28%: mean 6.46 ms (median 6.16 [5.7-6.96]), "
    "launches 7.37/6.36/5.66 ms (launches apart)",
    "memcpy 128 MiB": "-20%: mean 20.7 ms (median 20.4 [19.5-21.7]), "
    "launches 22.1/20.2/19.9 ms (launches agree)",
    "memcpy 256 MiB": "-26%: mean 44.8 ms (median 44.5 [43.1-46.3]), "
    "launches 47.2/43.9/43.4 ms (launches agree)",
    "adamw 4194304 params": "+36%: mean 9.34 ms (median 9.28 [8.62-9.87]), "
    "launches 10.2/9.32/8.46 ms (launches agree)",
    "adamw 8388608 params": "-10%: mean 28.4 ms (median 28.2 [26.8-29.7]), "
    "launches 30.9/28.4/26.4 ms (launches agree)",
    "adamw 16777216 params": "-27%: mean 69.8 ms (median 69.4 [66.6-72.6]), "
    "launches 74.7/68.7/66.1 ms (launches agree)",
    "adamw 33554432 params": "-29%: mean 144 ms (median 142 [139-150]), "
    "launches 153/141/139 ms (launches agree)",
}
# zsim's gloo model (half-duplex rank stacks, one latency per ring step, a cost per message, the
# ranks' copies and sums, all_gather's flat output faulted in above a thread arena's 64 MiB heap,
# each op's own CPU per byte it moves and per call, send/recv's own call latency) against this
# host's loopback TCP. Model vs mean (median [quartiles]), the mean of each of the 3 launches,
# and whether one time is within 10% of every launch's mean. Small calls are bimodal (a ~4 ms
# stall in a quarter to half of them, which follows the host's scheduling of this VM:
# calibration_repeat.md), and whole launches sit in the slow mode or not.
KNOWN_COLLECTIVE_MISFITS = {
    "all_gather_into_tensor intra n=2 256 KiB": "+16%: mean 0.562 ms (median 0.207 [0.186-0.255]), "
    "launches 0.823/0.503/0.359 ms (launches apart)",
    "all_gather_into_tensor intra n=2 1 MiB": "-43%: mean 1.64 ms (median 0.584 [0.4-3.35]), "
    "launches 1.65/1.79/1.47 ms (launches apart)",
    "all_gather_into_tensor intra n=2 4 MiB": "-12%: mean 2.32 ms (median 1.56 [1.25-3.6]), "
    "launches 2.46/2.37/2.12 ms (launches agree)",
    "all_gather_into_tensor intra n=2 16 MiB": "+14%: mean 5.7 ms (median 5.34 [4.22-6.85]), "
    "launches 6.6/5.14/5.35 ms (launches apart)",
    "reduce_scatter_tensor intra n=2 8 B": "+48%: mean 0.466 ms (median 0.138 [0.0908-0.402]), "
    "launches 0.457/0.558/0.382 ms (launches apart)",
    "reduce_scatter_tensor intra n=2 1 KiB": "-26%: mean 1.47 ms (median 1.21 [0.312-2.28]), "
    "launches 1.31/1.58/1.53 ms (launches agree)",
    "reduce_scatter_tensor intra n=2 4 KiB": "-31%: mean 1.59 ms (median 1.06 [0.217-2.46]), "
    "launches 1.45/1.8/1.52 ms (launches apart)",
    "reduce_scatter_tensor intra n=2 16 KiB": "-30%: mean 1.58 ms (median 0.754 [0.196-2.77]), "
    "launches 1.42/1.21/2.1 ms (launches apart)",
    "reduce_scatter_tensor intra n=2 64 KiB": "-38%: mean 1.82 ms (median 1.03 [0.246-3.59]), "
    "launches 2.16/1.81/1.5 ms (launches apart)",
    "reduce_scatter_tensor intra n=2 256 KiB": "-27%: mean 1.72 ms (median 0.611 [0.321-3.34]), "
    "launches 1.46/1.85/1.86 ms (launches apart)",
    "reduce_scatter_tensor intra n=2 1 MiB": "-22%: mean 2.23 ms (median 1.27 [0.767-3.7]), "
    "launches 2.04/2.04/2.62 ms (launches apart)",
    "reduce_scatter_tensor intra n=2 16 MiB": "+13%: mean 12.2 ms (median 11.9 [10.5-13.8]), "
    "launches 13.8/11.7/11.1 ms (launches apart)",
    "all_reduce intra n=2 8 B": "+62%: mean 0.256 ms (median 0.0856 [0.0749-0.107]), "
    "launches 0.12/0.47/0.177 ms (launches apart)",
    "all_reduce intra n=2 1 KiB": "-34%: mean 1.24 ms (median 0.257 [0.14-2.02]), "
    "launches 1.08/1.01/1.63 ms (launches apart)",
    "all_reduce intra n=2 4 KiB": "-43%: mean 1.45 ms (median 0.357 [0.174-2.59]), "
    "launches 0.759/1.45/2.15 ms (launches apart)",
    "all_reduce intra n=2 16 KiB": "-55%: mean 1.85 ms (median 1.56 [0.194-3.59]), "
    "launches 2.16/1.7/1.68 ms (launches apart)",
    "all_reduce intra n=2 64 KiB": "-50%: mean 1.7 ms (median 0.574 [0.181-3.55]), "
    "launches 1.96/1.55/1.59 ms (launches apart)",
    "all_reduce intra n=2 256 KiB": "-41%: mean 1.54 ms (median 0.372 [0.24-3.03]), "
    "launches 1.23/1.47/1.92 ms (launches apart)",
    "all_reduce intra n=2 1 MiB": "-34%: mean 1.82 ms (median 0.564 [0.446-2.99]), "
    "launches 1.63/2.03/1.8 ms (launches apart)",
    "all_reduce intra n=2 4 MiB": "-21%: mean 2.93 ms (median 2.74 [1.54-3.91]), "
    "launches 2.85/3.05/2.88 ms (launches agree)",
    "all_reduce intra n=2 16 MiB": "+22%: mean 7.59 ms (median 7.3 [6-9.04]), "
    "launches 7.66/7.76/7.33 ms (launches agree)",
    "all_reduce intra n=2 64 MiB": "+37%: mean 27.1 ms (median 26.1 [23.2-30]), "
    "launches 33.9/24.6/24.6 ms (launches apart)",
    "all_reduce intra n=2 256 MiB": "+15%: mean 129 ms (median 131 [121-137]), "
    "launches 138/123/128 ms (launches agree)",
    "broadcast intra n=2 1 KiB": "+51%: mean 0.0695 ms (median 0.0686 [0.0628-0.0744]), "
    "launches 0.0639/0.0668/0.078 ms (launches agree)",
    "broadcast intra n=2 4 KiB": "+30%: mean 0.081 ms (median 0.0697 [0.0626-0.0774]), "
    "launches 0.079/0.068/0.0962 ms (launches apart)",
    "broadcast intra n=2 16 KiB": "-46%: mean 0.201 ms (median 0.0697 [0.0597-0.0839]), "
    "launches 0.269/0.0683/0.265 ms (launches apart)",
    "broadcast intra n=2 64 KiB": "-43%: mean 0.206 ms (median 0.0719 [0.0632-0.0856]), "
    "launches 0.241/0.109/0.268 ms (launches apart)",
    "broadcast intra n=2 256 KiB": "-45%: mean 0.28 ms (median 0.103 [0.0911-0.127]), "
    "launches 0.279/0.326/0.236 ms (launches apart)",
    "broadcast intra n=2 1 MiB": "-35%: mean 0.456 ms (median 0.234 [0.205-0.263]), "
    "launches 0.263/0.395/0.709 ms (launches apart)",
    "broadcast intra n=2 16 MiB": "+12%: mean 2.85 ms (median 2.75 [2.52-2.91]), "
    "launches 2.84/2.87/2.84 ms (launches agree)",
    "broadcast intra n=2 64 MiB": "+17%: mean 10.6 ms (median 10.2 [9.92-11]), "
    "launches 11.3/10.3/10.3 ms (launches agree)",
    "sendrecv intra n=2 1 KiB": "-17%: mean 0.489 ms (median 0.0689 [0.0554-0.852]), "
    "launches 0.514/0.571/0.384 ms (launches apart)",
    "sendrecv intra n=2 16 KiB": "+16%: mean 0.353 ms (median 0.065 [0.0595-0.0743]), "
    "launches 0.413/0.584/0.0626 ms (launches apart)",
    "sendrecv intra n=2 256 KiB": "+14%: mean 0.427 ms (median 0.111 [0.0968-0.148]), "
    "launches 0.66/0.288/0.335 ms (launches apart)",
    "sendrecv intra n=2 4 MiB": "+10%: mean 1.56 ms (median 1.26 [0.999-1.63]), "
    "launches 1.75/1.7/1.24 ms (launches apart)",
    "sendrecv intra n=2 16 MiB": "+12%: mean 5.07 ms (median 4.76 [4.43-5.22]), "
    "launches 5.22/5.03/4.96 ms (launches agree)",
    "sendrecv intra n=2 256 MiB": "-17%: mean 102 ms (median 102 [99.3-105]), "
    "launches 106/98.8/102 ms (launches agree)",
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
