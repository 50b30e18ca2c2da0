"""The model-error part of a prediction's band, on residuals whose medians are known."""

import pytest

from zsim.calibrate.fit import Residual
from zsim.validate.band import held_out_error, model_error, widened


def residual(kind, op, rows, median, held_out=True):
    return Residual(kind, op, True, rows, median, median, "", held_out=held_out)


RESIDUALS = [
    residual("gemm", "mm", 3, 0.02),
    residual("optimizer", "adamw", 1, 0.10),
    residual("gemm", "mm", 3, 0.50, held_out=False),  # a fitted row: not the model's miss
    residual("collective", "all_reduce", 2, 0.04),
    residual("collective", "broadcast", 1, 0.30),
]


def test_the_error_of_a_kind_is_the_median_over_its_held_out_rows():
    # compute rows: 0.02 x 3 and 0.10 x 1 -> median of (0.02, 0.02, 0.02, 0.10) = 0.02
    assert held_out_error(RESIDUALS, ("gemm", "optimizer")) == pytest.approx(0.02)
    # collectives: (0.04, 0.04, 0.30) -> 0.04
    assert held_out_error(RESIDUALS, ("collective",)) == pytest.approx(0.04)
    assert held_out_error(RESIDUALS, ("attention",)) == 0.0


def test_a_step_error_weights_each_model_by_its_share_of_the_step():
    # 60 ms of compute at 2 %, 40 ms exposed communication at 4 %, a 100 ms step: 2.8 %
    assert model_error(RESIDUALS, 0.060, 0.040, 0.100) == pytest.approx(0.028)
    assert widened(0.09, 0.11, 0.028) == pytest.approx((0.09 * 0.972, 0.11 * 1.028))
