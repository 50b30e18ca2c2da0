"""Pipelines: the order of a rank's forwards and backwards, and the sends and receives between
stages, as Megatron's schedules (GPipe, 1F1B: blocking p2p; interleaved 1F1B: p2p beside compute)
and DeepSpeed's PipelineEngine (its TrainSchedule; blocking p2p) run them. Without pipelining,
the order is plain gradient accumulation.

A schedule calls `run_pass(work, deps, tag)` for each forward or backward and returns the task
of each pass by tag (`F3c0`: forward of micro-batch 3 on chunk 0).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from zsim.network.collective import CollectiveOp
from zsim.step.job import StageJob
from zsim.step.program import Category, Comm, Group, ProgramWriter, Stream, Task
from zsim.workload.mechanisms import Mechanism
from zsim.workload.parallel import (
    DpEngine,
    ParallelConfig,
    PipelineEngine,
    PipelineSchedule,
    Precision,
    ZeroStage,
)


@dataclass(frozen=True)
class Work:
    """One forward or backward of one micro-batch on one model chunk."""

    forward: bool
    micro_batch: int
    chunk: int


def pipeline_order(cfg: ParallelConfig, stage: int) -> list[Work]:
    """The forward/backward order of one pipeline rank.

    GPipe: all forwards, then all backwards. 1F1B (PipeDream-Flush, Narayanan et al. 2021):
    p - s - 1 warm-up forwards, then one forward and one backward in turn, then cool-down
    backwards. Interleaved 1F1B follows Megatron's
    `forward_backward_pipelining_with_interleaving`: (p - s - 1) * 2 + (v - 1) * p warm-up
    forwards over virtual micro-batches, model chunk k // p % v (reversed for backward).
    """
    p, m, v = cfg.pp, cfg.grad_accum, cfg.virtual_stages
    if p == 1:  # gradient accumulation: one micro-batch after the other
        return [Work(f, i, 0) for i in range(m) for f in (True, False)]
    if cfg.pp_schedule is PipelineSchedule.GPIPE:
        return [Work(True, i, 0) for i in range(m)] + [Work(False, i, 0) for i in range(m)]
    total = m * v

    def unit(k: int, forward: bool) -> Work:
        chunk = k // p % v
        group = k // (p * v)
        return Work(forward, group * p + k % p, chunk if forward else v - 1 - chunk)

    warmup = min(total, (p - stage - 1) * (2 if v > 1 else 1) + (v - 1) * p)
    order = [unit(k, True) for k in range(warmup)]
    for k in range(total - warmup):
        order += [unit(warmup + k, True), unit(k, False)]
    order += [unit(k, False) for k in range(total - warmup, total)]
    return order


class PipeCommand(StrEnum):
    SEND_ACTIVATION = "send_activation"
    RECV_ACTIVATION = "recv_activation"
    SEND_GRAD = "send_grad"
    RECV_GRAD = "recv_grad"
    FORWARD = "forward"
    BACKWARD = "backward"


def deepspeed_train_commands(p: int, m: int, stage: int) -> list[tuple[PipeCommand, int]]:
    """DeepSpeed's `TrainSchedule.steps` (deepspeed/runtime/pipe/schedule.py), flattened:
    2(m + p - 1) lock-step steps; even stages run forwards on even steps, odd stages on odd
    ones; each step first exchanges the previous step's output, then computes."""

    def micro_batch(step: int) -> tuple[int, bool]:
        forward = (step % 2) == (stage % 2)
        if forward:
            return (step - stage % 2) // 2 - stage // 2, True
        if step % 2 == 0:  # even step on an odd stage
            return step // 2 - p + (stage + 1) // 2, False
        return (step - 1) // 2 - p + 1 + stage // 2, False

    def valid(mb: int) -> bool:
        return 0 <= mb < m

    out: list[tuple[PipeCommand, int]] = []
    previous = -1
    for step in range(2 * (m + p - 1)):
        mb, forward = micro_batch(step)
        if forward:
            if valid(previous) and stage > 0:
                out.append((PipeCommand.SEND_GRAD, previous))
            if valid(mb) and stage > 0:
                out.append((PipeCommand.RECV_ACTIVATION, mb))
        else:
            if valid(mb) and stage < p - 1:
                out.append((PipeCommand.RECV_GRAD, mb))
            if valid(previous) and stage < p - 1:
                out.append((PipeCommand.SEND_ACTIVATION, previous))
        if valid(mb):
            out.append((PipeCommand.FORWARD if forward else PipeCommand.BACKWARD, mb))
        previous = mb
    return out


