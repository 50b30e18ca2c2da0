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
# 20:44, the Intel host, fitted to the rows' means, nothing else running, just before the
# 1x2 validation).
KNOWN_KERNEL_MISFITS = {
    "bmm 64x128x128 x6": "+14%: mean 0.0926 ms (median 0.0894 [0.077-0.108]), "
    "launches 0.112/0.0902/0.0758 ms (launches apart)",
    "mm 256x256x256": "+11%: mean 0.251 ms (median 0.26 [0.22-0.273]), "
    "launches 0.266/0.224/0.262 ms (launches agree)",
    "bmm 128x64x128 x24": "-28%: mean 0.573 ms (median 0.471 [0.419-0.87]), "
    "launches 0.479/0.413/0.827 ms (launches apart)",
    "bmm 128x128x64 x24": "-20%: mean 0.519 ms (median 0.43 [0.39-0.776]), "
    "launches 0.434/0.383/0.741 ms (launches apart)",
    "mm 128x768x384": "-10%: mean 0.692 ms (median 0.564 [0.531-1.01]), "
    "launches 0.567/0.52/0.988 ms (launches apart)",
    "bmm 64x128x128 x48": "-22%: mean 1.07 ms (median 0.899 [0.803-1.54]), "
    "launches 0.9/0.787/1.51 ms (launches apart)",
    "bmm 128x64x128 x48": "-31%: mean 1.2 ms (median 0.948 [0.834-1.76]), "
    "launches 0.944/0.931/1.72 ms (launches apart)",
    "bmm 128x128x64 x48": "-23%: mean 1.07 ms (median 0.884 [0.808-1.56]), "
    "launches 0.885/0.802/1.53 ms (launches apart)",
    "mm 128x768x768": "-10%: mean 1.38 ms (median 1.17 [1.04-2]), "
    "launches 1.18/1.04/1.91 ms (launches apart)",
    "mm 256x384x768": "-10%: mean 1.38 ms (median 1.21 [1.06-1.89]), "
    "launches 1.25/1.06/1.84 ms (launches apart)",
    "mm 256x768x384": "-10%: mean 1.38 ms (median 1.2 [1.05-1.9]), "
    "launches 1.23/1.05/1.86 ms (launches apart)",
    "mm 128x1152x768": "-11%: mean 2.08 ms (median 1.83 [1.4-3.15]), "
    "launches 1.83/1.38/3.04 ms (launches apart)",
    "mm 128x1536x768": "-21%: mean 3.12 ms (median 2.85 [1.97-4.55]), "
    "launches 2.86/1.99/4.52 ms (launches apart)",
    "mm 256x768x768": "-14%: mean 2.88 ms (median 2.5 [2.38-3.93]), "
    "launches 2.5/2.28/3.87 ms (launches apart)",
    "mm 384x768x512": "-13%: mean 2.85 ms (median 2.53 [2.23-3.92]), "
    "launches 2.5/2.22/3.85 ms (launches apart)",
    "mm 512x384x768": "-15%: mean 2.92 ms (median 2.52 [2.37-3.82]), "
    "launches 2.52/2.4/3.85 ms (launches apart)",
    "mm 512x768x384": "-11%: mean 2.78 ms (median 2.42 [2.29-3.69]), "
    "launches 2.46/2.29/3.6 ms (launches apart)",
    "mm 768x768x256": "-12%: mean 2.82 ms (median 2.47 [2.37-3.7]), "
    "launches 2.46/2.37/3.65 ms (launches apart)",
    "mm 1536x768x128": "-11%: mean 2.77 ms (median 2.34 [2.21-3.81]), "
    "launches 2.24/2.36/3.7 ms (launches apart)",
    "mm 128x768x2304": "-15%: mean 4.36 ms (median 3.72 [3.56-5.92]), "
    "launches 3.59/3.7/5.79 ms (launches apart)",
    "mm 128x2304x768": "-19%: mean 4.6 ms (median 3.9 [3.73-6.25]), "
    "launches 3.73/3.9/6.16 ms (launches apart)",
    "mm 256x768x1152": "-12%: mean 4.21 ms (median 3.62 [3.45-5.65]), "
    "launches 3.48/3.56/5.58 ms (launches apart)",
    "mm 256x1152x768": "-18%: mean 4.5 ms (median 4.18 [3.79-5.74]), "
    "launches 4.01/3.8/5.7 ms (launches apart)",
    "mm 768x1152x256": "-12%: mean 4.2 ms (median 3.65 [3.35-5.77]), "
    "launches 3.55/3.41/5.66 ms (launches apart)",
    "mm 768x2304x128": "+11%: mean 3.33 ms (median 3.27 [3.18-3.31]), "
    "launches 3.42/3.26/3.31 ms (launches agree)",
    "mm 128x3072x768": "-41%: mean 8.38 ms (median 6.8 [5.49-9.76]), "
    "launches 5.55/6.77/12.8 ms (launches apart)",
    "mm 768x3072x128": "+12%: mean 4.41 ms (median 4.36 [4.3-4.52]), "
    "launches 4.26/4.36/4.6 ms (launches agree)",
    "mm 1536x768x256": "+11%: mean 4.47 ms (median 4.43 [4.39-4.53]), "
    "launches 4.41/4.48/4.51 ms (launches agree)",
    "mm 3072x768x128": "+17%: mean 4.22 ms (median 4.34 [4.17-4.47]), "
    "launches 4.32/3.81/4.52 ms (launches agree)",
    "mm 128x768x4096": "+11%: mean 5.97 ms (median 6.28 [4.9-6.35]), "
    "launches 6.63/4.89/6.39 ms (launches apart)",
    "mm 128x4096x768": "-46%: mean 12.3 ms (median 13.1 [9.98-13.5]), "
    "launches 13.1/9.86/13.9 ms (launches apart)",
    "mm 768x4096x128": "+14%: mean 5.77 ms (median 6.14 [4.92-6.27]), "
    "launches 6.18/4.92/6.22 ms (launches apart)",
    "mm 512x1152x768": "+11%: mean 6.7 ms (median 6.8 [5.8-7.34]), "
    "launches 6.79/5.87/7.44 ms (launches apart)",
    "mm 768x2304x256": "+13%: mean 6.57 ms (median 6.65 [5.83-7.23]), "
    "launches 6.72/5.67/7.32 ms (launches apart)",
    "mm 3072x768x256": "+14%: mean 8.7 ms (median 8.67 [7.49-9.66]), "
    "launches 8.65/7.62/9.85 ms (launches apart)",
    "mm 128x8192x768": "-55%: mean 29.2 ms (median 26.6 [23.8-29.8]), "
    "launches 27/23.6/38.4 ms (launches apart)",
    "mm 256x768x4096": "-12%: mean 15 ms (median 12.2 [11.6-21.4]), "
    "launches 12.3/10.9/21.7 ms (launches apart)",
    "mm 256x4096x768": "-15%: mean 15.5 ms (median 13.9 [12.4-21]), "
    "launches 14/11.2/21.2 ms (launches apart)",
    "mm 768x4096x256": "-13%: mean 15.1 ms (median 13.6 [12-20.2]), "
    "launches 13.1/11.6/20.5 ms (launches apart)",
    "mm 512x2304x768": "+11%: mean 13.3 ms (median 13.4 [12.5-14.6]), "
    "launches 13.4/11.8/14.8 ms (launches apart)",
    "mm 768x2304x512": "+15%: mean 12.9 ms (median 13.1 [11.3-13.9]), "
    "launches 13/11.4/14.3 ms (launches apart)",
    "mm 1024x1024x1024": "+14%: mean 15.4 ms (median 15.9 [13.3-16.6]), "
    "launches 15.9/13.5/16.9 ms (launches apart)",
    "mm 512x768x3072": "+13%: mean 17.5 ms (median 17.8 [16.1-18.2]), "
    "launches 18.2/17.1/17.1 ms (launches agree)",
    "mm 512x3072x768": "+11%: mean 17.9 ms (median 17.5 [16.4-19.5]), "
    "launches 19.5/16.2/17.8 ms (launches agree)",
    "mm 768x3072x512": "+14%: mean 17.3 ms (median 17.3 [15.6-19]), "
    "launches 19.2/15.5/17.2 ms (launches apart)",
    "mm 3072x768x512": "+11%: mean 17.8 ms (median 18.7 [15.9-19.1]), "
    "launches 19.2/15.8/18.3 ms (launches agree)",
    "mm 512x768x4096": "+12%: mean 23.5 ms (median 23 [21.4-25.9]), "
    "launches 26.1/21.9/22.6 ms (launches agree)",
    "mm 768x4096x512": "+13%: mean 23.4 ms (median 23.7 [22.4-24]), "
    "launches 24.8/21.6/23.7 ms (launches agree)",
    "mm 768x8192x512": "+10%: mean 47.9 ms (median 50.1 [43.4-52.2]), "
    "launches 52/48.2/44 ms (launches agree)",
    "mm 2048x2048x2048": "+20%: mean 117 ms (median 109 [107-129]), "
    "launches 136/112/107 ms (launches apart)",
    "adamw 4194304 params": "+11%: mean 20.4 ms (median 18 [16-25.7]), "
    "launches 15.7/28.1/17.6 ms (launches apart)",
}
# zsim's gloo model (half-duplex rank stacks, one latency per ring step, a cost per message, the
# ranks' copies and sums, all_gather's flat output faulted in above a thread arena's 64 MiB heap,
# each op's own CPU per byte it moves and per call, send/recv's own call latency) against this
# host's loopback TCP. Model vs mean (median [quartiles]), the mean of each of the 3 launches,
# and whether one time is within 10% of every launch's mean. Small calls are bimodal (a ~4 ms
# stall in a quarter to half of them, which follows the host's scheduling of this VM:
# calibration_repeat.md), and whole launches sit in the slow mode or not.
KNOWN_COLLECTIVE_MISFITS = {
    "all_gather_into_tensor intra n=2 8 B": "+60%: mean 0.332 ms (median 0.192 [0.173-0.26]), "
    "launches 0.195/0.485/0.317 ms (launches apart)",
    "all_gather_into_tensor intra n=2 4 KiB": "+27%: mean 0.419 ms (median 0.2 [0.175-0.298]), "
    "launches 0.606/0.476/0.175 ms (launches apart)",
    "all_gather_into_tensor intra n=2 16 KiB": "-12%: mean 0.616 ms (median 0.273 [0.201-0.327]), "
    "launches 0.282/0.98/0.587 ms (launches apart)",
    "all_gather_into_tensor intra n=2 256 KiB": "-16%: mean 0.818 ms (median 0.341 [0.257-0.463]), "
    "launches 1.36/0.799/0.291 ms (launches apart)",
    "all_gather_into_tensor intra n=2 1 MiB": "-32%: mean 1.72 ms (median 0.818 [0.624-2.79]), "
    "launches 1.38/2.08/1.7 ms (launches apart)",
    "all_gather_into_tensor intra n=2 4 MiB": "+11%: mean 2.76 ms (median 2.21 [1.91-3.54]), "
    "launches 2.92/2.81/2.56 ms (launches agree)",
    "reduce_scatter_tensor intra n=2 8 B": "+38%: mean 0.582 ms (median 0.252 [0.203-0.361]), "
    "launches 0.73/0.415/0.6 ms (launches apart)",
    "reduce_scatter_tensor intra n=2 4 KiB": "-31%: mean 1.82 ms (median 0.509 [0.37-3.62]), "
    "launches 1.54/1.76/2.16 ms (launches apart)",
    "reduce_scatter_tensor intra n=2 16 KiB": "-29%: mean 1.8 ms (median 0.628 [0.369-3.57]), "
    "launches 1.5/2.26/1.64 ms (launches apart)",
    "reduce_scatter_tensor intra n=2 64 KiB": "-20%: mean 1.65 ms (median 0.528 [0.395-3.22]), "
    "launches 1.41/2.06/1.47 ms (launches apart)",
    "reduce_scatter_tensor intra n=2 256 KiB": "-35%: mean 2.31 ms (median 2.38 [0.58-3.76]), "
    "launches 2.27/1.99/2.68 ms (launches apart)",
    "reduce_scatter_tensor intra n=2 1 MiB": "-17%: mean 2.73 ms (median 1.76 [1.24-4.04]), "
    "launches 2.58/2.48/3.12 ms (launches apart)",
    "all_reduce intra n=2 8 B": "+11%: mean 0.552 ms (median 0.222 [0.169-0.262]), "
    "launches 0.402/0.988/0.266 ms (launches apart)",
    "all_reduce intra n=2 1 KiB": "+23%: mean 0.862 ms (median 0.319 [0.269-0.397]), "
    "launches 0.523/1.67/0.394 ms (launches apart)",
    "all_reduce intra n=2 4 KiB": "-42%: mean 1.85 ms (median 0.5 [0.298-3.5]), "
    "launches 1.91/1.68/1.95 ms (launches agree)",
    "all_reduce intra n=2 16 KiB": "-42%: mean 1.86 ms (median 0.627 [0.283-3.54]), "
    "launches 2.01/1.97/1.6 ms (launches apart)",
    "all_reduce intra n=2 64 KiB": "-41%: mean 1.86 ms (median 0.957 [0.285-3.28]), "
    "launches 2.1/1.87/1.59 ms (launches apart)",
    "all_reduce intra n=2 256 KiB": "-45%: mean 2.19 ms (median 1.77 [0.421-3.83]), "
    "launches 2.1/2.36/2.11 ms (launches agree)",
    "all_reduce intra n=2 1 MiB": "-16%: mean 1.93 ms (median 1 [0.701-3.5]), "
    "launches 2/1.62/2.17 ms (launches apart)",
    "all_reduce intra n=2 256 MiB": "+11%: mean 180 ms (median 167 [162-191]), "
    "launches 160/171/218 ms (launches apart)",
    "broadcast intra n=2 8 B": "-19%: mean 0.24 ms (median 0.148 [0.109-0.194]), "
    "launches 0.304/0.209/0.208 ms (launches apart)",
    "broadcast intra n=2 1 KiB": "+11%: mean 0.175 ms (median 0.138 [0.101-0.169]), "
    "launches 0.21/0.169/0.146 ms (launches apart)",
    "broadcast intra n=2 16 KiB": "-11%: mean 0.223 ms (median 0.116 [0.092-0.16]), "
    "launches 0.155/0.252/0.263 ms (launches apart)",
    "broadcast intra n=2 256 KiB": "-11%: mean 0.294 ms (median 0.143 [0.118-0.175]), "
    "launches 0.439/0.247/0.195 ms (launches apart)",
    "sendrecv intra n=2 8 B": "-34%: mean 0.663 ms (median 0.13 [0.108-1.59]), "
    "launches 0.534/1.14/0.311 ms (launches apart)",
    "sendrecv intra n=2 4 KiB": "+16%: mean 0.378 ms (median 0.122 [0.0971-0.143]), "
    "launches 0.102/0.34/0.691 ms (launches apart)",
    "sendrecv intra n=2 64 KiB": "-34%: mean 0.7 ms (median 0.155 [0.117-1.28]), "
    "launches 0.784/0.589/0.728 ms (launches apart)",
    "sendrecv intra n=2 256 KiB": "-20%: mean 0.69 ms (median 0.215 [0.179-1.39]), "
    "launches 0.937/0.627/0.508 ms (launches apart)",
    "sendrecv intra n=2 1 MiB": "+44%: mean 0.619 ms (median 0.532 [0.482-0.574]), "
    "launches 0.792/0.571/0.493 ms (launches apart)",
    "sendrecv intra n=2 4 MiB": "+13%: mean 2.01 ms (median 1.79 [1.54-2.01]), "
    "launches 2.07/2.17/1.78 ms (launches agree)",
    "sendrecv intra n=2 64 MiB": "-26%: mean 40.3 ms (median 38 [35.4-43.4]), "
    "launches 35.9/41.8/44 ms (launches apart)",
    "sendrecv intra n=2 256 MiB": "-18%: mean 143 ms (median 137 [134-158]), "
    "launches 139/134/161 ms (launches agree)",
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
