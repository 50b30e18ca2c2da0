"""The model's own error on rows it did not see, as a part of a prediction's band.

The spread band (5th-95th percentile over profiles refitted from resampled repeats) says how
much the calibration's noise moves a prediction; it says nothing about how well the models
predict. The k-fold residuals of a profile do (`zsim.calibrate.holdout`): the median held-out
error of its compute rows (GEMMs, kernels, copies, Adam) and of its collective rows is the
typical miss of each model on a microbenchmark it was not fitted to. A step's model error is
then the step-time share of each (the critical rank's compute and exposed communication)
times its held-out median, and the band widens by it on both sides:

    low = p5 x (1 - e),  high = p95 x (1 + e),  e = (compute x e_compute + comm x e_comm) / step

Where a profile has no held-out residuals (written before them), e is 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from zsim.calibrate.fit import Residual

COMPUTE_KINDS = ("gemm", "memory", "optimizer", "host_copy", "attention")


def held_out_error(residuals: Sequence[Residual], kinds: Sequence[str]) -> float:
    """The median held-out relative error over the residual groups of `kinds`, each group
    weighted by its rows (0 when none was held out)."""
    groups = [r for r in residuals if r.held_out and r.kind in kinds]
    if not groups:
        return 0.0
    medians = np.repeat([g.median_rel_err for g in groups], [g.rows for g in groups])
    return float(np.median(medians))


def model_error(
    residuals: Sequence[Residual], compute_s: float, comm_s: float, step_s: float
) -> float:
    """e of the module doc: the step's relative model error."""
    if step_s <= 0:
        return 0.0
    e_compute = held_out_error(residuals, COMPUTE_KINDS)
    e_comm = held_out_error(residuals, ("collective",))
    return (compute_s * e_compute + comm_s * e_comm) / step_s


def widened(low_s: float, high_s: float, error: float) -> tuple[float, float]:
    return low_s * (1.0 - error), high_s * (1.0 + error)