RunPass = Callable[[Work, list[Task], str], Task]


def _tag(work: Work) -> str:
    return f"{'F' if work.forward else 'B'}{work.micro_batch}c{work.chunk}"


def megatron_blocks(cfg: ParallelConfig) -> bool:
    """Whether Megatron's p2p blocks its schedule. Without interleaving it always does:
    `p2p_communication._communicate` batches the isend/irecv, waits on them and calls
    `torch.cuda.synchronize()` (batch_p2p_sync; Megatron-LM since 2021-01, e3e5ea8, and
    Megatron-Core, core_r0.8.0 to today), as `arguments.py` turns `overlap_p2p_comm` off
    there. Interleaved schedules overlap their p2p with compute (`--overlap-p2p-communication`,
    Megatron-LM's default: waited for only before the pass that needs it). One stage sends
    nothing."""
    return cfg.pp > 1 and cfg.virtual_stages == 1 and cfg.models(Mechanism.BLOCKING_P2P)


def megatron_schedule(job: StageJob, writer: ProgramWriter, run_pass: RunPass) -> dict[str, Task]:
    """Megatron's pipeline steps in `pipeline_order`: receive, compute, then send; the send
    on the compute stream where Megatron's p2p blocks (`megatron_blocks`), else beside it.
    Not modelled: a send waiting for its receiver to post the matching receive."""
    p, v, act = job.cfg.pp, job.cfg.virtual_stages, job.activation_bytes()
    stream = Stream.COMPUTE if megatron_blocks(job.cfg) else Stream.P2P
    ready: dict[str, Task] = {}
    sent: list[Task] = []  # a blocking send the next pass waits for
    for work in pipeline_order(job.cfg, job.stage):
        writer.micro_batch(work.micro_batch)
        virtual = work.chunk * p + job.stage
        tag = _tag(work)
        deps, sent = sent, []
        first, last = virtual == 0, virtual == p * v - 1
        if work.forward and not first:
            deps.append(writer.recv(f"act{work.micro_batch}v{virtual}", act, -1))
        if not work.forward:
            deps.append(ready[f"F{work.micro_batch}c{work.chunk}"])
            if not last:
                deps.append(writer.recv(f"grad{work.micro_batch}v{virtual}", act, +1))
        done = run_pass(work, deps, tag)
        ready[tag] = done
        if work.forward and not last:
            sent = [writer.send(f"act{work.micro_batch}v{virtual + 1}", act, +1, [done], stream)]
        if not work.forward and not first:
            sent = [writer.send(f"grad{work.micro_batch}v{virtual - 1}", act, -1, [done], stream)]
        sent = sent if stream is Stream.COMPUTE else []
    writer.micro_batch(-1)
    return ready


def pipe_partitions(cfg: ParallelConfig) -> int:
    """The parts a pipeline message is sent in: with model parallelism DeepSpeed's
    PipelineEngine (`is_pipe_partitioned`, `is_grad_partitioned`: the config's
    `pipe_partitioned` and `grad_partitioned`, True by default) has each TP rank send its
    1/tp (`PartitionedTensor`); Megatron's schedules send whole messages."""
    deepspeed = cfg.pipeline_engine is PipelineEngine.DEEPSPEED
    return cfg.tp if deepspeed and cfg.models(Mechanism.PIPE_PARTITIONED) else 1


