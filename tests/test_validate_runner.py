"""Real runs: a case that fails is reported and the others kept, a case that hangs is stopped,
nothing is left behind; the fast end-to-end case of `zsim validate`.

Expected memory comes from DeepSpeed 0.19's source, not from zsim: fp32 ZeRO-2 keeps the full
parameters (4 bytes each), the gradient partition (4/dp), an fp32 master partition plus Adam's
two moments (12/dp), and one reduce bucket of `reduce_bucket_size` elements allocated whole
whatever the model's size (`stage_1_and_2.py`, `setup_buckets`: `torch.empty(int(self.
reduce_bucket_size))`).
"""

from __future__ import annotations

import csv
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from zsim.cli import main
from zsim.validate import runner
from zsim.validate.runner import Case, Measurement, Status
from zsim.workload.model_presets import preset, with_overrides
from zsim.workload.parallel import ParallelConfig, Precision, ZeroStage

WORKERS = Path(__file__).parent / "validate_workers"
TINY = with_overrides(preset("toy-mlp"), layers=2, hidden=64)  # 2 x Linear(64, 64)


def _case(name: str, stage: int = 2, timeout_s: float = 300) -> Case:
    cfg = ParallelConfig(dp=2, zero_stage=ZeroStage(stage), micro_batch=4, precision=Precision.FP32)
    return Case(name, TINY, cfg, "1x2-cpu", steps=2, warmup=1, timeout_s=timeout_s)


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if text in cmdline:
                found.append(int(entry.name))
    return found


def _none_left(text: str, wait_s: float = 10.0) -> bool:
    deadline = time.monotonic() + wait_s
    while _processes_mentioning(text) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not _processes_mentioning(text)


def test_a_failing_case_is_reported_and_the_others_kept(tmp_path: Path) -> None:
    worker = (str(WORKERS / "raising_worker.py"),)
    measured, link = runner.run_all([_case("bad"), _case("good")], tmp_path, worker=worker)
    bad, good = measured
    assert link is None
    assert bad.status is Status.FAILED
    assert "rank 1: RuntimeError: injected failure on rank 1" in bad.detail
    assert bad.step_time_s is None
    assert good.status is Status.OK
    assert good.step_time_s is not None
    assert good.step_time_s > 0
    assert len(good.step_times_s) == 2
    assert _none_left(str(tmp_path))


def test_launches_run_in_rounds_over_the_cases(tmp_path: Path) -> None:
    """Launch 0 of every case before launch 1 of any: a slow spell of the host falls on one
    launch of several cases, not on every launch of one."""
    cases = [replace(_case(name), launches=2) for name in ("a", "b")]
    measured, _ = runner.run_all(cases, tmp_path)
    assert all(m.status is Status.OK for m in measured)
    assert all(m.detail.startswith("median of 2 launches") for m in measured)
    started = {
        (launch, name): (tmp_path / f"launch{launch}" / "runs" / name / "case.json").stat()
        for launch in (0, 1)
        for name in ("a", "b")
    }
    assert started[(0, "b")].st_mtime_ns < started[(1, "a")].st_mtime_ns


def test_a_crash_after_every_rank_reported_keeps_the_measurement(tmp_path: Path) -> None:
    m = runner.run_case(_case("z2"), tmp_path, worker=(str(WORKERS / "aborting_worker.py"),))
    assert m.status is Status.OK
    assert "after every rank had written its results" in m.detail
    assert m.step_time_s is not None
    assert _none_left(str(tmp_path))


def test_a_hanging_case_times_out_and_is_stopped(tmp_path: Path) -> None:
    case = _case("hang", timeout_s=8)
    begin = time.monotonic()
    m = runner.run_case(case, tmp_path, worker=(str(WORKERS / "hanging_worker.py"),))
    assert m.status is Status.TIMEOUT
    assert time.monotonic() - begin < 60
    assert _none_left(str(WORKERS / "hanging_worker.py"))
    assert _none_left("import time; time.sleep(600)")


