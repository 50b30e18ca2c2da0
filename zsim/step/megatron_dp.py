"""Megatron-Core's data parallelism (`megatron/core/distributed`, read at NVIDIA/Megatron-LM
d98e8a6): its DDP gradient buffer and, with `--use-distributed-optimizer` (zsim: ZeRO-1 with
`dp_engine: megatron`), the reduce-scatter of gradients and all-gather of parameters.

- Gradients accumulate into one contiguous `main_grad` buffer (the wgrad GEMM adds into it),
  in fp32 for bf16 training (`arguments.py`: bf16 sets `accumulate_allreduce_grads_in_fp32`),
  else in the parameters' dtype. The buffer is cut into buckets in reverse parameter order
  (`param_and_grad_buffer.py:980-995`: a bucket closes at the parameter that brings it to
  `bucket_size`), `bucket_size = max(4e7, 1e6 x dp)` elements (`distributed_data_parallel.py:
  133-137`); one bucket without `--overlap-grad-reduce` and on every pipeline stage but the
  first (`:170`). With the distributed optimizer a bucket is padded to lcm(dp, 128).
- At the last micro-batch (earlier ones run under `no_sync`), with `--overlap-grad-reduce`,
  a bucket's collective starts when its last gradient is ready (the backward hooks): the
  bucket is scaled by 1/dp in place, then reduce-scattered (distributed optimizer) or
  all-reduced, asynchronously on the data-parallel group's NCCL stream
  (`start_grad_sync`); `finish_grad_sync` waits for all of them before the optimizer.
  Without the overlap, one synchronous call after the backward.
- The distributed optimizer's updated shards are all-gathered per bucket. With
  `--overlap-param-gather` the gathers run in the next step's forward: the first module of a
  bucket waits for its gather (its pre-hook, `finish_param_sync`) and dispatches the next
  bucket's, so one step's forward pays what the gathers do not hide; zsim, simulating one
  step, charges that steady state to this step's first forward. Without it, synchronous
  gathers after the optimizer step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from zsim.network.collective import CollectiveOp
from zsim.step.job import StageJob
from zsim.step.program import Category, Comm, Group, ProgramWriter, Stream, Task
from zsim.workload.model import Layer, ParamTensor
from zsim.workload.parallel import ParallelConfig, Precision, ZeroStage

MIN_BUCKET_NUMEL = 40_000_000
"""`DistributedDataParallel`'s default bucket: max(40,000,000, 1,000,000 x dp) elements."""


def grad_bytes(cfg: ParallelConfig) -> int:
    """Bytes per element of Megatron's gradient buffer (main_grad) and its reductions."""
    return 4 if cfg.precision.compute is Precision.BF16 else cfg.precision.bytes


def chunk_buckets(job: StageJob) -> list[list[list[ParamTensor]]]:
    """The rank's gradient buckets per model chunk (each chunk has a DDP buffer of its own),
    each chunk's in backward (reverse parameter) order. Only the first chunk of the first
    pipeline stage is cut into buckets: later chunks are built with `disable_bucketing`,
    and later stages' are one bucket (`distributed_data_parallel.py:170`)."""
    cfg = job.cfg
    size = max(MIN_BUCKET_NUMEL, 1_000_000 * cfg.dp_cp)
    out: list[list[list[ParamTensor]]] = []
    for c, chunk in enumerate(job.chunks):
        tensors = [t for layer in chunk for t in layer.tensors][::-1]
        if not cfg.overlap_comm or job.stage > 0 or c > 0:
            out.append([tensors] if tensors else [])
            continue
        cut: list[list[ParamTensor]] = [[]]
        numel = 0
        for t in tensors:
            cut[-1].append(t)
            numel += t.per_rank(cfg.tp)
            if numel >= size:
                cut.append([])
                numel = 0
        out.append([b for b in cut if b])
    return out


def buckets(job: StageJob) -> list[list[ParamTensor]]:
    """Every bucket of the rank, chunk by chunk, each chunk's in backward order."""
    return [b for chunk in chunk_buckets(job) for b in chunk]