def partition_copies_s(job: StageJob) -> tuple[float, float]:
    """DeepSpeed's `PartitionedTensor` (deepspeed/runtime/utils.py) beside its all-gather:
    `full()` zero-fills the whole message and clones it (1.5 copies' worth of memory
    traffic); the sender's `_partition_tensor` clones its 1/tp."""
    act, copy = job.activation_bytes(), job.device.copy_time_s
    return 1.5 * copy(act, job.dtype), copy(act / pipe_partitions(job.cfg), job.dtype)


class _Partitioned:
    """DeepSpeed's partitioned messages on the compute stream: `full()` all-gathers the
    message over the TP group, then its copies (`partition_copies_s`). Where TP collectives
    take a fixed time (`tp_time`, as in fused passes), the `count` full()s in a row are one
    task of that time."""

    def __init__(
        self, job: StageJob, writer: ProgramWriter, tp_time: Callable[[Comm], float] | None
    ) -> None:
        self.writer, self.parts, self.act = writer, pipe_partitions(job.cfg), job.activation_bytes()
        self.full_s, self.part_s = partition_copies_s(job)
        self.gather = Comm(CollectiveOp.ALL_GATHER, self.act, Group.TP)
        self.fixed_s: float | None = None  # no gathers without partitions
        if tp_time is not None and self.parts > 1:
            self.fixed_s = tp_time(self.gather) + self.full_s

    def full(self, tag: str, deps: list[Task], count: int = 1) -> list[Task]:
        if self.parts == 1:
            return deps
        if self.fixed_s is not None:
            return [
                self.writer.compute(f"{tag}.full", count * self.fixed_s, Category.PP_COMM, deps)
            ]
        for k in range(count):
            task = self.writer.comm(f"{tag}.full{k}", self.gather, Category.PP_COMM, deps)
            deps = [
                self.writer.compute(f"{tag}.full{k}_copy", self.full_s, Category.PP_COMM, [task])
            ]
        return deps

    def split(self, tag: str, deps: list[Task]) -> list[Task]:
        if self.parts == 1:
            return deps
        return [self.writer.compute(f"{tag}.partition", self.part_s, Category.PP_COMM, deps)]


def deepspeed_schedule(
    job: StageJob,
    writer: ProgramWriter,
    run_pass: RunPass,
    tp_time: Callable[[Comm], float] | None = None,
) -> dict[str, Task]:
    """DeepSpeed's PipelineEngine: the instructions of its TrainSchedule, run one after
    the other; its p2p sends block (`p2p.send`: dist.send / broadcast, async_op=False).
    With TP a message is partitioned (`pipe_partitions`): a middle stage gathers its input
    before the forward, its output again and the received gradient before the backward."""
    s, last = job.stage, job.stage == job.cfg.pp - 1
    part = _Partitioned(job, writer, tp_time)
    message = part.act / part.parts
    ready: dict[str, Task] = {}
    cursor: list[Task] = []
    blocking = job.cfg.models(Mechanism.BLOCKING_P2P)  # off: sends run beside compute

    host = job.engine_host_s("send")  # the engine's own Python around each send (CPU ranks)

    def send(tag: str, peer: int) -> list[Task]:
        deps = (
            [writer.compute(f"{tag}.engine_host", host, Category.PP_COMM, cursor)]
            if host
            else cursor
        )
        task = writer.send(tag, message, peer, deps, Stream.COMPUTE if blocking else Stream.P2P)
        return [task] if blocking else deps

    for command, mb in deepspeed_train_commands(job.cfg.pp, job.cfg.grad_accum, s):
        writer.micro_batch(mb)
        if command is PipeCommand.RECV_ACTIVATION:
            cursor = [*cursor, writer.recv(f"act{mb}v{s}", message, -1)]
        elif command is PipeCommand.RECV_GRAD:
            cursor = [*cursor, writer.recv(f"grad{mb}v{s}", message, +1)]
        elif command is PipeCommand.SEND_ACTIVATION:
            cursor = send(f"act{mb}v{s + 1}", +1)
        elif command is PipeCommand.SEND_GRAD:
            cursor = send(f"grad{mb}v{s - 1}", -1)
        else:
            work = Work(command is PipeCommand.FORWARD, mb, 0)
            tag = _tag(work)
            deps = cursor if work.forward else [*cursor, ready[f"F{mb}c0"]]
            if work.forward and s > 0:  # the received input
                deps = part.full(f"{tag}.input", deps)
            if not work.forward and not last:  # its output, then the received gradient
                deps = part.full(f"{tag}.output_and_grad", deps, count=2)
            ready[tag] = run_pass(work, deps, tag)
            keeps = (work.forward and not last) or (not work.forward and s > 0)
            cursor = part.split(tag, [ready[tag]]) if keeps else [ready[tag]]
    writer.micro_batch(-1)
    return ready


