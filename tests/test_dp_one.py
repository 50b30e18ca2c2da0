"""DeepSpeed 0.19.8 over a data-parallel group of one rank (tensor or pipeline parallelism
alone): the engine takes the same reduction path as at any dp (`_backward_epilogue` ->
`allreduce_gradients`, `runtime/engine.py`), and the gradient norm is all-reduced over the
mpu's model-parallel group as well (`runtime/utils.py` `clip_grad_norm_`). Expected values are
counted from that source, not from zsim: stage 0 flattens the gradients (`allreduce_bucket`:
one copy) and copies them back (`allreduce_and_copy`; the postscale divide is skipped since
gradient_predivide_factor 1.0 equals a world of one), and the norm takes two calls at tp 2."""

from __future__ import annotations

import pytest

from zsim.inputs import presets
from zsim.memory import comm_buffer_bytes
from zsim.step.builder import build_program
from zsim.step.program import Group
from zsim.workload.model import ModelKind, ModelSpec
from zsim.workload.parallel import ParallelConfig

MLP = ModelSpec("toy-mlp", ModelKind.MLP, layers=8, hidden=1024)  # 8 x (1024^2 + 1024)
PARAMS = 8 * (1024 * 1024 + 1024)
A100 = presets.gpu("a100-80gb")


def _passes(cfg: ParallelConfig) -> dict[str, float]:
    """Seconds of each named copy of the stage-0 reduction, on stage 0 of the layout."""
    program = build_program(MLP, cfg, A100, 0)
    return {t.name: t.duration_s for t in program.tasks if "flatten" in t.name}


@pytest.mark.parametrize("tp", [1, 2])
def test_stage_0_copies_its_gradients_at_dp_1_as_at_dp_2(tp: int) -> None:
    one = ParallelConfig(dp=1, tp=tp, zero_stage=0, precision="bf16")
    two = ParallelConfig(dp=2, tp=tp, zero_stage=0, precision="bf16")
    at_one, at_two = _passes(one), _passes(two)
    copy = A100.copy_time_s(2 * PARAMS / tp, "bf16")  # bf16 gradients, this rank's shard
    assert at_one["flatten"] == pytest.approx(copy, rel=1e-3)  # bias shards: a few elements
    assert at_two["flatten"] == pytest.approx(copy, rel=1e-3)
    assert at_one["unflatten_and_scale"] == pytest.approx(copy, rel=1e-3)  # copy back only
    assert at_two["unflatten_and_scale"] == pytest.approx(2 * copy, rel=1e-3)  # divide too


def test_the_norm_is_all_reduced_over_tp_too() -> None:
    cfg = ParallelConfig(dp=1, tp=2, zero_stage=1, precision="bf16")
    norm = [t for t in build_program(MLP, cfg, A100, 0).tasks if t.name.startswith("grad_norm")]
    assert [(t.comm.group, t.comm.nbytes) for t in norm if t.comm] == [(Group.TP, 4)]
    wide = ParallelConfig(dp=2, tp=2, zero_stage=1, precision="bf16")
    norm = [t for t in build_program(MLP, wide, A100, 0).tasks if t.name.startswith("grad_norm")]
    assert [t.comm.group for t in norm if t.comm] == [Group.DP, Group.TP]
    plain = ParallelConfig(dp=2, zero_stage=1, precision="bf16")  # no mpu: one call
    norm = [t for t in build_program(MLP, plain, A100, 0).tasks if t.name.startswith("grad_norm")]
    assert [t.comm.group for t in norm if t.comm] == [Group.DP]


def test_stage_0_holds_its_flattened_bucket_at_dp_1() -> None:
    cfg = ParallelConfig(dp=1, tp=1, zero_stage=0, precision="bf16")
    assert comm_buffer_bytes(MLP, cfg, (), PARAMS) == 2 * PARAMS  # one bf16 copy, < 5e8


def test_zero_3_copies_its_buckets_at_dp_1_as_at_dp_2() -> None:
    """stage3's flush copies into the IPG bucket, and `reduce_scatter_coalesced` interleaves
    and divides at any world size: the same passes before the reduction at dp 1 and dp 2."""

    def prepare(dp: int) -> list[float]:
        cfg = ParallelConfig(dp=dp, zero_stage=3, precision="bf16")
        tasks = build_program(MLP, cfg, A100, 0).tasks
        return [t.duration_s for t in tasks if t.name == "bucket_prepare"]

    assert prepare(1)
    assert prepare(1) == pytest.approx(prepare(2), rel=1e-12)


def test_the_planners_closed_form_pays_the_same_copies() -> None:
    """The planner's fast tier at dp 1, ZeRO-0, tp 2: what it exposes for data parallelism
    is the flatten and the copy back of this rank's bf16 gradients, nothing else."""
    from zsim.plan.estimate import Estimator

    topo = presets.topology("1x2-nvlink")
    cfg = ParallelConfig(dp=1, tp=2, zero_stage=0, precision="bf16")
    estimate = Estimator(MLP, topo, A100).estimate(cfg)
    copy = A100.copy_time_s(2 * PARAMS / 2, "bf16")
    assert estimate.exposed_comm_s == pytest.approx(2 * copy, rel=1e-3)


def test_the_planners_closed_form_copies_zero_1_buckets_as_deepspeed_does() -> None:
    """At dp 2 (one bucket either way) ZeRO-1's reduction copies 3 + 1/2 passes of the
    gradients (into the IPG bucket, the in-place divide, the partition slices; this rank's
    half out) where stage 0 copies 1 + 2 (flatten; divide and copy back): the closed form
    exposes exactly that difference beside the same all-reduce."""
    from zsim.plan.estimate import Estimator

    topo = presets.topology("1x2-nvlink")
    estimator = Estimator(MLP, topo, A100)

    def exposed(stage: int) -> float:
        cfg = ParallelConfig(dp=2, zero_stage=stage, precision="bf16")  # no overlap_comm
        return estimator.estimate(cfg).exposed_comm_s

    grads = 2 * PARAMS
    extra = A100.copy_time_s(3.5 * grads, "bf16") - A100.copy_time_s(3 * grads, "bf16")
    assert exposed(1) - exposed(0) == pytest.approx(extra, rel=1e-6)
