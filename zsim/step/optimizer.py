"""The end of a step, after the gradients are reduced: the global gradient norm, the Adam step
on this rank's partition (on the device, or on the host with ZeRO-Offload), and the gathers of
the updated parameters (DeepSpeed 0.19)."""

from __future__ import annotations

from zsim.cluster.device import ADAM_STEP_BYTES_PER_PARAM
from zsim.errors import InputError
from zsim.network.collective import CollectiveOp
from zsim.step.job import StageJob
from zsim.step.program import Category, Comm, Group, ProgramWriter, Stream, Task
from zsim.workload.parallel import DpEngine, Offload, ZeroStage

FSDP = DpEngine.FSDP


def grad_norm(job: StageJob, writer: ProgramWriter, deps: list[Task]) -> list[Task]:
    """The global gradient norm: a one-element all-reduce every step (ZeRO 1-2 fp32 as
    compute_grad_norm=True, ZeRO-3 fp64; stage 0 clips with the default
    gradient_clipping=1.0). DeepSpeed's engine all-reduces it over the data-parallel group
    (`runtime/utils.py` `clip_grad_norm_`, the ZeRO optimizers' `get_grad_norm_direct`; over
    one rank too, which returns at once: left out), and with an mpu again over the mpu's
    model-parallel group when that has more than one rank (`_model_parallel_all_reduce`): the
    TP group at pp 1. With pipeline stages that group is the pipeline grid's slice (every
    stage of a replica), which zsim's process groups do not hold: not charged there."""
    cfg = job.cfg
    deepspeed = cfg.dp_engine is DpEngine.DEEPSPEED
    nbytes = 8 if deepspeed and cfg.zero_stage is ZeroStage.PARAMETERS else 4  # FSDP: fp32
    if cfg.dp_cp > 1:
        comm = Comm(CollectiveOp.ALL_REDUCE, nbytes, Group.DP)
        deps = [writer.comm("grad_norm", comm, Category.GRAD_REDUCE, deps)]
    if deepspeed and cfg.has_mpu and cfg.tp > 1 and cfg.pp == 1:
        comm = Comm(CollectiveOp.ALL_REDUCE, nbytes, Group.TP)
        deps = [writer.comm("grad_norm_model_parallel", comm, Category.GRAD_REDUCE, deps)]
    return deps


def optimizer_step(job: StageJob, writer: ProgramWriter, deps: list[Task]) -> list[Task]:
    """The Adam step on this rank's partition (all of it without ZeRO)."""
    cfg = job.cfg
    shard = job.params() / (cfg.shard_ranks if cfg.zero_stage >= ZeroStage.OPTIMIZER else 1)
    if cfg.offload is not Offload.NONE:
        return offloaded_step(job, writer, shard, deps)
    deps = [writer.memory_pass("step_prepare", step_passes(job, shard), deps)]
    seconds = shard * ADAM_STEP_BYTES_PER_PARAM / job.device.optimizer_bytes_per_s
    return [writer.compute("optimizer_step", seconds, Category.OPTIMIZER, deps)]


def step_passes(job: StageJob, shard: float) -> float:
    """Bytes copied around the Adam step on a partition of `shard` elements: the gradient
    norm (a read: half a copy) and the clipping scale with the default gradient_clipping
    = 1.0; ZeRO also flattens the gradients, casts them into an fp32 partition and copies
    the fp32 master back into the 16-bit parameters (`DeepSpeedZeroOptimizer.step`,
    stage3 `_prepare_fp32_grad_for_sub_group`). FSDP's Adam updates its fp32 shard in place."""
    passes = 0.5 * 4 * shard + 4 * shard  # the norm reads, the clip scales in place
    if job.cfg.zero_stage >= ZeroStage.OPTIMIZER and job.cfg.dp_engine is not FSDP:
        d = job.element_bytes
        passes += (d + 4 + d) * shard  # flatten, to fp32, master -> 16-bit
    return passes


def offloaded_step(
    job: StageJob, writer: ProgramWriter, shard: float, deps: list[Task]
) -> list[Task]:
    """ZeRO-Offload: fp32 gradients to the host, CPU Adam, 16-bit parameters back."""
    device = job.device
    link = device.host_link_bytes_per_s
    down = writer.compute("grads_to_host", shard * 4 / link, Category.OFFLOAD, deps, Stream.PCIE)
    rate = device.host_adam_params_per_s
    if rate <= 0:
        raise InputError(
            "profile",
            device.name,
            "a profile with a host Adam rate (calibrate) to simulate offload",
        )
    step = writer.compute("cpu_adam", shard / rate, Category.OPTIMIZER, [down], Stream.HOST)
    seconds = shard * job.element_bytes / link
    return [writer.compute("params_to_device", seconds, Category.OFFLOAD, [step], Stream.PCIE)]


def post_step_gather(job: StageJob, writer: ProgramWriter, deps: list[Task]) -> None:
    """ZeRO-1/2 gather the updated parameters in one all_gather_into_tensor of the padded
    flat group (`all_gather_dp_groups`; allgather_bucket_size only bounds a fallback);
    ZeRO-3 gathers each persistent parameter with its own call (`_post_step`)."""
    cfg, stage, d = job.cfg, job.cfg.zero_stage, job.element_bytes
    if cfg.dp_cp == 1 or stage is ZeroStage.NONE:
        return
    if stage is not ZeroStage.PARAMETERS:
        align = 2 * cfg.dp_cp  # nccl_start_alignment_factor x dp (stage_1_and_2.py:387)
        numel = -(-job.params() // align) * align
        comm = Comm(CollectiveOp.ALL_GATHER, numel * d, Group.DP)
        writer.comm("param_allgather", comm, Category.PARAM_GATHER, deps)
        return
    for t in job.persistent_tensors():
        comm = Comm(CollectiveOp.ALL_GATHER, job.padded(t.per_rank(cfg.tp)) * d, Group.DP)
        writer.comm("persistent_gather", comm, Category.PARAM_GATHER, deps, Stream.GATHER)
