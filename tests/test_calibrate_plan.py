"""What a calibration measures (the plan, its launches and rounds) and how rows merge across
rounds and launches; the residual counts; the multi-node launch."""

import json

import pytest

from tests.calibrate_synthetic import row_of
from zsim.calibrate.fit import residuals
from zsim.calibrate.measurement import Kind, Measurement, merge, merge_launches
from zsim.calibrate.plan import Plan, default_plan, layer_tp_degrees
from zsim.errors import InputError
from zsim.workload.model_presets import preset, with_overrides


@pytest.mark.consistency
def test_plan_survives_json():
    model = with_overrides(preset("gpt-125m"), layers=2, seq_len=128)
    plan = default_plan(
        "cpu",
        "fp32",
        (model, preset("toy-mlp")),
        (1, 2),
        quick=False,
        topology="1x2-cpu",
        link_classes={"intra": "loopback"},
        tp_degrees=(1, 2),
    )
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    # the model's own GEMMs, forward and backward, are in the sweep
    assert (128, 2304, 768, 1) in plan.gemm_shapes
    assert (768, 2304, 128, 1) in plan.gemm_shapes  # the qkv weight gradient


def test_tp_shards_add_megatrons_split_gemms_and_only_where_tp_divides():
    """Megatron splits qkv's and fc1's outputs and fc2's input by tp: at tp 2 one rank's qkv
    is (tokens, 3 h / 2, h) and its fc2 (tokens, h, f / 2)."""
    model = with_overrides(preset("gpt-125m"), layers=2, seq_len=128)
    assert layer_tp_degrees(model, (1, 2, 5)) == (1, 2)  # 5 divides neither 12 heads nor 3072
    assert layer_tp_degrees(preset("toy-mlp"), (1, 2)) == (1,)
    whole = default_plan("cpu", "fp32", (model,), (1,), quick=True).gemm_shapes
    split = default_plan("cpu", "fp32", (model,), (1,), quick=True, tp_degrees=(2,)).gemm_shapes
    for shard in ((128, 3 * 768 // 2, 768, 1), (128, 768, 3072 // 2, 1)):
        assert shard in split
        assert shard not in whole


def test_launches_share_the_plans_rounds_samples_and_time():
    plan = default_plan("cpu", "fp32", (), (1,), quick=False)
    assert plan.launches == 3  # CPU: placement differs from process to process
    assert default_plan("cuda", "bf16", (), (1,), quick=False).launches == 1
    assert default_plan("cpu", "fp32", (), (1,), quick=True).launches == 1
    one = plan.per_launch()
    assert one.launches == 1
    assert one.rounds * plan.launches == plan.rounds
    assert one.repeats * plan.launches >= plan.repeats
    assert one.max_repeats * plan.launches >= plan.max_repeats
    assert one.max_row_s * plan.launches == pytest.approx(plan.max_row_s)
    # more launches than rounds: every launch still runs one round
    many = default_plan("cpu", "fp32", (), (1,), quick=False, launches=5)
    assert many.per_launch().rounds == 1
    assert many.rounds == 5


def test_a_gpu_plan_reaches_the_regimes_its_models_are_fitted_in():
    # An H200: 60 MB of L2 (PyTorch's reading on the lent machines, device library KINDS.md)
    # and bf16 GEMMs at their top rate from 8192^3 on (ibid.: 769-798 TFLOP/s there).
    h200_l2 = 60e6
    plan = default_plan("cuda", "bf16", (), (1,), quick=False)
    dram = [b for b in plan.memory_sizes_bytes if b >= 4 * h200_l2]
    assert len(dram) >= 2  # a rate and an overhead need two sizes in the DRAM regime
    assert (8192, 8192, 8192, 1) in plan.gemm_shapes
    cpu = default_plan("cpu", "fp32", (), (1,), quick=False)
    assert max(s[0] for s in cpu.gemm_shapes if s[0] == s[1] == s[2]) == 2048  # ~0.2 s here


def test_merge_appends_the_samples_of_the_same_rows():
    def row(op: str, *samples: float) -> Measurement:
        return Measurement(Kind.MEMORY, op, "fp32", samples, size_bytes=1024)

    first = [row("add", 1.0, 2.0), row("copy", 3.0)]
    merged = merge(merge([], first), [row("add", 4.0), row("copy", 5.0, 6.0)])
    assert [m.samples_s for m in merged] == [(1.0, 2.0, 4.0), (3.0, 5.0, 6.0)]
    with pytest.raises(InputError, match="the same rows"):
        merge(first, [row("copy", 1.0), row("add", 1.0)])


def test_merged_launches_keep_each_launchs_mean():
    launches = [
        [row_of(1.0, 3.0), row_of(7.0)],
        [row_of(2.0), row_of(8.0, 9.0)],
        [row_of(4.0, 5.0), row_of(6.0)],
    ]
    add, other = merge_launches(launches)
    assert add.samples_s == (1.0, 3.0, 2.0, 4.0, 5.0)
    assert add.launch_samples == (2, 1, 2)
    assert add.launch_times_s == (2.0, 2.0, 4.5)
    assert other.launch_times_s == (7.0, 8.5, 6.0)
    assert Measurement.from_dict(add.to_dict()) == add
    (one,) = merge_launches([[row_of(1.0, 2.0)]])
    assert one.launch_samples == ()
    assert one.launch_times_s == (1.5,)
    assert "launch_samples" not in one.to_dict()  # as every profile before the field
    bad = dict(add.to_dict(), launch_samples=[2, 2])
    with pytest.raises(InputError, match="launch_samples"):
        Measurement.from_dict(bad)


def test_launches_agree_when_one_time_is_within_10_percent_of_each():
    def launches(*medians: float) -> Measurement:
        return merge_launches([[row_of(m)] for m in medians])[0]

    assert launches(1.0, 1.2).launches_agree  # 1.1 is within 10 % of both
    assert not launches(1.0, 1.25).launches_agree  # apart by more than 1.1 / 0.9
    assert launches(1.0, 1.2, 1.1).launches_agree
    assert row_of(1.0, 9.0).launches_agree is None  # one launch: nothing to compare


def test_residuals_count_the_rows_over_10_percent_and_the_unrepeatable_ones():
    steady = merge_launches([[row_of(1.0)], [row_of(1.0)]])[0]
    jumpy = merge_launches([[row_of(1.0)], [row_of(2.0)]])[0]  # median 1.5
    rows = [steady, steady, jumpy]
    (group,) = residuals(rows, {0: 1.05, 1: 1.2, 2: 1.0}, frozenset({0, 1, 2}))
    assert (group.rows, group.over, group.over_launches_disagree) == (3, 2, 1)
    (single,) = residuals([row_of(1.0)], {0: 2.0}, frozenset({0}))
    assert (single.over, single.over_launches_disagree) == (1, None)


def test_every_node_of_a_multi_node_calibration_names_the_same_port(tmp_path):
    from zsim.calibrate.runner import Launch, worker_argv

    def port(launch):
        argv = worker_argv(launch, tmp_path / "plan.json", tmp_path / "raw.json")
        return next(a for a in argv if a.startswith("--master_port="))

    nodes = [Launch(nproc=2, nnodes=2, node_rank=r, master_addr="10.0.0.1") for r in (0, 1)]
    assert port(nodes[0]) == port(nodes[1]) == "--master_port=29500"  # torchrun's default
    assert port(Launch(nproc=2, master_port=1234)) == "--master_port=1234"
