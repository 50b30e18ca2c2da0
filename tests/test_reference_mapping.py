"""The published rows' mapping (benchmarks/reference_mapping.py): a row whose step time and
hardware TFLOP/s disagree through its source's own formula is skipped, not compared."""

import csv
import json
import sys
from pathlib import Path

import pytest

from zsim.cli import main
from zsim.inputs import presets

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

from reference_mapping import FILES, REFERENCE, Skip, gpu_profile, map_row  # noqa: E402

BLOOM = FILES["bloom"]


def _row(row_id: str) -> dict[str, str]:
    with (REFERENCE / BLOOM).open(newline="", encoding="utf-8") as f:
        return next(r for r in csv.DictReader(f) if r["row_id"] == row_id)


def _bigscience_step_s(row: dict[str, str]) -> float:
    """The step BigScience's own TFLOP/s imply (Megatron-DeepSpeed's formula with recompute,
    24 x 4 B s l h^2 (1 + s/6h + V/16lh)), written out here from the row's fields."""
    b, s = float(row["global_batch_size"]), float(row["seq_len"])
    layers, h, v = float(row["num_layers"]), float(row["hidden_size"]), 250880.0
    flops = 96 * b * s * layers * h**2 * (1 + s / (6 * h) + v / (16 * layers * h))
    return flops / (float(row["tflops_per_gpu"]) * 1e12 * float(row["num_gpus"]))


def test_a_probe_whose_step_is_a_quarter_of_its_tflops_step_is_skipped():
    row = _row("training_bloom_3d_zero1-044")
    assert float(row["step_time_s"]) / _bigscience_step_s(row) == pytest.approx(0.25, abs=0.01)
    with pytest.raises(Skip, match=r"disagree \(x0\.25\)"):
        map_row(row, BLOOM)


def test_a_row_whose_two_figures_agree_is_compared_on_its_step_time():
    row = _row("training_bloom_3d_zero1-041")
    assert float(row["step_time_s"]) / _bigscience_step_s(row) == pytest.approx(1.0, abs=0.05)
    case = map_row(row, BLOOM)
    assert case.measured_s == float(row["step_time_s"])
    assert case.measured_from == "step_time_s"


def _fsdp_row(row_id: str) -> dict[str, str]:
    with (REFERENCE / FILES["fsdp"]).open(newline="", encoding="utf-8") as f:
        return next(r for r in csv.DictReader(f) if r["row_id"] == row_id)


def _megatron_row(row_id: str) -> dict[str, str]:
    with (REFERENCE / FILES["megatron"]).open(newline="", encoding="utf-8") as f:
        return next(r for r in csv.DictReader(f) if r["row_id"] == row_id)


@pytest.mark.parametrize(
    ("row_id", "v"),
    [
        ("training_megatron_3d_parallel-056", 2),  # 84 layers / pp 2 = 42 a stage
        ("training_megatron_3d_parallel-057", 23),  # 92 / pp 4 = 23: prime, one layer a chunk
        ("training_megatron_3d_parallel-060", 7),  # 112 / pp 16 = 7
    ],
)
def test_megatron_2024_pipelines_interleave_as_their_overlapped_p2p_implies(row_id, v):
    """The 2024 README overlaps pipeline communication, which Megatron does only when
    interleaving; with no v given, the smallest whose chunks divide a stage's layers."""
    case = map_row(_megatron_row(row_id), FILES["megatron"])
    assert case.parallel.virtual_stages == v
    assert str(case.parallel.pp_schedule) == "interleaved"


def test_tensor_parallel_all_reduce_is_async_only_from_megatron_2021_08():
    old = map_row(_megatron_row("training_megatron_3d_parallel-024"), FILES["megatron"])
    new = map_row(_megatron_row("training_megatron_3d_parallel-055"), FILES["megatron"])
    bloom = map_row(_row("training_bloom_3d_zero1-041"), BLOOM)
    assert (old.parallel.async_tp_allreduce, bloom.parallel.async_tp_allreduce) == (False, False)
    assert new.parallel.async_tp_allreduce


