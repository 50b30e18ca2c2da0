"""Malformed input across every command: one line naming the field, exit 2, no traceback.

A table, not random generation: each row is a mistake a user makes (a typo, a wrong unit, a
negative, a file of the wrong kind), and the field its message must name.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from zsim.cli import main

RUN = ["run", "--model", "gpt-125m", "--topology", "1x8-nvlink"]
MEMORY = ["memory", "--model", "gpt-125m"]
COLLECTIVE = ["collective", "--topology", "2x4-ethernet", "--op", "all_reduce"]

FLAG_CASES: list[tuple[list[str], str]] = [
    # run: names, sizes, layouts
    (["run", "--model", "gpt-9000"], "model"),
    (["run", "--model", "llama"], "model"),
    (["run", "--topology", "8-nvlink"], "topology"),
    (["run", "--topology", "2x4-infiniband"], "topology"),
    (["run", "--topology", "0x8-nvlink"], "topology"),
    (["run", "--topology", "2x0-nvlink"], "topology"),
    (["run", "--topology", "2x4-ethernet-0gbit"], "topology"),
    (["run", "--topology", "missing.yaml"], "topology"),
    (["run", "--gpu", "b200"], "gpu"),
    (["run", "--gpu", "a100"], "gpu"),
    ([*RUN, "--stage", "4"], "stage"),
    ([*RUN, "--stage", "-1"], "stage"),
    ([*RUN, "--stage", "two"], "stage"),
    ([*RUN, "--tp", "3"], "tp"),
    ([*RUN, "--tp", "0"], "tp"),
    ([*RUN, "--tp", "16"], "tp"),
    ([*RUN, "--pp", "5"], "tp x pp"),
    ([*RUN, "--pp", "-2"], "pp"),
    ([*RUN, "--dp", "3"], "dp x tp x pp"),
    ([*RUN, "--dp", "1.5"], "dp"),
    ([*RUN, "--micro-batch", "0"], "micro_batch"),
    ([*RUN, "--micro-batch", "-1e3"], "micro_batch"),
    ([*RUN, "--micro-batch", "two"], "micro_batch"),
    ([*RUN, "--grad-accum", "0"], "grad_accum"),
    ([*RUN, "--global-batch", "100"], "global_batch"),
    ([*RUN, "--global-batch", "1024", "--micro-batch", "3"], "global_batch"),
    ([*RUN, "--global-batch", "64", "--micro-batch", "2", "--grad-accum", "3"], "global_batch"),
    ([*RUN, "--precision", "fp8"], "precision"),
    ([*RUN, "--precision", "FP17"], "precision"),
    ([*RUN, "--recompute", "some"], "recompute"),
    ([*RUN, "--offload", "nvme"], "offload"),
    ([*RUN, "--offload", "optimizer"], "offload"),
    ([*RUN, "--stage", "2", "--offload", "optimizer+params"], "offload"),
    ([*RUN, "--sequence-parallel"], "sequence_parallel"),
    ([*RUN, "--pp", "2", "--stage", "2"], "zero_stage"),
    ([*RUN, "--pp", "2", "--pp-schedule", "gpipe"], "pp_schedule"),
    ([*RUN, "--pp-schedule", "zigzag"], "pp_schedule"),
    ([*RUN, "--pipeline-engine", "gpipe"], "pipeline_engine"),
    ([*RUN, "--virtual-stages", "2"], "virtual_stages"),
    ([*RUN, "--virtual-stages", "0"], "virtual_stages"),
    (
        [
            *RUN,
            "--pipeline-engine",
            "megatron",
            "--pp-schedule",
            "interleaved",
            "--virtual-stages",
            "2",
        ],
        "virtual_stages",
    ),
    ([*RUN, "--cp", "0"], "cp"),
    ([*RUN, "--cp", "3"], "tp x pp x cp"),
    ([*RUN, "--cp", "2"], "dp_engine"),
    ([*RUN, "--cp", "2", "--dp-engine", "megatron", "--stage", "1"], "flash_attention"),
    (
        [
            *RUN,
            "--pp",
            "2",
            "--pipeline-engine",
            "megatron",
            "--pp-schedule",
            "interleaved",
            "--virtual-stages",
            "4",
            "--grad-accum",
            "3",
        ],
        "grad_accum",
    ),
    (
        [
            *RUN,
            "--pp",
            "4",
            "--pipeline-engine",
            "megatron",
            "--pp-schedule",
            "interleaved",
            "--virtual-stages",
            "5",
            "--grad-accum",
            "4",
        ],
        "pp",
    ),
    ([*RUN, "--reduce-bucket-size", "0"], "reduce_bucket_size"),
    ([*RUN, "--reduce-bucket-size", "-5e8"], "reduce_bucket_size"),
    ([*RUN, "--allgather-bucket-size", "big"], "allgather_bucket_size"),
    ([*RUN, "--prefetch-bucket-size", "-1"], "prefetch_bucket_size"),
    ([*RUN, "--param-persistence-threshold", "1.5"], "param_persistence_threshold"),
    ([*RUN, "--max-live-parameters", "-1"], "max_live_parameters"),
    ([*RUN, "--max-reuse-distance", "x"], "max_reuse_distance"),
    ([*RUN, "--layers", "0"], "layers"),
    ([*RUN, "--hidden", "-768"], "hidden"),
    ([*RUN, "--heads", "7"], "heads"),
    ([*RUN, "--seq-len", "zero"], "seq_len"),
    ([*RUN, "--vocab", "-1"], "vocab"),
    ([*RUN, "--kv-heads", "5"], "kv_heads"),
    (["run", "--model", "gpt-125m:hidden", "--topology", "1x8-nvlink"], "model"),
    (["run", "--model", "gpt-125m:depth=3", "--topology", "1x8-nvlink"], "model"),
    (["run", "--model", "toy-mlp", "--heads", "4"], "heads"),
    (["run", "--params", "7e9"], "params"),
    ([*RUN, "--straggler", "3:2"], "straggler"),
    ([*RUN, "--full", "--straggler", "99:2"], "straggler"),
    ([*RUN, "--full", "--straggler", "1:0.5"], "straggler"),
    ([*RUN, "--full", "--straggler", "one:2"], "straggler"),
    ([*RUN, "--profile", "missing.json"], "profile"),
    ([*RUN, "--ds-config", "missing.json"], "ds_config"),
    ([*RUN, "--trace", "/nonexistent/dir/t.json"], "output"),
    ([*RUN, "--plot", "/nonexistent/dir/p.png"], "output"),
    # memory
    (["memory", "--params", "-7e9"], "params"),
    (["memory", "--params", "seven"], "params"),
    (["memory", "--params", "7e9", "--model", "gpt-1.3b"], "params"),
    (["memory", "--params", "0"], "params"),
    ([*MEMORY, "--dp", "0"], "dp"),
    ([*MEMORY, "--tp", "5"], "tp"),
    ([*MEMORY, "--gpu", "h1000"], "gpu"),
    ([*MEMORY, "--pp", "2", "--offload", "optimizer+params"], "offload"),
    ([*MEMORY, "--recompute", "all"], "recompute"),
    ([*MEMORY, "--global-batch", "7", "--dp", "2"], "global_batch"),
    # collectives and topologies
    (["collective", "--topology", "2x4-ethernet", "--op", "allreduce"], "op"),
    ([*COLLECTIVE, "--group", "ep"], "group"),
    ([*COLLECTIVE, "--sizes", "1K..0"], "sizes"),
    ([*COLLECTIVE, "--sizes", "big"], "sizes"),
    ([*COLLECTIVE, "--sizes", "-1K"], "sizes"),
    ([*COLLECTIVE, "--algorithm", "butterfly"], "algorithm"),
    ([*COLLECTIVE, "--tp", "3"], "tp"),
    (["collective", "--topology", "2x4-nowhere", "--op", "all_reduce"], "topology"),
    (["topology", "3x3-dgx-h100"], "gpus_per_node"),
    (["topology", "2x8-dgx"], "topology"),
    (["topology", "2x8-dgx-h100", "--emit", "/nonexistent/dir/c.yaml"], "output"),
    # calibrate, validate, profile: refused before anything is launched
    (["calibrate", "--device", "tpu"], "device"),
    (["calibrate", "--device", "cpu", "--nproc", "0"], "nproc"),
    (["calibrate", "--device", "cpu", "--name", "cpu-2rank"], "out"),
    (["validate", "--device", "tpu"], "device"),
    (["validate", "--stages", "5"], "stages"),
    (["validate", "--steps", "0"], "steps"),
    (["validate", "--profile", "missing.json"], "profile"),
    (["profile", "missing.json"], "profile"),
]

DS_CONFIGS: list[tuple[str, str]] = [
    ("{not json", "ds_config"),
    ("[1, 2]", "ds_config"),
    ('{"train_batch_size": 8, "zero_optimization": {"stage": 4}}', "zero_optimization.stage"),
    ('{"train_batch_size": 8, "zero_optimization": {"stage": "auto"}}', "stage"),
    ('{"train_batch_size": 8, "zero_optimization": []}', "zero_optimization"),
    ('{"train_batch_size": 9, "train_micro_batch_size_per_gpu": 2}', "train_batch_size"),
    ('{"train_batch_size": -8}', "train_batch_size"),
    ('{"train_batch_size": 8.5}', "train_batch_size"),
    ('{"train_batch_size": "eight"}', "train_batch_size"),
    ('{"train_batch_size": 8, "fp16": {"enabled": true}, "bf16": {"enabled": true}}', "fp16/bf16"),
    (
        '{"train_batch_size": 8, "zero_optimization": {"stage": 2, '
        '"offload_optimizer": {"device": "nvme"}}}',
        "offload_optimizer.device",
    ),
    (
        '{"train_batch_size": 8, "zero_optimization": {"stage": 2, "reduce_bucket_size": -1}}',
        "reduce_bucket_size",
    ),
    (
        '{"train_batch_size": 8, "zero_optimization": {"stage": 3, '
        '"stage3_max_live_parameters": -1}}',
        "stage3_max_live_parameters",
    ),
    (
        '{"train_batch_size": 8, "zero_optimization": {"stage": 2, '
        '"allgather_bucket_size": "auto"}}',
        "allgather_bucket_size",
    ),
    ('{"zero_optimization": {"stage": 1}}', "train_batch_size"),
]

IDEAL = (Path(__file__).parent / "data" / "ideal-8.yaml").read_text()
TOPOLOGY_FILES: list[tuple[str, str]] = [
    ("nodes: [unclosed", "topology"),
    ("- a\n- list", "topology"),
    ("nodes: 2\n", "pcie/loopback"),
    (IDEAL.replace("nodes: 1", "nodes: 0"), "nodes"),
    (IDEAL.replace("nodes: 1\n", ""), "nodes/gpus_per_node"),
    (IDEAL.replace("gpus_per_node: 8", "gpus_per_node: [4, 8]"), "nodes/gpus_per_node"),
    (IDEAL.replace("gpu: a100-80gb", "gpu: a100-81gb"), "gpu"),
    (
        IDEAL.replace(
            "bandwidth_GBps: 1.0e+9\n  latency_us: 0\npcie",
            "bandwidth_GBps: -1\n  latency_us: 0\npcie",
        ),
        "bandwidth_GBps",
    ),
    (IDEAL.replace("rate_Gbps: 100", "rate_Gbps: fast"), "rate_Gbps"),
    (IDEAL.replace("name: nccl", "name: mpi"), "backend"),
    (IDEAL.replace("oversubscription: 1.0", "oversubscription: 0"), "oversubscription"),
]

PROFILES: list[tuple[str, str]] = [
    ("{not json", "profile"),
    ('{"train_batch_size": 8}', "profile"),
    ('{"zsim_profile": 99}', "zsim_profile"),
    ('{"zsim_profile": 1}', "device"),
]


def check(capsys, argv: list[str], needle: str) -> None:
    assert main(argv) == 2, argv
    err = capsys.readouterr().err
    assert err.startswith("zsim: error:"), err
    assert err.count("\n") == 1, err
    assert "Traceback" not in err
    assert needle in err, (needle, err)


def test_the_table_is_large_enough():
    total = len(FLAG_CASES) + len(DS_CONFIGS) + len(TOPOLOGY_FILES) + 2 * len(PROFILES)
    assert len(FLAG_CASES) == len({" ".join(argv) for argv, _ in FLAG_CASES})
    assert total >= 100


@pytest.mark.parametrize(("argv", "needle"), FLAG_CASES, ids=lambda x: " ".join(x)[:60])
def test_bad_flags(capsys, monkeypatch, argv, needle):
    monkeypatch.chdir(Path(__file__).parent.parent)  # calibration/cpu-2rank.json is there
    check(capsys, argv, needle)


@pytest.mark.parametrize(("content", "needle"), DS_CONFIGS)
def test_bad_ds_configs(capsys, tmp_path, content, needle):
    path = tmp_path / "ds_config.json"
    path.write_text(content)
    check(capsys, [*RUN, "--ds-config", str(path)], needle)


@pytest.mark.parametrize(("content", "needle"), TOPOLOGY_FILES)
def test_bad_cluster_files(capsys, tmp_path, content, needle):
    path = tmp_path / "cluster.yaml"
    path.write_text(content)
    check(capsys, ["topology", str(path)], needle)


@pytest.mark.parametrize(("content", "needle"), PROFILES)
@pytest.mark.parametrize("command", ["run", "profile"])
def test_bad_profiles(capsys, tmp_path, content, needle, command):
    path = tmp_path / "profile.json"
    path.write_text(content)
    argv = [*RUN, "--profile", str(path)] if command == "run" else ["profile", str(path)]
    check(capsys, argv, needle)


def test_a_json_file_is_never_partly_written(tmp_path):
    # the error on a bad flag comes before any output: nothing is left behind
    trace = tmp_path / "t.json"
    assert main([*RUN, "--tp", "3", "--trace", str(trace)]) == 2
    assert not trace.exists()
