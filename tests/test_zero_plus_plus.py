"""ZeRO++'s hpZ and qwZ (issue 18), against the ZeRO++ paper (Wang et al. 2023: qwZ halves the
parameter all-gather's bytes, int8 for fp16; hpZ keeps the backward's all-gather inside the
secondary group, for a secondary partition of the parameters over it) and DeepSpeed 0.19.8's
source (partition_parameters.py: one fp32 scale per group of at most 8,000 elements; the
secondary tensor is aligned_numel // h elements in the parameters' dtype, partition_parameters
.py:1912; it is freed after every optimizer step, stage3.py `invalidate_secondary_tensor`, so
the first forward after a step gathers over all data-parallel ranks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zsim.cli import main
from zsim.inputs import presets
from zsim.inputs.scenario import build_model
from zsim.simulation import Report, simulate
from zsim.step.zero3 import quantizer_groups
from zsim.workload.ds_config import from_ds_config, to_ds_config
from zsim.workload.parallel import ParallelConfig, ZeroKnobs

# every module gathered at each of its uses (no prefetch, nothing persistent or kept), so a
# micro-step's backward gathers mirror its forward's: the paper's accounting
EVERY_USE = {"max_reuse_distance": 0, "param_persistence_threshold": 0, "prefetch_bucket_size": 0}
# Megatron's padded vocabulary (a multiple of 128), whose shards split into groups near 8,000
# elements (GPT-2's 50,257 = 29 x 1,733 gives the embedding groups of 928: 0.2 % of scales)
MODEL = build_model("gpt-350m", vocab="50304")


def _step(accum: int = 1, every_use: bool = True, **knobs: object) -> Report:
    topo, gpu = presets.topology("4x8-ethernet"), presets.gpu("a100-80gb")
    cfg = ParallelConfig(
        dp=32,
        zero_stage=3,
        micro_batch=2,
        grad_accum=accum,
        knobs=ZeroKnobs(**(EVERY_USE if every_use else {}), **knobs),  # type: ignore[arg-type]
    )
    return simulate(MODEL, cfg, topo, gpu)


def _across_nodes(accum: int = 1, **knobs: object) -> float:
    return _step(accum, **knobs).link_traffic_bytes["ethernet"]  # nodes meet only there


def test_qwz_halves_the_bytes_each_gpu_gathers_plus_its_scales():
    # DeepSpeed's defaults: small parameters stay whole (persistent; gathered once after the
    # step, not quantized), the coordinator's gathers are of shards of thousands of elements.
    # What a micro-step adds is its gathers: int8 for fp16, plus a 4-byte scale per group of
    # at most 8,000 elements (at least 1,000 here: at most 0.2 % of the fp16 bytes)
    def gathered(accum: int, **knobs: object) -> float:
        report = _step(accum, every_use=False, **knobs)
        return report.traffic_bytes_per_gpu["param_gather"]

    plain = gathered(2) - gathered(1)
    quantized = gathered(2, quantized_weights=True) - gathered(1, quantized_weights=True)
    assert 0.5 < quantized / plain < 0.5 * (1 + 4 / 1000)


def test_quantization_groups_follow_deepspeed():
    assert quantizer_groups(8000) == 1
    assert quantizer_groups(8008) == 7  # the fewest above 8008/8000 that split it into 8s
    assert quantizer_groups(64_000) == 8
    assert quantizer_groups(24) == 1


def test_hpz_keeps_only_the_first_forwards_gathers_between_nodes():
    # across nodes per micro-step: F (forward gathers), B (backward gathers), R (reduce-
    # scatters). Plain ZeRO-3 pays m (F + B + R); with hpZ over a node only the first forward
    # after a step gathers across nodes: F + m R
    plain_1, plain_2 = _across_nodes(1), _across_nodes(2)
    hpz_1, hpz_2 = _across_nodes(1, hpz_partition_size=8), _across_nodes(2, hpz_partition_size=8)
    assert plain_2 == pytest.approx(2 * plain_1, rel=1e-6)
    reduce = hpz_2 - hpz_1  # the second micro-step gathers nothing across nodes
    forward, backward = hpz_1 - reduce, plain_1 - hpz_1
    assert backward > 0
    assert forward == pytest.approx(backward, rel=0.02)  # a backward re-gathers what was used
    # and qwZ halves both (its scales aside)
    saved = plain_1 - _across_nodes(1, quantized_weights=True)
    assert 0.49 < saved / (forward + backward) <= 0.5


def test_hpz_holds_a_secondary_partition_of_the_parameters_over_its_group():
    plain, hpz = _step().memory, _step(hpz_partition_size=8).memory
    params_fp16 = plain.parameters * 32  # the primary partition is 1/dp of them
    assert hpz.parameters - plain.parameters == pytest.approx(params_fp16 / 8, rel=1e-12)


def test_zero_plus_plus_keys_round_trip_through_a_ds_config():
    ds = {
        "train_batch_size": 64,
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {
            "stage": 3,
            "zero_hpz_partition_size": 8,
            "zero_quantized_weights": True,
        },
    }
    cfg = from_ds_config(ds, dp=32)
    assert (cfg.knobs.hpz_partition_size, cfg.knobs.quantized_weights) == (8, True)
    zero = to_ds_config(cfg)["zero_optimization"]
    assert (zero["zero_hpz_partition_size"], zero["zero_quantized_weights"]) == (8, True)


def test_the_emitted_zero_plus_plus_keys_are_deepspeeds():
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    cfg = ParallelConfig(dp=32, zero_stage=3, knobs=ZeroKnobs(hpz_partition_size=8))
    zero = DeepSpeedZeroConfig(**to_ds_config(cfg)["zero_optimization"])
    assert zero.zero_hpz_partition_size == 8


@pytest.mark.parametrize(
    ("key", "value", "said"),
    [
        ("mics_shard_size", 8, "DeepSpeed 0.19.8 removed MiCS"),
    ],
)
def test_keys_zsim_does_not_simulate_are_refused_in_one_line(
    key: str, value: object, said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ds = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3, key: value}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    code = main(
        ["run", "--topology", "1x8-nvlink", "--model", "gpt-125m", "--ds-config", str(path)]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert key in err
    assert said in err
    assert err.count("\n") == 1


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--hpz", "3"], "a divisor of dp=8"),
        (["--hpz", "2", "--tp", "2"], "1 with tp or pp > 1"),
    ],
)
def test_hpz_groups_deepspeed_cannot_build_are_refused(
    flags: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["run", "--topology", "1x8-nvlink", "--model", "gpt-125m", "--stage", "3", *flags]
    assert main(argv) == 2
    assert said in capsys.readouterr().err


@pytest.mark.parametrize("key", ["zero_quantized_weights", "overlap_comm"])
def test_a_switch_given_as_a_string_is_refused_not_read_as_true(
    key: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ds = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3, key: "no"}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    argv = ["run", "--topology", "1x8-nvlink", "--model", "gpt-125m", "--ds-config", str(path)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"zero_optimization.{key}='no'" in err
    assert "true or false" in err