def test_megatron_accumulates_in_grad_only_before_gradient_accumulation_fusion():
    # 83b1e42 (2022-02-13) fused the add into the wgrad GEMM: the 2020-21 README ran before
    old = map_row(_megatron_row("training_megatron_3d_parallel-030"), FILES["megatron"])
    new = map_row(_megatron_row("training_megatron_3d_parallel-055"), FILES["megatron"])
    assert not old.parallel.grad_accumulation_fusion
    assert new.parallel.grad_accumulation_fusion


@pytest.mark.parametrize(
    ("row_id", "gpu", "assumed"),
    [
        # README of 2020-09-11: the only DGX A100 then held 40 GB cards (80 GB came 2020-11-16)
        ("training_megatron_3d_parallel-035", "a100-40gb", "A100 40GB (published before"),
        ("training_megatron_3d_parallel-042", "a100-40gb", "A100 40GB (published before"),
        # Selene, 2021: memory not stated, taken as 80 GB and said so
        ("training_megatron_3d_parallel-026", "a100-80gb", "A100 80GB (memory not stated)"),
    ],
)
def test_an_a100_of_unstated_memory_is_the_card_its_sources_date_allows(row_id, gpu, assumed):
    row = _megatron_row(row_id)
    assert "40" not in row["gpu_type"]
    assert "80" not in row["gpu_type"]
    case = map_row(row, FILES["megatron"])
    assert case.gpu == gpu
    assert any(a.startswith(assumed) for a in case.assumed)


def test_tp_overlap_sms_are_the_runs_own():
    # NeMo 24.05's GPT-3 175B recipe (dgxc-benchmarking gpt3_175b_hydra.yaml): num_sm 24 for
    # proj_fprop and 20 for fc2_fprop (margin on), 4, 8, 2 and 4 for its bulk layers (off)
    nemo = map_row(_megatron_row("training_megatron_3d_parallel-067"), FILES["megatron"])
    assert nemo.parallel.tp_comm_overlap
    assert dict(nemo.parallel.tp_overlap_sms) == {
        "proj_fprop": 24,
        "fc2_fprop": 20,
        "qkv_dgrad": 4,
        "qkv_wgrad": 8,
        "fc1_dgrad": 2,
        "fc1_wgrad": 4,
    }
    # Megatron-Core's 2024 README runs, on TE 1.x: its defaults, 16 a pipeline or bulk kernel
    mcore = map_row(_megatron_row("training_megatron_3d_parallel-055"), FILES["megatron"])
    assert mcore.parallel.tp_comm_overlap
    assert dict(mcore.parallel.tp_overlap_sms) == dict.fromkeys(
        ("proj_fprop", "fc2_fprop", "qkv_dgrad", "qkv_wgrad", "fc1_dgrad", "fc1_wgrad"), 16
    )


def test_an_unstated_precision_is_what_the_source_says_of_its_tests_then():
    # BigScience's chronicles: the tests before "Rebalancing layers" ran fp16 ("from now on
    # the testing is happening with BF16 optimizer ... compared to fp16")
    row = _row("training_bloom_3d_zero1-032")
    assert row["precision"].startswith("not stated")
    case = map_row(row, BLOOM)
    assert str(case.parallel.precision) == "fp16"
    assert any(a.startswith("fp16") for a in case.assumed)


