"""The committed profile of this machine's CPU (calibration/cpu-2rank.json): zsim's own models,
with the fitted numbers, reproduce the microbenchmarks they were fitted on.

Predictions come from the simulator's functions, not from the fit's module
(`zsim.calibrate.replay.simulated_s`).
Measured = the median of the stored repeats.
"""

from pathlib import Path

import pytest

from zsim import presets
from zsim.calibrate.fit import fitted_rows
from zsim.calibrate.links import apply_profile
from zsim.calibrate.plan import Kind
from zsim.calibrate.profile import load_calibration
from zsim.calibrate.replay import simulated_s

PROFILE = Path(__file__).parent.parent / "calibration" / "cpu-2rank.json"
TOLERANCE = 0.10

if not PROFILE.exists():
    pytest.skip(f"{PROFILE} is not committed", allow_module_level=True)

CAL = load_calibration(PROFILE)
PROF = CAL.profile
TOPO = apply_profile(presets.topology(CAL.provenance["topology"]), PROF)


def predicted_s(row):
    return simulated_s(PROF, TOPO, row)


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
# moves rows across the 10% line (20-26 of the 55 collective rows moved more than 10% between this
# calibration, 2026-11-29 15:36, and the three in calibration/repeat/, 12 minutes before to 70
# after; for 18 rows no one time is within 10% of all four medians:
# benchmarks/results/calibration_repeat.md), and this list is updated with it.
KNOWN_KERNEL_MISFITS: dict[str, str] = {}
# zsim's gloo model (half-duplex rank stacks, one latency per ring step, a cost per message, the
# ranks' copies and sums, all_gather's flat output faulted in above a thread arena's 64 MiB heap,
# each op's own CPU per byte it moves and per call, send/recv's own call latency) against this
# host's loopback TCP. Model vs median, [quartiles], the median of each of the 3 launches, and
# the repeat calibration's median with the model's error on it. Two ranks on two cores sit in
# one of two placements a launch keeps (all_reduce 64 MiB: 38-43 or 65-73 ms), and small calls
# are bimodal within a launch (a ~4 ms stall in a quarter to half of them, which follows the
# host's scheduling of this VM: calibration_repeat.md): reduce_scatter
# 256 MiB faulted its 256 MiB clone in on every call in this calibration (65,000 faults per
# call when reproduced alone), not in the repeat.
KNOWN_COLLECTIVE_MISFITS = {
    "all_gather_into_tensor intra n=2 1 MiB": "-15%: median 0.974 ms [0.556-2.55], "
    "launches 0.98/0.545/1.26; repeat 0.813 ms (+2%)",
    "reduce_scatter_tensor intra n=2 1 KiB": "-45%: median 0.818 ms [0.423-3.77], "
    "launches 0.511/3.16/2.09; repeat 0.515 ms (-12%)",
    "reduce_scatter_tensor intra n=2 1 MiB": "+35%: median 0.862 ms [0.794-1.01], "
    "launches 0.844/0.831/0.896; repeat 0.978 ms (+19%)",
    "reduce_scatter_tensor intra n=2 256 MiB": "-77%: median 875 ms [872-901], "
    "launches 912/875/872; repeat 210 ms (-6%)",
    "all_reduce intra n=2 16 KiB": "-14%: median 0.498 ms [0.391-3.3], launches 0.435/2.52/0.43; "
    "repeat 0.39 ms (+10%)",
    "all_reduce intra n=2 1 MiB": "+16%: median 0.86 ms [0.66-3.6], launches 1.55/0.828/0.949; "
    "repeat 0.797 ms (+26%)",
    "all_reduce intra n=2 4 MiB": "-22%: median 3.51 ms [2.24-4.78], launches 3.55/3.54/2.86; "
    "repeat 3.09 ms (-11%)",
    "broadcast intra n=2 16 MiB": "-10%: median 4.33 ms [3.67-5.18], launches 4.1/4.58/4.5; "
    "repeat 5.16 ms (-25%)",
    "sendrecv intra n=2 8 B": "+17%: median 0.159 ms [0.136-0.207], launches 0.148/0.177/0.149; "
    "repeat 0.186 ms (-0%)",
    "sendrecv intra n=2 4 MiB": "-19%: median 2.75 ms [2-4.52], launches 2/2.8/4.63; "
    "repeat 2.11 ms (+5%)",
    "sendrecv intra n=2 256 MiB": "+15%: median 113 ms [111-127], launches 113/115/113; "
    "repeat 116 ms (+12%)",
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


REPEATS = sorted((PROFILE.parent / "repeat").glob("cpu-2rank-*.json"))


def test_the_repeat_calibrations_are_committed():
    assert [p.stem for p in REPEATS] == ["cpu-2rank-a", "cpu-2rank-b", "cpu-2rank-c"]


@pytest.mark.parametrize("kind", ["kernel", "collective"])
@pytest.mark.parametrize("path", REPEATS, ids=[p.stem for p in REPEATS])
def test_profile_predicts_a_calibration_it_was_not_fitted_on(path, kind):
    """The same machine calibrated 12 minutes before to 70 after: the profile's model against
    those medians, rows it never saw (the median error, the typical row; single rows vary
    between calibrations by more than the fit's tolerance)."""
    repeat = load_calibration(path)
    measured = {(r.kind, r.label): r.median_s for r in repeat.measurements}
    rows = [r for r in FITTED if (r.kind is Kind.COLLECTIVE) == (kind == "collective")]
    errors = [abs(predicted_s(r) / measured[(r.kind, r.label)] - 1) for r in rows]
    assert len(errors) > 50
    assert sorted(errors)[len(errors) // 2] <= TOLERANCE
