"""The ledger against DeepSpeed's own estimators (deepspeed.runtime.zero), where their
assumptions match, and the documented difference where they do not."""

import pytest

pytest.importorskip("deepspeed", reason="deepspeed is in the calibrate extra")

from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

# both return (cpu_bytes, gpu_bytes[, largest_layer_bytes])
from deepspeed.runtime.zero.stage_1_and_2 import (
    estimate_zero2_model_states_mem_needs,
)

from zsim.memory import ledger
from zsim.workload.model_presets import from_params
from zsim.workload.parallel import Offload, ParallelConfig, ZeroStage

CASES = [(7.5e9, 8, 8), (30e9, 8, 2), (1.3e9, 4, 1)]  # (params, gpus per node, nodes)


@pytest.mark.parametrize(("psi", "per_node", "nodes"), CASES)
def test_zero2_estimator(psi, per_node, nodes):
    n = per_node * nodes
    _, gpu = estimate_zero2_model_states_mem_needs(int(psi), per_node, nodes, cpu_offload=False)
    mine = ledger(from_params(psi), ParallelConfig(dp=n, zero_stage=ZeroStage.GRADIENTS))
    # both replicate the 16-bit parameters (2Ψ)
    assert mine.parameters == 2 * psi
    # DeepSpeed's 18Ψ/N = 2 (16-bit grads) + 12 (master, m, v) + 4 (the fp32 gradient partition
    # its optimizer step creates): the ledger's model states (the paper's 14Ψ/N) + step buffers
    assert mine.step_buffers == 4 * psi / n
    assert gpu - 2 * psi == pytest.approx(
        mine.gradients + mine.optimizer_states + mine.step_buffers, abs=1
    )


@pytest.mark.parametrize(("psi", "per_node", "nodes"), CASES)
def test_zero2_offload_estimator(psi, per_node, nodes):
    n = per_node * nodes
    _, gpu = estimate_zero2_model_states_mem_needs(int(psi), per_node, nodes, cpu_offload=True)
    cfg = ParallelConfig(dp=n, zero_stage=ZeroStage.GRADIENTS, offload=Offload.OPTIMIZER)
    mine = ledger(from_params(psi), cfg)
    # with the optimizer offloaded both keep the 16-bit parameters on the GPU; the ledger also
    # counts the 16-bit gradient partition (2Ψ/N), which the estimator does not
    assert gpu == mine.parameters
    assert mine.optimizer_states == 0


@pytest.mark.parametrize(("psi", "per_node", "nodes"), CASES)
def test_zero3_estimator(psi, per_node, nodes):
    n = per_node * nodes
    largest = int(psi / 100)
    _, gpu, _ = estimate_zero3_model_states_mem_needs(
        int(psi), largest, per_node, nodes, cpu_offload=False, cpu_offload_params=False
    )
    mine = ledger(from_params(psi), ParallelConfig(dp=n, zero_stage=ZeroStage.PARAMETERS))
    # DeepSpeed: 4L (the largest layer's gathered 16-bit weights and gradients) + 18Ψ/N; the
    # ledger's model states are the ZeRO paper's 16Ψ/N: the estimator's extra 2Ψ/N is the
    # 16-bit gradient partition buffer counted once more; gathered weights are comm buffers
    assert gpu == pytest.approx(4 * largest + mine.model_states + 2 * psi / n, abs=1)
    # what stage3.py really builds for the step, one sub-group at a time, the ledger counts as
    # step buffers: an fp32 gradient partition of at most sub_group_size elements
    sub_group = DeepSpeedZeroConfig().sub_group_size
    assert mine.step_buffers == 4 * min(psi / n, sub_group)


@pytest.mark.parametrize(("psi", "per_node", "nodes"), CASES)
@pytest.mark.parametrize("params_too", [False, True])
def test_zero3_offload_estimator(psi, per_node, nodes, params_too):
    # DeepSpeed with the optimizer offloaded: 4L + 2Ψ/N on the GPU (the 16-bit parameter
    # partition: the gradient partition is on the CPU too), 16Ψ/N on the host per GPU before
    # its 1.5x buffer factor (master, m, v and an fp32 gradient partition); with the
    # parameters as well: 4L on the GPU, 18Ψ/N on the host
    n = per_node * nodes
    largest = int(psi / 100)
    cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
        int(psi), largest, per_node, nodes, cpu_offload=True, cpu_offload_params=params_too
    )
    offload = Offload.OPTIMIZER_PARAMS if params_too else Offload.OPTIMIZER
    cfg = ParallelConfig(dp=n, zero_stage=ZeroStage.PARAMETERS, offload=offload)
    mine = ledger(from_params(psi), cfg)
    assert gpu == pytest.approx(4 * largest + mine.model_states, abs=1)
    assert mine.gradients == 0
    assert cpu / 1.5 / per_node == pytest.approx(mine.host_offloaded, rel=1e-9)