@pytest.mark.parametrize(
    ("row_id", "method"),
    [
        ("training_bloom_3d_zero1-094", "type:transformer"),  # "Another round of NHEADS", 78 l
        ("training_bloom_3d_zero1-117", "type:transformer"),  # "Re-do", 78 layers
        ("training_bloom_3d_zero1-119", "type:transformer|embedding"),  # "Re-do", NLAYERS=106
        ("training_bloom_3d_zero1-134", "type:transformer|embedding"),  # "Rebalancing layers"
        ("training_bloom_3d_zero1-140", "type:transformer|embedding"),  # the README's run
    ],
)
def test_bloom_stages_split_as_bigscience_said_on_the_deepspeed_of_then(row_id, method):
    # chronicles: the Re-do's 106-layer table ran "regex partition_method='type:transformer|
    # embed'", "Rebalancing layers" enabled --pp-partition-method 'type:transformer|embedding'
    case = map_row(_row(row_id), BLOOM)
    assert str(case.parallel.pp_partition) == method
    assert str(case.parallel.pp_balancer) == "bisect"  # DeepSpeed < 0.12.5


@pytest.mark.parametrize(
    ("row_id", "defaulted"),
    [("training_fsdp-226", False), ("training_fsdp-229", True)],
)
def test_torchtitan_rows_run_its_fsdp2_and_its_op_level_ac(row_id, defaulted):
    # docs/performance.md "selective op"; the 2024-12 H100 tables' "Selective" ran the
    # train configs' default, selective_ac_option = 'op'
    case = map_row(_fsdp_row(row_id), FILES["fsdp"])
    assert str(case.parallel.recompute) == "selective-op"
    assert str(case.parallel.dp_engine) == "fsdp"
    assert any("'op'" in a for a in case.assumed) is defaulted


def test_mosaicml_rows_run_llm_foundrys_triton_attention_where_it_has_a_rate():
    # submit_benchmarks.py's --attn_impl triton; the flash-attention figure has that kernel
    # on A100 only, so an H100 row is skipped rather than costed as FlashAttention-2
    rows = {r["row_id"]: r for r in csv.DictReader((REFERENCE / FILES["fsdp"]).open())}
    a100 = map_row(rows["training_fsdp-122"], FILES["fsdp"])
    assert str(a100.parallel.attention_kernel) == "triton"
    with pytest.raises(Skip, match="Triton"):
        map_row(rows["training_fsdp-021"], FILES["fsdp"])


def test_the_grand_teton_h100_is_the_card_torchtitans_docs_state():
    """torchtitan's docs/performance.md: "96GB HBM2e with 2.4 TB/sec peak memory bandwidth";
    the H100 SXM5 datasheet 80 GB at 3.35 TB/s. Same die: the same compute rates (the 500 W
    limit is not modelled), memory at the same fitted fraction of its peak."""
    card, sxm = gpu_profile("h100-hbm2e-500w"), presets.gpu("h100-sxm")
    assert card.memory_bytes == 96 * 2**30
    card_rates, sxm_rates = card.rates["bf16"], sxm.rates["bf16"]
    assert card_rates.memory_bytes_per_s / sxm_rates.memory_bytes_per_s == pytest.approx(
        2400 / 3350
    )
    assert card_rates.gemm_flops_per_s == sxm_rates.gemm_flops_per_s


def test_a_gpu_spec_file_is_read_and_a_bad_one_named(tmp_path, capsys):
    spec = tmp_path / "my-gpu.yaml"
    spec.write_text((REFERENCE / "h100-hbm2e-500w.yaml").read_text().replace("2400", "2000"))
    assert main(["run", "--model", "gpt-350m", "--gpu", str(spec), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["device"] == "h100-hbm2e-500w"
    bad = tmp_path / "bad-gpu.yaml"
    bad.write_text(spec.read_text().replace("efficiency_from: h100-sxm", "efficiency_from: b200"))
    assert main(["run", "--gpu", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "efficiency_from" in err
    assert "h100-sxm" in err
    assert main(["run", "--gpu", str(tmp_path / "none.yaml")]) == 2
    short = tmp_path / "short-gpu.yaml"
    short.write_text("name: x\npeak_TFLOPS: {bf16: 100}\nhbm_GBps: 1000\nmemory_GiB: 10\n")
    assert main(["run", "--gpu", str(short)]) == 2  # neither measured rows nor a donor
    assert "gpu.efficiency_from" in capsys.readouterr().err
