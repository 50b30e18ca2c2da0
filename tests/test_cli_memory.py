"""`zsim memory` end to end: the seeds' numbers in --json, the verdict, and bad input."""

import json
import subprocess
import sys

import pytest

from zsim.cli import main


def run_json(capsys, *argv):
    assert main(["memory", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_seed_table_exact_in_json(capsys):
    out = run_json(capsys, "--params", "7.5e9", "--dp", "64")
    got = [out["stages"][s]["model_states_GB"] for s in "0123"]
    assert got == [120, 31.40625, 16.640625, 1.875]


def test_seed_question_1_verdict(capsys):
    out = run_json(capsys, "--params", "30e9", "--dp", "16", "--gpu", "a100-80gb")
    got = [out["stages"][s]["model_states_GB"] for s in "123"]
    assert got == pytest.approx([142.5, 86.25, 30.0])
    assert [out["stages"][s]["fits"] for s in "0123"] == [False, False, False, True]
    assert out["first_stage_that_fits"] == 3


def test_reads_a_real_ds_config(capsys, tmp_path):
    # the seeds' ds_config (section 3.2) with a 2-way accumulation: dp follows the batch rule
    cfg = {
        "train_batch_size": 32,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "fp16": {"enabled": True},
        "zero_optimization": {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 5e7},
    }
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(cfg))
    out = run_json(capsys, "--model", "gpt-1.3b", "--ds-config", str(path))
    assert out["parallel"]["dp"] == 4
    assert out["parallel"]["micro_batch"] == 4
    assert out["parallel"]["grad_accum"] == 2
    assert out["parallel"]["precision"] == "fp16"


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--model", "gpt-5"], "model='gpt-5'"),
        (["--params", "-7"], "params"),
        (["--params", "7.5e9", "--dp", "-2"], "dp='-2'"),
        (["--params", "7.5e9", "--dp", "2.5"], "dp='2.5'"),
        (["--model", "gpt-1.3b", "--micro-batch", "0"], "micro_batch"),
        (
            ["--model", "gpt-1.3b", "--dp", "8", "--global-batch", "100", "--micro-batch", "3"],
            "a multiple of micro_batch 3 x dp 8 = 24",
        ),
        (["--model", "gpt-1.3b", "--tp", "3"], "tp=3"),
        (["--model", "gpt-1.3b", "--gpu", "a100"], "gpu='a100'"),
    ],
)
def test_bad_input_is_one_line_exit_2(capsys, argv, needle):
    assert main(["memory", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err
    assert err.count("\n") == 1
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("{not json", "valid JSON"),
        ('{"train_batch_size": 8, "zero_optimization": {"stage": 4}}', "0, 1, 2 or 3"),
        ('{"train_batch_size": 8, "zero_optimization": {"stage": "auto"}}', "auto"),
        ('{"train_batch_size": 9, "train_micro_batch_size_per_gpu": 2}', "train_batch_size"),
        ("[1, 2]", "JSON object"),
    ],
)
def test_bad_ds_config(capsys, tmp_path, content, needle):
    path = tmp_path / "ds_config.json"
    path.write_text(content)
    assert main(["memory", "--model", "gpt-125m", "--ds-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert needle in err
    assert err.count("\n") == 1


def test_stage_4_and_unknown_flag_exit_2_without_traceback():
    for argv in (["run", "--stage", "4"], ["memory", "--bogus"]):
        proc = subprocess.run(
            [sys.executable, "-m", "zsim.cli", *argv], capture_output=True, text=True, check=False
        )
        assert proc.returncode == 2
        assert "Traceback" not in proc.stderr
        assert proc.stderr.count("\n") == 1