# Held by a real DeepSpeed 0.19.8 engine (2 CPU ranks, gloo, fp32, torch Adam) for
# 8 x Linear(1024, 1024): bytes of rank 0's storages after step 2, deduplicated
# (docs/deepspeed-0.19-semantics.md). The engine's scalars (Adam step, norm: 8-13 bytes) are
# not modelled.
TOY = 8 * (1024 * 1024 + 1024)
MEASURED_STEADY = {1: 83_968_008, 2: 83_968_008, 3: 2_084_000_781}
MEASURED_GATHERED_Z3 = 8 * 1024 * 1024 * 4  # end of forward: every weight gathered


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_ledger_matches_engine_held_bytes(stage):
    from zsim.workload.model_presets import preset, with_overrides
    from zsim.workload.parallel import Precision

    model = with_overrides(preset("toy-mlp"), hidden=1024)
    assert model.total_params() == TOY
    cfg = ParallelConfig(dp=2, zero_stage=stage, precision=Precision.FP32, micro_batch=4)
    held = ledger(model, cfg)
    # between steps stages 1-2 hold params + fp32 master + m, v (no gradients); stage 3 also
    # holds its gradient partition buffer and the reduce bucket from initialisation on
    steady = held.parameters + held.optimizer_states
    if stage == 3:
        steady += held.gradients + cfg.knobs.reduce_bucket_size * 4
    assert steady == pytest.approx(MEASURED_STEADY[stage], abs=16)
    if stage == 3:
        assert held.comm_buffers == cfg.knobs.reduce_bucket_size * 4 + MEASURED_GATHERED_Z3


@pytest.mark.parametrize(("items", "parts"), [(70, 12), (96, 16), (24, 5), (3, 3), (7, 2)])
def test_pipeline_split_matches_deepspeed_partition_uniform(items, parts):
    from deepspeed.runtime.utils import partition_uniform

    from zsim.workload.layout import uniform_bounds

    bounds = partition_uniform(items, parts)
    assert [uniform_bounds(items, parts, p) for p in range(parts)] == [
        (bounds[p], bounds[p + 1]) for p in range(parts)
    ]


@pytest.mark.parametrize(("stages", "micro_batches"), [(2, 4), (4, 8), (3, 2), (4, 1), (1, 3)])
def test_pipeline_commands_match_deepspeed_train_schedule(stages, micro_batches):
    from deepspeed.runtime.pipe import schedule as ds

    from zsim.step.pipeline import PipeCommand, deepspeed_train_commands

    names = {
        ds.SendActivation: PipeCommand.SEND_ACTIVATION,
        ds.RecvActivation: PipeCommand.RECV_ACTIVATION,
        ds.SendGrad: PipeCommand.SEND_GRAD,
        ds.RecvGrad: PipeCommand.RECV_GRAD,
        ds.ForwardPass: PipeCommand.FORWARD,
        ds.BackwardPass: PipeCommand.BACKWARD,
    }
    for stage in range(stages):
        sched = ds.TrainSchedule(micro_batches=micro_batches, stages=stages, stage_id=stage)
        theirs = [names[type(c)] for step in sched.steps() for c in step if type(c) in names]
        mine = [c for c, _ in deepspeed_train_commands(stages, micro_batches, stage)]
        assert mine == theirs


# Peaks of the same engine in `zsim validate` (1x2, fp32, micro-batch 4, 2026-11-29): its
# gradient tensors at their largest (stage 2: the fp32 partition; stage 3: the 16-bit-dtype
# partition buffer plus the fp32 partition its step builds) and the bytes autograd saved for one
# micro-batch (each Linear's input and the MSE loss's prediction and target).
MEASURED_GRADIENT_PEAK = {2: 16_793_608, 3: 33_587_216}
MEASURED_SAVED_FOR_BACKWARD = 163_840


@pytest.mark.parametrize("stage", sorted(MEASURED_GRADIENT_PEAK))
def test_ledger_gradients_and_step_buffers_match_engine_peak(stage):
    from zsim.workload.model_presets import preset, with_overrides
    from zsim.workload.parallel import Precision

    model = with_overrides(preset("toy-mlp"), hidden=1024)
    cfg = ParallelConfig(dp=2, zero_stage=stage, precision=Precision.FP32, micro_batch=4)
    held = ledger(model, cfg)
    assert held.gradients + held.step_buffers == pytest.approx(
        MEASURED_GRADIENT_PEAK[stage], abs=16
    )
    assert held.activations == MEASURED_SAVED_FOR_BACKWARD
