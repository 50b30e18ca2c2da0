"""zsim sweep: one row per grid point as it arrives, a rerun resumes, Ctrl-C keeps what is done,
a malformed spec is one line and exit 2, and a Dask cluster gives the rows a local pool does."""

import csv
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers_signals import popen_taking_ctrl_c
from zsim.cli import main

SPEC = """
models: [gpt-125m]
topologies: [1x8-nvlink, 2x4-ethernet]
layouts:
  stage: [1, 3]
  global_batch: 64
  micro_batch: [2, 4]
"""


def _rows(path):
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def _spec(tmp_path, text=SPEC, name="spec.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_every_point_once_and_a_rerun_runs_only_what_is_new(tmp_path, capsys):
    spec = _spec(tmp_path)
    assert main(["sweep", str(spec), "--workers", "2"]) == 0
    rows = _rows(tmp_path / "spec.csv")
    assert len(rows) == 2 * 2 * 2  # topologies x stages x micro-batches
    assert {(r["topology"], r["stage"], r["micro_batch"]) for r in rows} == {
        (t, s, m) for t in ("1x8-nvlink", "2x4-ethernet") for s in "13" for m in "24"
    }
    assert all(r["status"] == "ok" and int(r["dp"]) == 8 for r in rows)
    capsys.readouterr()
    assert main(["sweep", str(spec)]) == 0
    assert "8 already in" in capsys.readouterr().err
    assert len(_rows(tmp_path / "spec.csv")) == 8
    _spec(tmp_path, SPEC.replace("stage: [1, 3]", "stage: [1, 2, 3]"))
    assert main(["sweep", str(spec), "--workers", "2"]) == 0
    assert "8 already in /" in capsys.readouterr().err.replace(str(tmp_path), "/")
    rows = _rows(tmp_path / "spec.csv")
    assert sorted(r["stage"] for r in rows) == ["1"] * 4 + ["2"] * 4 + ["3"] * 4


def test_a_point_zsim_refuses_is_a_row_that_says_why(tmp_path):
    spec = _spec(tmp_path, SPEC.replace("micro_batch: [2, 4]", "micro_batch: [3]"))
    assert main(["sweep", str(spec), "--workers", "1"]) == 0
    rows = _rows(tmp_path / "spec.csv")
    assert {r["status"] for r in rows} == {"invalid"}  # 64 does not split into 8 x 3
    assert all("micro" in r["reason"] or "batch" in r["reason"] for r in rows)


def test_context_parallel_points_leave_dp_to_what_tp_pp_cp_leave(tmp_path):
    spec = _spec(
        tmp_path,
        "models: [gpt-125m]\ntopologies: [1x8-nvlink]\nlayouts: {stage: 1, dp_engine: megatron, "
        "flash_attention: true, cp: [1, 2], tp: [1, 2], global_batch: 16}\n",
    )
    assert main(["sweep", str(spec), "--workers", "1"]) == 0
    rows = _rows(tmp_path / "spec.csv")
    assert {(r["cp"], r["tp"], r["dp"]) for r in rows} == {
        ("1", "1", "8"), ("2", "1", "4"), ("1", "2", "4"), ("2", "2", "2")
    }  # fmt: skip
    assert all(r["status"] == "ok" for r in rows)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("models: gpt-125m\ntopologies: [1x8-nvlink]\n", "models"),
        ("topologies: [1x8-nvlink]\n", "models"),
        ("models: [gpt-125m]\ntopologies: [1x8-nvlink]\ncolour: red\n", "colour"),
        ("models: [gpt-125m]\ntopologies: [1x8-nvlink]\nlayouts: {stagee: [1]}\n", "stagee"),
        ("models: [gpt-125m]\ntopologies: [1x8-nvlink]\nmode: grid\n", "mode"),
        ("models: [gpt-125m]\ntopologies: [1x8-nvlink]\nlayouts: {stage: []}\n", "stage"),
        ("models: [gpt-125m\n", "spec"),
    ],
)
def test_a_malformed_spec_is_one_line_and_exit_2(tmp_path, capsys, text, needle):
    spec = _spec(tmp_path, text)
    assert main(["sweep", str(spec)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert needle in err
    assert not (tmp_path / "spec.csv").exists()


@pytest.mark.consistency
def test_a_dask_cluster_gives_the_rows_of_the_local_pool(tmp_path):
    distributed = pytest.importorskip("distributed")  # the sweep extra; dev installs it
    spec = _spec(tmp_path)
    assert main(["sweep", str(spec), "--workers", "2", "--out", str(tmp_path / "local.csv")]) == 0
    with distributed.LocalCluster(
        n_workers=1, threads_per_worker=2, processes=False, dashboard_address=None
    ) as cluster:
        out = tmp_path / "dask.csv"
        assert (
            main(["sweep", str(spec), "--cluster", cluster.scheduler_address, "--out", str(out)])
            == 0
        )
    local = {r["key"]: r for r in _rows(tmp_path / "local.csv")}
    remote = {r["key"]: r for r in _rows(out)}
    assert local == remote


def test_no_workers_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["sweep", str(_spec(tmp_path)), "--workers", "0"]) == 2
    assert "workers=0" in capsys.readouterr().err


def test_an_unreachable_cluster_is_one_line_and_exit_2(tmp_path, capsys):
    spec = _spec(tmp_path)
    assert main(["sweep", str(spec), "--cluster", "tcp://127.0.0.1:9"]) == 2
    assert "--cluster" in capsys.readouterr().err


def test_ctrl_c_keeps_every_finished_row(tmp_path):
    spec = _spec(tmp_path, SPEC.replace("gpt-125m", "gpt-1.3b").replace("[2, 4]", "[1, 2, 4, 8]"))
    out = tmp_path / "spec.csv"
    command = [sys.executable, "-m", "zsim", "sweep", str(spec), "--workers", "1"]
    child = popen_taking_ctrl_c(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not out.exists() or len(_rows(out)) < 2):
        time.sleep(0.2)
    assert child.poll() is None, "the sweep ended before it could be interrupted"
    child.send_signal(signal.SIGINT)
    _, err = child.communicate(timeout=60)
    assert child.returncode == 130
    assert "interrupted" in err
    assert "Traceback" not in err
    kept = _rows(out)
    assert 2 <= len(kept) < 16
    # whole rows only (micro-batch 8 does not fit an A100 at stage 1: still a whole row)
    assert all(r["status"] in ("ok", "does not fit") and r["step_s"] for r in kept)


def test_plan_mode_records_each_clusters_winner(tmp_path):
    text = "models: [gpt-125m]\ntopologies: [1x8-nvlink]\nmode: plan\nlayouts: {global_batch: 64}\n"
    spec = _spec(tmp_path, text)
    assert main(["sweep", str(spec), "--workers", "1"]) == 0
    (row,) = _rows(tmp_path / "spec.csv")
    assert row["status"] == "ok"
    assert row["layout"].startswith("ZeRO-")