def bf16_optimizer(cfg: ParallelConfig) -> bool:
    """DeepSpeed's pipeline engine with bf16 trains through BF16_Optimizer."""
    return (
        cfg.pp > 1
        and cfg.pipeline_engine is PipelineEngine.DEEPSPEED
        and cfg.precision is Precision.BF16
        and cfg.dp_engine is DpEngine.DEEPSPEED
    )


def accumulates_in_fp32(cfg: ParallelConfig) -> bool:
    """BF16_Optimizer adds every micro-batch's bf16 gradients into fp32 ones
    (`_update_hp_grad`): read 2 + 4, write 4 bytes per parameter of the stage."""
    return bf16_optimizer(cfg) and cfg.models(Mechanism.FP32_GRAD_ACCUMULATE)


def accumulates_in_grad(cfg: ParallelConfig, micro_batch: int) -> bool:
    """Autograd adds a later micro-batch's gradients into `.grad` in place (AccumulateGrad:
    read both, write one) where DeepSpeed keeps them there until the boundary: ZeRO-0 and
    ZeRO-1 (stage_1_and_2.py `reduce_ready_partitions_and_remove_grads` removes them at the
    boundary only), in its engine and its pipeline, but not through BF16_Optimizer's fp32
    accumulation nor in Megatron's pipelines with gradient accumulation fusion (the wgrad
    GEMM adds into main_grad). Without it (`grad_accumulation_fusion` off), Megatron-LM's
    local DDP before 2022-02 left the gradients to autograd too (`megatron/model/
    distributed.py` at b84d7a9, 2020-12-26: it all-reduces `param.grad` at the end)."""
    megatron_pipeline = cfg.pp > 1 and cfg.pipeline_engine is PipelineEngine.MEGATRON
    return (
        micro_batch > 0
        and cfg.zero_stage <= ZeroStage.OPTIMIZER
        and cfg.dp_engine is DpEngine.DEEPSPEED
        and not (megatron_pipeline and cfg.grad_accumulation_fusion)
        and not bf16_optimizer(cfg)  # it frees the bf16 gradients after each micro-batch
        and cfg.models(Mechanism.GRAD_ACCUMULATE)
    )


def tied_embedding_reduce(job: StageJob, writer: ProgramWriter, deps: list[Task]) -> list[Task]:
    """Megatron all-reduces the tied word embedding's gradient between the first and last
    pipeline stage before the optimizer step (a model without one, the seeds' MLP, has no
    tied weights: DeepSpeed's `allreduce_tied_weight_gradients` then calls nothing)."""
    m, cfg = job.model, job.cfg
    tied = m.tied_embeddings and m.vocab > 0
    if cfg.pp == 1 or not tied or job.stage not in (0, cfg.pp - 1):
        return deps
    numel = -(-m.vocab // cfg.tp) * m.hidden
    comm = Comm(CollectiveOp.ALL_REDUCE, numel * job.element_bytes, Group.EMBEDDING)
    return [writer.comm("tied_embedding_allreduce", comm, Category.GRAD_REDUCE, deps)]