def test_a_launcher_that_cannot_start_is_reported(tmp_path: Path) -> None:
    m = runner.run_case(_case("missing"), tmp_path, worker=(str(tmp_path / "no_such.py"),))
    assert m.status is Status.FAILED
    assert m.detail


@pytest.mark.parametrize(
    ("flag", "value", "allowed"),
    [("--warmup", "-1", "a whole number, 0 or more"), ("--steps", "0", "a positive integer")],
)
def test_bad_step_counts_get_one_line_and_exit_2(
    flag: str, value: str, allowed: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["validate", flag, value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert allowed in err[0]
    assert flag.removeprefix("--") in err[0]


def test_multi_node_without_emulation_is_refused(tmp_path: Path) -> None:
    from zsim.errors import InputError

    cfg = ParallelConfig(dp=4, precision=Precision.FP32)
    case = Case("x", TINY, cfg, "2x2-cpu", nodes=2, ranks_per_node=2)
    with pytest.raises(InputError, match="emulate"):
        runner.run_case(case, tmp_path)


@pytest.mark.e2e
def test_validate_end_to_end_zero2_two_ranks(tmp_path: Path) -> None:
    """`zsim validate` on 2 ranks, ZeRO-2, a tiny model, 3 steps: the files and the memory."""
    args = ["validate", "--stages", "2", "--model", "toy-mlp:layers=2,hidden=64"]
    args += ["--steps", "3", "--warmup", "1", "--out", str(tmp_path), "--no-progress"]
    assert main(args) == 0
    assert (tmp_path / "predicted_vs_measured.png").stat().st_size > 10_000
    rows = list(csv.DictReader((tmp_path / "predicted_vs_measured.csv").open()))
    assert len(rows) == 1
    row = rows[0]
    assert row["status"] == "ok"
    assert float(row["measured_step_s"]) > 0
    assert len(row["measured_steps_s"].split()) == 3
    params = 2 * (64 * 64 + 64)
    assert int(row["measured_parameters_bytes"]) == 4 * params
    assert int(row["measured_gradients_bytes"]) >= 4 * params // 2
    assert int(row["measured_optimizer_states_bytes"]) >= 12 * params // 2
    assert int(row["measured_comm_buffers_bytes"]) == 4 * 500_000_000
    assert row["prediction_note"].startswith("no --profile")
    assert _none_left(str(tmp_path))


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root")
def test_validate_emulated_2x2_all_stages(tmp_path: Path) -> None:
    """Two namespaces of two ranks at 1 Gbit/s: every stage runs, nothing is left."""
    from zsim.testbed.emulate import our_namespaces

    before = set(our_namespaces())
    args = ["validate", "--topology", "2x2-cpu-1gbit", "--emulate", "--steps", "3"]
    args += ["--out", str(tmp_path), "--no-progress"]
    assert main(args) == 0
    rows = list(csv.DictReader((tmp_path / "predicted_vs_measured.csv").open()))
    assert [r["status"] for r in rows] == ["ok"] * 4
    assert all(r["topology"] == "2x2-cpu-1000mbit" for r in rows)
    assert float(rows[0]["measured_link_bps"]) == pytest.approx(125e6, rel=0.15)
    assert set(our_namespaces()) == before
    assert _none_left(str(tmp_path))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_launches_off_the_calibrations_speed_are_left_out_of_the_median():
    """`speed`'s rule: a case's step is the median of its launches that started on the
    calibration's machine; of all of them, said so, where none did."""
    case = _case("c")

    def launched(step_s: float, drifted: bool) -> Measurement:
        return Measurement(
            case, Status.OK, step_time_s=step_s, step_times_s=(step_s,), drifted=drifted
        )

    mixed = [launched(1.0, False), launched(1.5, True), launched(1.2, False), launched(1.4, True)]
    combined = runner.combine_launches(mixed)
    assert combined.step_time_s == pytest.approx(1.1)  # the median of 1.0 and 1.2
    assert "2 launched off the calibration's speed left out" in combined.detail
    every = runner.combine_launches([launched(1.0, True), launched(2.0, True), launched(4.0, True)])
    assert every.step_time_s == 2.0
    assert "all launched off the calibration's speed" in every.detail