def bucket_numel(job: StageJob, bucket: Sequence[ParamTensor]) -> int:
    numel = sum(t.per_rank(job.cfg.tp) for t in bucket)
    if job.cfg.zero_stage is ZeroStage.OPTIMIZER:  # the distributed optimizer pads
        align = math.lcm(job.cfg.dp_cp, 128)
        numel = -(-numel // align) * align
    return numel


class MegatronGradSync:
    """Megatron-Core's gradient reductions on one rank (the `GradientReducer` interface)."""

    def __init__(self, job: StageJob, writer: ProgramWriter) -> None:
        self.job = job
        self.writer = writer
        self._buckets = buckets(job)
        self._waiting = [len(b) for b in self._buckets]  # gradients each bucket still lacks
        self._of = {id(t): i for i, b in enumerate(self._buckets) for t in b}
        self._issued: list[Task] = []
        self._hooks = False

    def in_hooks(self, boundary: bool) -> bool:
        return self.job.cfg.dp_cp > 1 and self.job.cfg.overlap_comm and boundary

    def start_backward(self, boundary: bool) -> bool:
        self._hooks = self.in_hooks(boundary)
        return self._hooks

    def pending(self) -> list[Task]:
        """Every reduction issued: `finish_grad_sync` waits for all of them."""
        return list(self._issued)

    def grads_ready(self, layer: Layer, done: Task) -> Task | None:
        for t in layer.tensors:
            i = self._of.get(id(t))
            if i is None:
                continue
            self._waiting[i] -= 1
            if self._waiting[i] == 0:
                self._reduce(i, [done])
        return None

    def flush(self, deps: Sequence[Task] = ()) -> None:
        """Nothing waits in a bucket: each is reduced when its last gradient is ready."""

    def boundary_reduce(self, deps: list[Task]) -> list[Task]:
        """Without --overlap-grad-reduce: one synchronous call after the last backward; with
        it, the compute stream waits for the buckets' calls (`finish_grad_sync`)."""
        if self.job.cfg.dp_cp == 1:
            return deps
        if not self._hooks:
            for i in range(len(self._buckets)):
                deps = [self._reduce(i, deps, Stream.COMPUTE)]
            return deps
        return [*deps, *self._issued]

    def _reduce(self, i: int, deps: list[Task], stream: Stream = Stream.REDUCE) -> Task:
        job, writer = self.job, self.writer
        numel, d = bucket_numel(job, self._buckets[i]), grad_bytes(job.cfg)
        # grad_data *= 1/dp in place: one read and one write of each element, a copy
        scaled = writer.memory_pass("grad_scale", d * numel, deps)
        op = (
            CollectiveOp.REDUCE_SCATTER
            if job.cfg.zero_stage is ZeroStage.OPTIMIZER
            else CollectiveOp.ALL_REDUCE
        )
        comm = Comm(op, numel * d, Group.DP)
        task = writer.comm("grad_reduce", comm, Category.GRAD_REDUCE, [scaled], stream)
        self._issued.append(task)
        return task


class MegatronParamSync:
    """The distributed optimizer's parameter all-gathers, one per bucket, in forward order."""

    def __init__(self, job: StageJob, writer: ProgramWriter) -> None:
        self.job = job
        self.writer = writer
        # forward order: chunk by chunk, each chunk's buckets from its first layers
        per_chunk = chunk_buckets(job)
        self._buckets = [b for chunk in per_chunk for b in reversed(chunk)]
        self._chunk = [c for c, chunk in enumerate(per_chunk) for _ in chunk]
        self._of = {id(t): i for i, b in enumerate(self._buckets) for t in b}
        self._gathers: list[Task] = []
        # interleaved schedules align the stages' gathers (--align-param-gather, Megatron's
        # default there): a chunk's gathers are dispatched by the schedule, not the hooks
        self._aligned = job.cfg.virtual_stages > 1
        self.active = (
            job.cfg.dp_cp > 1
            and job.cfg.zero_stage is ZeroStage.OPTIMIZER
            and job.cfg.overlap_param_gather
        )

    def _comm(self, i: int) -> Comm:
        numel = bucket_numel(self.job, self._buckets[i])
        return Comm(CollectiveOp.ALL_GATHER, numel * self.job.element_bytes, Group.DP)

    def wait(self, layer: Layer, issued: list[Task]) -> list[Task]:
        """What the first forward of `layer` waits for: its bucket's gather. A module's
        pre-hook (`finish_param_sync`) dispatches its bucket's gather if nobody has, waits for
        it and dispatches the next bucket's; ProcessGroupNCCL makes each gather wait for the
        compute `issued` before it."""
        if not self.active or not layer.tensors:
            return []
        i = max(self._of[id(t)] for t in layer.tensors)
        if self._aligned:
            return self._aligned_wait(i, issued)
        while len(self._gathers) <= min(i + 1, len(self._buckets) - 1):
            k = len(self._gathers)
            comm = self._comm(k)
            task = self.writer.comm(
                "param_gather", comm, Category.PARAM_GATHER, issued, Stream.REDUCE
            )
            self._gathers.append(task)
        return [self._gathers[i]]

    def _aligned_wait(self, i: int, issued: list[Task]) -> list[Task]:
        """`forward_backward_pipelining_with_interleaving` dispatches every bucket of chunks 0
        and 1 at the schedule's start and chunk c + 1's at chunk c's first forward
        (schedules.py:1219-1221, 1341-1353; a stage r dispatches it r micro-batches earlier,
        not modelled); the pre-hooks only wait for them."""
        chunk = self._chunk[i]
        for k in range(len(self._gathers), len(self._buckets)):
            if self._chunk[k] > max(1, chunk + 1):
                break
            deps = [] if self._chunk[k] <= 1 else issued
            comm = self._comm(k)
            task = self.writer.comm(
                "param_gather", comm, Category.PARAM_GATHER, deps, Stream.REDUCE
            )
            self._gathers.append(task)
        return [self._gathers[i]]

    def after_step(self, deps: list[Task]) -> list[Task]:
        """Without --overlap-param-gather: synchronous gathers after the optimizer step."""
        cfg = self.job.cfg
        if self.active or cfg.dp_cp == 1 or cfg.zero_stage is not ZeroStage.OPTIMIZER:
            return deps
        for i in range(len(self._buckets)):
            deps = [self.writer.comm("param_allgather", self._comm(i), Category.PARAM_GATHER, deps)]
        return deps
