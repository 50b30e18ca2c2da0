"""What a new user hit in the first hour (issue 16), each reproduced through `main()`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zsim.cli import main
from zsim.errors import InputError
from zsim.inputs import presets
from zsim.inputs.scenario import build_parallel
from zsim.simulation import simulate
from zsim.workload.model_presets import preset
from zsim.workload.parallel import ParallelConfig, Precision

DATA = Path(__file__).parent / "data"
HF_ZERO3 = DATA / "hf_trainer_zero3.json"  # the Trainer docs' ZeRO-3 template, "auto" kept


def run_json(capsys, argv: list[str]) -> tuple[int, dict]:
    code = main([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def write(tmp_path: Path, ds: dict) -> str:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(ds))
    return str(path)


# ---- 1. zsim run reads the file's batch -------------------------------------------------

LLAMA_32 = ["run", "--model", "llama-7b", "--topology", "4x8-roce"]
FILE_256 = {
    "train_batch_size": 256,
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 4,
    "zero_optimization": {"stage": 2},
    "bf16": {"enabled": True},
}


def test_run_simulates_the_batch_the_ds_config_gives(capsys, tmp_path):
    code, out = run_json(capsys, [*LLAMA_32, "--ds-config", write(tmp_path, FILE_256)])
    assert code == 0
    p = out["parallel"]
    assert (p["micro_batch"], p["grad_accum"], p["global_batch"]) == (2, 4, 256)


def test_a_file_with_only_train_batch_size_splits_it_as_deepspeed_does(capsys, tmp_path):
    # DeepSpeed: micro = train_batch_size / (world x accum), accum defaulting to 1: 64 / 32 = 2
    _, out = run_json(capsys, [*LLAMA_32, "--ds-config", write(tmp_path, {"train_batch_size": 64})])
    p = out["parallel"]
    assert (p["micro_batch"], p["grad_accum"], p["global_batch"]) == (2, 1, 64)
    assert any("fp32" in note for note in out["notes"])  # no fp16/bf16 section: said so


def test_a_batch_flag_over_the_file_keeps_its_train_batch_size(capsys, tmp_path):
    argv = [*LLAMA_32, "--ds-config", write(tmp_path, FILE_256), "--micro-batch", "4"]
    _, out = run_json(capsys, argv)
    p = out["parallel"]
    assert (p["micro_batch"], p["grad_accum"], p["global_batch"]) == (4, 2, 256)


def test_a_file_without_any_batch_is_refused_as_deepspeed_refuses_it(capsys, tmp_path):
    path = write(tmp_path, {"zero_optimization": {"stage": 1}})
    assert main([*LLAMA_32, "--ds-config", path]) == 2
    assert "train_batch_size" in capsys.readouterr().err


# ---- 2. Hugging Face Trainer templates ----------------------------------------------------


def test_the_trainer_template_is_filled_by_the_trainers_rules():
    # transformers' trainer_config_process / _finalize, llama-7b's hidden h = 4096:
    # reduce_bucket_size h^2, stage3_prefetch_bucket_size int(0.9 h^2), persistence 10 h;
    # the batch from the flags (world = dp = 8), fp16.enabled from --fp16 (here bf16: off)
    flags = {"dp": "8", "micro_batch": "2", "grad_accum": "4", "precision": "bf16"}
    cfg, notes = build_parallel(HF_ZERO3, 4096, **flags)
    assert cfg.knobs.reduce_bucket_size == 16_777_216
    assert cfg.knobs.prefetch_bucket_size == 15_099_494
    assert cfg.knobs.param_persistence_threshold == 40_960
    assert (cfg.micro_batch, cfg.grad_accum, cfg.global_batch) == (2, 4, 64)
    assert cfg.precision is Precision.BF16
    assert cfg.zero_stage == 3
    assert str(cfg.offload) == "optimizer+params"
    assert "reduce_bucket_size=16777216" in notes[0]
    assert "fp16.enabled=False" in notes[0]


def test_the_trainer_template_without_flags_takes_the_trainers_defaults():
    # TrainingArguments: per_device_train_batch_size 8, gradient_accumulation_steps 1, no fp16
    cfg, notes = build_parallel(HF_ZERO3, 4096, dp="8")
    assert (cfg.micro_batch, cfg.grad_accum, cfg.global_batch) == (8, 1, 64)
    assert cfg.precision is Precision.FP32
    assert any("fp32" in note for note in notes)


def test_zsim_run_takes_the_trainer_template_and_says_what_it_filled(capsys):
    argv = ["run", "--model", "llama-7b", "--topology", "1x8-dgx-h100", "--ds-config"]
    code, out = run_json(capsys, [*argv, str(HF_ZERO3), "--micro-batch", "1"])
    assert code in (0, 3)  # runs (fits or not, it is simulated)
    assert out["parallel"]["offload"] == "optimizer+params"
    assert "Hugging Face Trainer" in out["notes"][0]


# ---- 3. offload on GPU presets ------------------------------------------------------------


def test_offload_runs_on_a_gpu_preset_at_its_hosts_cpu_adam_rate():
    # DGX H100 host: 2 sockets x 8 DDR5-4800 channels x 8 bytes = 614.4 GB/s (its spec),
    # shared by 8 GPUs; DeepSpeedCPUAdam streams 28 bytes per parameter (Step_AVX: 4 fp32
    # arrays read, 3 written) at 0.95 of a copy's bandwidth (benchmarks/results/cpu_adam.md)
    rate = 0.95 * 614.4e9 / 8 / 28
    model = preset("gpt-1.3b")
    cfg = ParallelConfig(dp=8, zero_stage=2, offload="optimizer", micro_batch=1)
    report = simulate(model, cfg, presets.topology("1x8-dgx-h100"), presets.gpu("h100-sxm"))
    (adam,) = [s for s in report.engine.all_spans() if s.name == "cpu_adam" and s.rank == 0]
    shard = model.total_params() / 8
    assert adam.end_s - adam.start_s == pytest.approx(shard / rate, rel=1e-3)


# ---- 4. one line and exit 2, never a traceback -------------------------------------------


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (
            "run --pp 2 --pipeline-engine megatron --pp-schedule interleaved --virtual-stages 4",
            "grad_accum=1",
        ),
        ("topology 2x8-dgx-h100 --plot /nonexistent/dir/x.png", "output='/nonexistent/dir/x.png'"),
    ],
)
def test_what_raised_a_traceback_is_one_line(capsys, argv, needle):
    assert main(argv.split()) == 2
    err = capsys.readouterr().err
    assert needle in err
    assert err.count("\n") == 1
    assert "Traceback" not in err


@pytest.mark.parametrize("dp", [16, 3])
def test_simulate_refuses_a_job_that_does_not_fill_its_cluster(dp):
    topo, gpu = presets.topology("1x8-nvlink"), presets.gpu("a100-80gb")
    with pytest.raises(InputError, match="dp x tp x pp"):
        simulate(preset("gpt-125m"), ParallelConfig(dp=dp), topo, gpu)


# ---- 5. the summary adds up ---------------------------------------------------------------

PIPELINE = "run --model gpt-1.3b --topology 2x8-dgx-a100 --pp 8 --tp 2 --grad-accum 16"


def test_a_pipelines_summary_is_one_ranks_and_adds_up_to_the_step(capsys):
    _, out = run_json(capsys, PIPELINE.split())
    parts = out["compute_s"] + out["exposed_comm_s"] + out["bubble_s"]
    assert parts == pytest.approx(out["step_time_s"], rel=1e-9)
    assert out["critical_rank"] in [s["rank"] for s in out["stages"]]
    # the rank that sets the step is one whose work ends with it
    (critical,) = [s for s in out["stages"] if s["rank"] == out["critical_rank"]]
    assert critical["end_s"] == pytest.approx(out["step_time_s"], rel=1e-12)


def test_the_printed_summary_names_the_bottleneck(capsys):
    assert main(PIPELINE.split()) == 0
    text = " ".join(capsys.readouterr().out.split())  # tables wrap at the terminal's width
    assert "Bottleneck:" in text
    assert "the rank that sets it" in text


# ---- 6. a layout that does not fit has its own exit code --------------------------------


def test_an_oom_layout_exits_3_with_its_report(capsys):
    code = main(["run", "--model", "llama-70b", "--topology", "1x8-nvlink", "--stage", "0"])
    assert code == 3
    assert "does NOT fit" in capsys.readouterr().out


def test_memory_with_no_stage_that_fits_exits_3(capsys):
    assert main(["memory", "--params", "1e12", "--dp", "8"]) == 3
    assert "No ZeRO stage fits" in capsys.readouterr().out


def test_a_layout_that_fits_exits_0():
    assert main(["run", "--model", "gpt-125m", "--topology", "1x8-nvlink"]) == 0


# ---- 7. the smaller things -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "meant"),
    [("h100", "h100-sxm"), ("H200", "h200"), ("A100-80GB", "a100-80gb")],
)
def test_gpu_aliases(given, meant):
    assert presets.gpu(given).name == meant


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--topology", "1x8-dgx-a10"], "dgx-a100"),  # the A10 is another GPU, not a prefix
        (["--topology", "1x8-nvlink", "--gpu", "a100-40"], "a100-40gb"),
    ],
)
def test_a_name_cut_inside_a_word_is_not_taken_for_another(capsys, argv, named):
    assert main(["run", "--model", "gpt-125m", *argv]) == 2
    assert f"did you mean {named}" in capsys.readouterr().err


def test_a_typo_is_answered_with_the_closest_names(capsys):
    assert main(["run", "--model", "lama-7b"]) == 2
    assert "did you mean llama-7b" in capsys.readouterr().err


def test_one_model_grammar_for_run_and_memory(capsys):
    _, out = run_json(capsys, ["run", "--model", "gpt-125m:seq-len=1024,layers=6"])
    assert (out["model"]["seq_len"], out["model"]["layers"]) == (1024, 6)
    _, out = run_json(capsys, ["memory", "--model", "gpt-125m:layers=6", "--layers", "4"])
    assert out["model"]["layers"] == 4  # a flag wins over the name's key


@pytest.mark.consistency
def test_an_emitted_cluster_file_is_the_named_cluster(capsys, tmp_path):
    path = tmp_path / "cluster.yaml"
    _, named = run_json(capsys, ["topology", "4x8-dgx-h100-200gbit", "--emit", str(path)])
    _, loaded = run_json(capsys, ["topology", str(path)])
    for key in ("name", "fabric", "emitted"):
        named.pop(key, None)
        loaded.pop(key, None)
    assert loaded == named


def test_piped_tables_keep_their_headers_whole():
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "zsim", "gpus"], capture_output=True, text=True, check=True
    )
    assert "peak_16bit_TFLOPS" in done.stdout
    assert "…" not in done.stdout.splitlines()[2]  # the header row


def test_the_timeline_says_which_ranks_it_shows():
    from zsim.outputs.timeline import timeline

    cfg = ParallelConfig(tp=2, pp=8, grad_accum=8, micro_batch=1)
    report = simulate(
        preset("gpt-1.3b"), cfg, presets.topology("2x8-dgx-a100"), presets.gpu("h100")
    )
    fig = timeline(report.engine.spans, "t", passes=report.engine.passes)
    assert "4 of 8 simulated ranks shown: 0, 4, 10, 14" in fig.axes[0].get_title()
