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
# 20:14, the Intel host, fitted to the rows' means, nothing else running, just before the
# 1x2 validation).
KNOWN_KERNEL_MISFITS = {
    "bmm 128x64x128 x6": "-15%: mean 0.0984 ms (median 0.0971 [0.0895-0.105]), "
    "launches 0.092/0.111/0.0922 ms (launches agree)",
    "bmm 128x128x64 x6": "-11%: mean 0.0934 ms (median 0.0912 [0.0863-0.0964]), "
    "launches 0.0911/0.102/0.0874 ms (launches agree)",
    "bmm 128x64x128 x12": "-13%: mean 0.19 ms (median 0.185 [0.164-0.211]), "
    "launches 0.187/0.223/0.16 ms (launches apart)",
    "mm 256x256x256": "-14%: mean 0.255 ms (median 0.243 [0.225-0.261]), "
    "launches 0.232/0.269/0.263 ms (launches agree)",
    "bmm 64x128x128 x24": "-13%: mean 0.377 ms (median 0.361 [0.33-0.424]), "
    "launches 0.337/0.453/0.34 ms (launches apart)",
    "bmm 128x64x128 x24": "-14%: mean 0.382 ms (median 0.346 [0.33-0.444]), "
    "launches 0.317/0.472/0.355 ms (launches apart)",
    "bmm 128x128x64 x24": "-10%: mean 0.365 ms (median 0.349 [0.31-0.421]), "
    "launches 0.298/0.439/0.358 ms (launches apart)",
    "bmm 64x128x128 x48": "-19%: mean 0.808 ms (median 0.872 [0.655-0.916]), "
    "launches 0.732/0.784/0.909 ms (launches apart)",
    "bmm 128x64x128 x48": "-20%: mean 0.815 ms (median 0.758 [0.633-0.975]), "
    "launches 0.627/0.833/0.986 ms (launches apart)",
    "bmm 128x128x64 x48": "-13%: mean 0.751 ms (median 0.688 [0.623-0.92]), "
    "launches 0.608/0.693/0.952 ms (launches apart)",
    "mm 128x3072x768": "-25%: mean 5.2 ms (median 4.45 [4.13-6.66]), "
    "launches 4.1/6.81/4.68 ms (launches apart)",
    "mm 128x4096x768": "-52%: mean 10.8 ms (median 9.6 [9.17-13]), "
    "launches 9.07/13.3/9.94 ms (launches apart)",
    "mm 768x1536x512": "+12%: mean 7.01 ms (median 7.09 [6.05-7.34]), "
    "launches 6.08/7.85/7.1 ms (launches apart)",
    "mm 768x3072x256": "+12%: mean 6.97 ms (median 7.22 [6.11-7.34]), "
    "launches 6.02/7.4/7.49 ms (launches apart)",
    "mm 1536x768x512": "-19%: mean 9.68 ms (median 8.66 [6.77-9.23]), "
    "launches 6.48/13.5/9.07 ms (launches apart)",
    "mm 128x8192x768": "-51%: mean 21.4 ms (median 20.5 [19.6-22.9]), "
    "launches 19.7/23.5/20.9 ms (launches agree)",
    "mm 768x4096x256": "+16%: mean 8.97 ms (median 8.89 [8.58-9.2]), "
    "launches 8.64/9.46/8.8 ms (launches agree)",
    "mm 512x768x2304": "+13%: mean 10.4 ms (median 10.2 [9.72-10.9]), "
    "launches 9.94/10.2/11 ms (launches agree)",
    "mm 512x2304x768": "+19%: mean 9.83 ms (median 9.6 [9.13-10.4]), "
    "launches 9.02/9.72/10.8 ms (launches agree)",
    "mm 768x2304x512": "+13%: mean 10.4 ms (median 10.6 [9.23-10.9]), "
    "launches 9.45/10.6/11.2 ms (launches agree)",
    "mm 1024x1024x1024": "+13%: mean 12.3 ms (median 12.8 [10.6-13.5]), "
    "launches 10.4/12.9/13.7 ms (launches apart)",
    "mm 768x3072x512": "+19%: mean 13.2 ms (median 12.9 [11.9-14.6]), "
    "launches 11.7/12.9/14.8 ms (launches apart)",
    "mm 3072x768x512": "+21%: mean 12.9 ms (median 12 [11.3-15]), "
    "launches 11/12.5/15.1 ms (launches apart)",
    "mm 512x8192x768": "+11%: mean 37.5 ms (median 39 [32.9-40.9]), "
    "launches 32.4/39.9/41.7 ms (launches apart)",
    "add 768 B": "-12%: mean 0.00198 ms (median 0.00139 [0.00119-0.00301]), "
    "launches 0.00121/0.00154/0.00319 ms (launches apart)",
    "adamw 4194304 params": "+12%: mean 17.1 ms (median 12.1 [11.7-25.2]), "
    "launches 27.4/12/11.8 ms (launches apart)",
    "adamw 16777216 params": "-11%: mean 85.4 ms (median 78.2 [75.6-98.1]), "
    "launches 105/78.6/75.6 ms (launches apart)",
}
# zsim's gloo model (half-duplex rank stacks, one latency per ring step, a cost per message, the
# ranks' copies and sums, all_gather's flat output faulted in above a thread arena's 64 MiB heap,
# each op's own CPU per byte it moves and per call, send/recv's own call latency) against this
# host's loopback TCP. Model vs mean (median [quartiles]), the mean of each of the 3 launches,
# and whether one time is within 10% of every launch's mean. Small calls are bimodal (a ~4 ms
# stall in a quarter to half of them, which follows the host's scheduling of this VM:
# calibration_repeat.md), and whole launches sit in the slow mode or not.
KNOWN_COLLECTIVE_MISFITS = {
    "all_gather_into_tensor intra n=2 8 B": "-38%: mean 0.826 ms (median 0.194 [0.157-0.513]), "
    "launches 0.602/0.515/1.36 ms (launches apart)",
    "all_gather_into_tensor intra n=2 1 KiB": "-18%: mean 0.624 ms (median 0.194 [0.155-0.718]), "
    "launches 0.76/0.511/0.602 ms (launches apart)",
    "all_gather_into_tensor intra n=2 4 KiB": "-21%: mean 0.652 ms (median 0.22 [0.177-0.312]), "
    "launches 0.962/0.527/0.467 ms (launches apart)",
    "all_gather_into_tensor intra n=2 16 KiB": "+64%: mean 0.319 ms (median 0.196 [0.159-0.228]), "
    "launches 0.246/0.327/0.383 ms (launches apart)",
    "all_gather_into_tensor intra n=2 64 KiB": "-21%: mean 0.692 ms (median 0.227 [0.173-0.401]), "
    "launches 0.848/0.545/0.683 ms (launches apart)",
    "all_gather_into_tensor intra n=2 256 KiB": "+21%: mean 0.54 ms (median 0.31 [0.261-0.365]), "
    "launches 0.519/0.663/0.439 ms (launches apart)",
    "all_gather_into_tensor intra n=2 1 MiB": "-30%: mean 1.52 ms (median 0.832 [0.589-2.35]), "
    "launches 1.28/1.55/1.73 ms (launches apart)",
    "reduce_scatter_tensor intra n=2 8 B": "+25%: mean 0.741 ms (median 0.223 [0.135-0.406]), "
    "launches 0.758/0.689/0.775 ms (launches agree)",
    "reduce_scatter_tensor intra n=2 4 KiB": "-29%: mean 1.94 ms (median 1.1 [0.296-3.58]), "
    "launches 1.7/2.06/2.05 ms (launches agree)",
    "reduce_scatter_tensor intra n=2 64 KiB": "-15%: mean 1.67 ms (median 0.484 [0.279-3.25]), "
    "launches 2.16/1.62/1.24 ms (launches apart)",
    "reduce_scatter_tensor intra n=2 256 KiB": "-13%: mean 1.82 ms (median 0.676 [0.386-3.69]), "
    "launches 1.75/2.17/1.54 ms (launches apart)",
    "reduce_scatter_tensor intra n=2 64 MiB": "+11%: mean 60.1 ms (median 58.2 [53.4-65.6]), "
    "launches 72/57.6/53.8 ms (launches apart)",
    "reduce_scatter_tensor intra n=2 256 MiB": "+11%: mean 239 ms (median 236 [207-269]), "
    "launches 263/248/218 ms (launches agree)",
    "all_reduce intra n=2 8 B": "+13%: mean 0.458 ms (median 0.111 [0.0904-0.173]), "
    "launches 0.826/0.126/0.422 ms (launches apart)",
    "all_reduce intra n=2 1 KiB": "-43%: mean 1.7 ms (median 0.93 [0.171-3.55]), "
    "launches 2.3/1.35/1.45 ms (launches apart)",
    "all_reduce intra n=2 4 KiB": "-42%: mean 1.67 ms (median 0.652 [0.169-3.6]), "
    "launches 2.08/2.21/0.735 ms (launches apart)",
    "all_reduce intra n=2 16 KiB": "-39%: mean 1.59 ms (median 0.776 [0.186-2.97]), "
    "launches 1.34/1.87/1.57 ms (launches apart)",
    "all_reduce intra n=2 64 KiB": "-32%: mean 1.46 ms (median 0.443 [0.194-2.75]), "
    "launches 1.83/1.47/1.09 ms (launches apart)",
    "all_reduce intra n=2 256 KiB": "-40%: mean 1.82 ms (median 0.407 [0.269-3.53]), "
    "launches 2.57/1.84/1.06 ms (launches apart)",
    "all_reduce intra n=2 1 MiB": "-16%: mean 1.75 ms (median 0.623 [0.508-2.78]), "
    "launches 2.06/2.21/0.969 ms (launches apart)",
    "all_reduce intra n=2 16 MiB": "+38%: mean 8.59 ms (median 8.61 [6.88-9.93]), "
    "launches 8.22/9.41/8.14 ms (launches agree)",
    "all_reduce intra n=2 64 MiB": "+40%: mean 33.9 ms (median 33.6 [29.8-37.5]), "
    "launches 34.8/34.8/32.5 ms (launches agree)",
    "all_reduce intra n=2 256 MiB": "+32%: mean 144 ms (median 139 [127-160]), "
    "launches 158/145/129 ms (launches apart)",
    "broadcast intra n=2 1 KiB": "-10%: mean 0.2 ms (median 0.086 [0.0744-0.0979]), "
    "launches 0.167/0.201/0.23 ms (launches apart)",
    "broadcast intra n=2 16 KiB": "-18%: mean 0.223 ms (median 0.0831 [0.0626-0.121]), "
    "launches 0.0977/0.272/0.299 ms (launches apart)",
    "broadcast intra n=2 256 KiB": "+24%: mean 0.186 ms (median 0.136 [0.116-0.149]), "
    "launches 0.165/0.184/0.208 ms (launches apart)",
    "sendrecv intra n=2 8 B": "-56%: mean 0.259 ms (median 0.0815 [0.0748-0.098]), "
    "launches 0.279/0.219/0.281 ms (launches apart)",
    "sendrecv intra n=2 1 KiB": "-64%: mean 0.32 ms (median 0.0811 [0.0701-0.111]), "
    "launches 0.143/0.523/0.295 ms (launches apart)",
    "sendrecv intra n=2 4 KiB": "-65%: mean 0.327 ms (median 0.0753 [0.0666-0.0932]), "
    "launches 0.0789/0.761/0.14 ms (launches apart)",
    "sendrecv intra n=2 16 KiB": "+40%: mean 0.0861 ms (median 0.0738 [0.0697-0.0784]), "
    "launches 0.106/0.0822/0.07 ms (launches apart)",
    "sendrecv intra n=2 64 KiB": "+51%: mean 0.0931 ms (median 0.0919 [0.0858-0.0965]), "
    "launches 0.103/0.0942/0.0818 ms (launches apart)",
    "sendrecv intra n=2 256 KiB": "-39%: mean 0.36 ms (median 0.138 [0.132-0.162]), "
    "launches 0.148/0.136/0.797 ms (launches apart)",
    "sendrecv intra n=2 1 MiB": "-11%: mean 0.606 ms (median 0.415 [0.376-0.455]), "
    "launches 0.776/0.419/0.622 ms (launches apart)",
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
