"""Predicted-vs-measured arithmetic, the files, and the classification of engine tensors.

The rows here are built by hand (a measurement and a prediction with chosen numbers): they test
the table and the figure, not a predictor.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from zsim.memory import ledger
from zsim.validate import compare, held, results
from zsim.validate.compare import Compared, Prediction
from zsim.validate.runner import Case, Measurement, Status
from zsim.workload.model_presets import preset, with_overrides
from zsim.workload.parallel import ParallelConfig, Precision, ZeroStage

TINY = with_overrides(preset("toy-mlp"), layers=2, hidden=64)


def _case(stage: int) -> Case:
    cfg = ParallelConfig(dp=2, zero_stage=ZeroStage(stage), precision=Precision.FP32)
    return Case(f"z{stage}", TINY, cfg, "1x2-cpu")


def _row(stage: int, measured: float | None, predicted: float | None) -> Compared:
    case = _case(stage)
    lg = ledger(case.model, case.parallel)
    if measured is None:
        m = Measurement(case, Status.OOM, "rank 0: MemoryError")
    else:
        m = Measurement(
            case,
            Status.OK,
            step_time_s=measured,
            step_times_s=(measured, measured * 1.1),
            held_bytes={"parameters": 1000, "gradients": 0, "optimizer_states": 0},
        )
    p = None
    if predicted is not None:
        p = Prediction(predicted, predicted * 0.9, predicted * 1.2, lg, 20)
    return Compared(m, p, "" if p else "no --profile given", lg)


def test_errors_and_mape() -> None:
    assert compare.error_pct(1.1, 1.0) == pytest.approx(10.0)
    assert compare.error_pct(0.5, 1.0) == pytest.approx(-50.0)
    assert compare.error_pct(1.0, 0.0) is None
    rows = [_row(0, 1.0, 1.1), _row(1, 2.0, 1.0), _row(2, None, 3.0), _row(3, 4.0, None)]
    assert rows[0].step_error_pct == pytest.approx(10.0)
    assert rows[2].step_error_pct is None  # failed: nothing measured
    assert compare.mape(rows) == pytest.approx((10.0 + 50.0) / 2)
    assert compare.mape([rows[3]]) is None


def test_results_are_written(tmp_path: Path) -> None:
    rows = [_row(0, 1.0, 1.1), _row(1, 2.0, 1.0), _row(2, None, 3.0), _row(3, 4.0, None)]
    table, summary = results.write_results(rows, {"profile": "p.json"}, tmp_path, "test")
    written = list(csv.DictReader((tmp_path / "predicted_vs_measured.csv").open()))
    assert [r["status"] for r in written] == ["ok", "ok", "oom", "ok"]
    assert written[2]["detail"] == "rank 0: MemoryError"
    assert float(written[1]["step_error_pct"]) == pytest.approx(-50.0)
    assert float(written[0]["predicted_low_s"]) == pytest.approx(0.99)
    assert written[3]["prediction_note"] == "no --profile given"
    assert written[0]["profile"] == "p.json"
    # memory: the ledger's fp32 parameters (4 bytes each, not partitioned below stage 3)
    assert float(written[0]["ledger_parameters_bytes"]) == 4 * TINY.total_params()
    assert float(written[0]["parameters_error_pct"]) == pytest.approx(
        100 * (4 * TINY.total_params() - 1000) / 1000
    )
    assert json.loads((tmp_path / "summary.json").read_text())["mape_pct"] == pytest.approx(30.0)
    assert summary["cases"]["z2"] == "oom"
    assert len(table) == 4
    assert (tmp_path / "predicted_vs_measured.png").stat().st_size > 10_000


def test_no_profile_means_no_prediction() -> None:
    m = Measurement(_case(2), Status.OK, step_time_s=1.0)
    row = compare.compare(m, None)
    assert row.prediction is None
    assert "--profile" in row.prediction_note
    assert row.ledger == ledger(TINY, _case(2).parallel)


@pytest.mark.parametrize(
    ("path", "category"),
    [
        # names from DeepSpeed 0.19 runtime/zero/stage_1_and_2.py and stage3.py
        ("optimizer.ipg_buckets[torch.float32].buffer[0]", "comm_buffers"),
        ("optimizer.averaged_gradients[0][1]", "gradients"),
        ("optimizer.single_partition_of_fp32_groups[0].grad", "gradients"),
        ("optimizer.single_partition_of_fp32_groups[0]", "optimizer_states"),
        ("optimizer.fp32_partitioned_groups_flat[0]", "optimizer_states"),
        ("basic_optimizer.state[<tensor (10,)>]['exp_avg']", "optimizer_states"),
        ("optimizer.bit16_groups_flat[0]", "parameters"),
        ("optimizer.fp16_partitioned_groups_flat[0]", "parameters"),
        ("param<net.0.weight>", "parameters"),
        ("gathered<net.0.weight>", "comm_buffers"),  # ZeRO-3, gathered for compute
        ("gathered<net.0.weight>.ds_tensor", "parameters"),  # its partition
        ("param<net.0.weight>.grad", "gradients"),
        ("engine.something_else", "other"),
    ],
)
def test_classification_of_deepspeed_names(path: str, category: str) -> None:
    assert held.classify(path) == category


def test_a_storage_takes_the_first_category_by_priority() -> None:
    inv = held.Inventory()
    bucket = torch.zeros(100)
    inv.add(bucket[:10], "param<w>.grad")  # a gradient living in the reduce bucket
    inv.add(bucket, "optimizer.ipg_buckets[torch.float32].buffer")
    assert inv.by_category()["comm_buffers"] == 400
    assert inv.by_category()["gradients"] == 0


def test_saved_tensors_count_activations_not_weights() -> None:
    layer = nn.Linear(64, 64)
    x = torch.randn(8, 64, requires_grad=False)
    with held.SavedTensors(layer) as saved:
        layer(x).sum().backward()
    assert saved.total_bytes == x.numel() * 4  # the input; the weight is a parameter
