"""Validation beyond pure data parallelism: Megatron-style TP and DeepSpeed's PipelineEngine.

The refusals name the field and what is allowed. The end-to-end runs check what each rank
really holds against the frameworks' own split, computed here from the layer shapes and not
from zsim's ledger: Megatron's TP shard of a GPT (qkv and fc1 split by rows, proj and fc2 by
columns with their biases whole, the vocabulary padded to ceil(vocab / tp) rows, norms and
position embeddings whole), and DeepSpeed's `PipelineModule` with `partition_method="uniform"`
(the Linear layers split evenly over the stages).
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest

from zsim.cli import main
from zsim.errors import InputError
from zsim.validate.runner import Case
from zsim.workload.model_presets import preset
from zsim.workload.parallel import ParallelConfig, Precision, ZeroStage


@pytest.mark.parametrize(
    ("model", "tp", "pp", "stage", "allowed"),
    [
        ("toy-mlp", 2, 1, 0, "split only transformers"),
        ("gpt-125m", 1, 2, 0, "pipeline only the seeds' Linear stack"),
        ("gpt-125m", 2, 2, 0, "not both"),
    ],
)
def test_layouts_the_workers_cannot_train_are_refused(
    model: str, tp: int, pp: int, stage: int, allowed: str
) -> None:
    cfg = ParallelConfig(
        dp=4 // (tp * pp), tp=tp, pp=pp, zero_stage=ZeroStage(stage), precision=Precision.FP32
    )
    with pytest.raises(InputError, match=allowed) as err:
        Case("x", preset(model), cfg, "1x4-cpu", ranks_per_node=4)
    assert "tp/pp" in str(err.value)


def test_tp_that_does_not_divide_the_ranks_gets_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["validate", "--nproc", "2", "--tp", "3", "--model", "gpt-125m"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "tp x pp" in err[0]
    assert "divisor of the 2 ranks" in err[0]


def test_tp_that_does_not_divide_the_heads_is_refused_before_anything_runs(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    args = ["validate", "--nproc", "4", "--tp", "4", "--model", "gpt-125m:heads=6"]
    assert main([*args, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "a divisor of heads=6" in err[0]
    assert not (tmp_path / "out").exists()


def _row(tmp_path: Path, *args: str) -> dict[str, str]:
    common = ["validate", "--nproc", "2", "--steps", "2", "--warmup", "1", "--no-progress"]
    assert main([*common, *args, "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader((tmp_path / "predicted_vs_measured.csv").open()))
    assert len(rows) == 1
    assert rows[0]["status"] == "ok", rows
    return rows[0]


def _megatron_shard_params(h: int, f: int, layers: int, vocab: int, seq: int, tp: int) -> int:
    block = (h * 3 * h // tp + 3 * h // tp) + (h // tp * h + h) + (h * f // tp + f // tp)
    block += f // tp * h + h + 2 * (2 * h)  # fc2 with its whole bias; two LayerNorms
    return layers * block + math.ceil(vocab / tp) * h + seq * h + 2 * h


@pytest.mark.e2e
def test_tensor_parallel_ranks_hold_megatrons_shard(tmp_path: Path) -> None:
    spec = "gpt-125m:layers=2,hidden=64,heads=4,ffn-hidden=256,seq-len=16,vocab=101"
    row = _row(tmp_path, "--tp", "2", "--stages", "0", "--model", spec)
    assert (row["tp"], row["pp"], row["world"]) == ("2", "1", "2")
    params = _megatron_shard_params(64, 256, 2, 101, 16, 2)
    assert int(row["measured_parameters_bytes"]) == 4 * params
    assert float(row["measured_step_s"]) > 0


@pytest.mark.e2e
def test_pipeline_stages_hold_their_share_of_the_layers(tmp_path: Path) -> None:
    row = _row(
        tmp_path, "--pp", "2", "--grad-accum", "2", "--stages", "1",
        "--model", "toy-mlp:layers=4,hidden=64",
    )  # fmt: skip
    assert (row["tp"], row["pp"]) == ("1", "2")
    assert int(row["measured_parameters_bytes"]) == 4 * 2 * (64 * 64 + 64)
    assert float(row["measured_step_s"]) > 0


@pytest.mark.e2e
@pytest.mark.parametrize("sharding", ["full", "grad-op"])
def test_fsdp_ranks_hold_fp32_shards_of_parameters_gradients_and_adam(
    tmp_path: Path, sharding: str
) -> None:
    # PyTorch FSDP2 on 2 ranks: each holds half of every parameter (4 bytes), of its
    # gradient (4) and of Adam's two moments (8), counted from the real engine's tensors
    row = _row(
        tmp_path, "--engine", "fsdp", "--sharding", sharding,
        "--model", "toy-mlp:layers=4,hidden=64",
    )  # fmt: skip
    assert row["case"] == f"fsdp-{sharding}"
    half = 4 * (64 * 64 + 64) // 2
    assert int(row["measured_parameters_bytes"]) == 4 * half
    assert int(row["measured_gradients_bytes"]) == 4 * half
    steps = 4 * 2 * 4  # torch Adam's state["step"]: an fp32 scalar per parameter tensor
    assert int(row["measured_optimizer_states_bytes"]) == 8 * half + steps
    assert float(row["measured_step_s"]) > 0
