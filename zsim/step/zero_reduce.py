"""DeepSpeed's gradient reduction over the data-parallel group, per ZeRO stage (0.19):

- stage 0: `DeepSpeedEngine.allreduce_gradients` all-reduces all gradients after the backward
  of the last micro-batch, in buckets of `STAGE0_ALLREDUCE_BUCKET_NUMEL` elements
  (`buffered_allreduce_fallback`), on the compute stream;
- stage 1: `DeepSpeedZeroOptimizer.reduce_gradients` at the accumulation boundary only, in
  reduce_bucket_size buckets (with overlap_comm, in the backward hooks of that micro-batch);
- stage 2: the same buckets are reduced during every micro-batch's backward, as gradients become
  ready (`reduce_independent_p_g_buckets_and_remove_grads`), on the reduction stream when
  overlap_comm is on;
- stage 3: gradients are reduce-scattered in reduce_bucket_size buckets during every backward.

Stages 0-2 run all of it on a data-parallel group of one rank as well (tensor or pipeline
parallelism alone): the engine has no shortcut for it, so the bucket copies are paid
(`engine.allreduce_gradients` at dp 1 took 14 ms of a 1x2 GPT step at tp 2,
`benchmarks/validation/README.md`); the collectives over one rank return at once and are left
out (their call latency: 0.07 ms on `cpu-2rank`). ZeRO-3 too: `reduce_scatter_coalesced`
interleaves and divides whatever the world size (`runtime/comm/coalesced_collectives.py`).

`GradientReducer` holds the IPG bucket and what it has reduced; the step calls it as the
backward produces gradients (`ParameterHooks`: per submodule, as DeepSpeed's per-parameter
hooks run) and at the accumulation boundary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from zsim.network.collective import CollectiveOp
from zsim.step.job import StageJob
from zsim.step.kernels import Ended, Gather
from zsim.step.program import Category, Comm, Group, ProgramWriter, Stream, Task
from zsim.step.qgz import quantized_average, quantizes
from zsim.step.zero3_host import HostChain
from zsim.workload.model import ComputeOp, Layer, LayerKind, ParamTensor, module_of
from zsim.workload.parallel import STAGE0_ALLREDUCE_BUCKET_NUMEL, ZeroStage

MAX_PARAM_REDUCE_EVENTS = 2
"""ZeRO-3's host throttle: at a flush with more reductions in flight than this, the host waits
for the oldest (stage3.py `__reduce_and_partition_ipg_grads`, `max_param_reduce_events`)."""


class Reducer(Protocol):
    """What the step asks of a data-parallel gradient reduction (DeepSpeed's, Megatron's)."""

    def start_backward(self, boundary: bool) -> bool: ...
    def pending(self) -> list[Task]: ...
    def grads_ready(self, layer: Layer, done: Task) -> Task | None: ...
    def flush(self, deps: Sequence[Task] = ()) -> None: ...
    def boundary_reduce(self, deps: list[Task]) -> list[Task]: ...


def flushes_before(held: int, numel: int, size: int) -> bool:
    """A gradient of `numel` elements that would overflow reduce_bucket_size flushes the
    bucket before it joins (stage3.py `reduce_independent_p_g_buckets_and_remove_grads`,
    stage_1_and_2.py's alike). A gradient larger than the bucket joins an empty one, and goes
    with the next gradient's hook or the backward's epilogue (stage 1/2 reduce it directly
    then, `extra_large_param_to_reduce`)."""
    return held > 0 and held + numel > size


def flush_sizes(numels: Sequence[int], size: int) -> list[int]:
    """The elements of each flush of a backward whose gradients come in this order, the
    epilogue's flush of the rest last."""
    flushes: list[int] = []
    held = 0
    for numel in numels:
        if flushes_before(held, numel, size):
            flushes.append(held)
            held = 0
        held += numel
    return [*flushes, held] if held else flushes


@dataclass
class _Bucket:
    """Gradients waiting in DeepSpeed's IPG bucket."""

    numel: int = 0
    ready: list[Task] = field(default_factory=list)
    tensors: list[ParamTensor] = field(default_factory=list)  # in the order they came


class ParameterHooks:
    """Gradient hooks one per parameter (DeepSpeed's `register_grad_hook` in stage3.py and
    stage_1_and_2.py, Megatron-Core's `_make_backward_post_hook`), run as autograd accumulates
    each gradient: a submodule's gradients reach the reducer once the backward's run of
    kernels that read it has ended (its AccumulateGrad nodes run next), not at the end of the
    layer. Called before each op of the backward, after which `gather` (ZeRO-3's waits) runs."""

    def __init__(self, reducer: Reducer, layer: Layer, gather: Gather) -> None:
        self.reducer, self.layer, self.gather = reducer, layer, gather
        self.waiting = layer.tensors  # whose hooks have not run, in the layer's order
        self.running: set[str] = set()  # submodules whose backward kernels are running

    def __call__(self, op: ComputeOp, last: list[Task], ended: Ended) -> list[Task]:
        return [*self.before(op, ended), *self.gather(op, last, ended)]

    def before(self, op: ComputeOp, ended: Ended) -> list[Task]:
        """Before `op`: the hooks of the submodules whose run it ends (`ended`: the kernels
        so far as a task); what `op`'s launch waits for (the host's part of the hooks)."""
        over = self.running - set(op.modules)
        self.running = (self.running - over) | set(op.modules)
        ready = tuple(t for t in self.waiting if module_of(t) in over)
        if not ready:
            return []
        self.waiting = tuple(t for t in self.waiting if module_of(t) not in over)
        wait = self.reducer.grads_ready(replace(self.layer, tensors=ready), ended()[0])
        return [wait] if wait else []

    def rest(self) -> Layer:
        """The layer's parameters whose hooks run after its last kernel."""
        return replace(self.layer, tensors=self.waiting)


class GradientReducer:
    """The reductions of one rank's gradients, in the order DeepSpeed issues them."""

    def __init__(self, job: StageJob, writer: ProgramWriter) -> None:
        self.job = job
        self.writer = writer
        self._bucket = _Bucket()
        self._last: Task | None = None  # the latest reduction issued
        self._reduced_in_hooks = False  # whether a backward already reduced (boundary skips)
        self._flushes: list[Task] = []  # this backward's flushes, by their last task
        self._host_wait: Task | None = None  # the throttle the latest hook ran into
        self.host: HostChain | None = None  # ZeRO-3's host walks (the gathers' chain)

    def in_hooks(self, boundary: bool) -> bool:
        """Whether gradients are reduced as backward produces them (DeepSpeed's IPG hooks):
        stages 2 and 3 on every micro-batch, stage 1 with overlap_comm at the boundary only
        (`process_gradients`, stage_1_and_2.py:2284-2294)."""
        cfg = self.job.cfg
        if cfg.zero_stage >= ZeroStage.GRADIENTS:
            return True
        return cfg.zero_stage is ZeroStage.OPTIMIZER and cfg.overlap_comm and boundary

    def start_backward(self, boundary: bool) -> bool:
        """A backward begins: whether its hooks reduce (then the boundary does not again)."""
        hooks = self.in_hooks(boundary)
        self._reduced_in_hooks |= hooks
        self._flushes = []  # the previous backward's epilogue waited for all of them
        return hooks

    def pending(self) -> list[Task]:
        """The latest reduction, which the step's epilogue waits for."""
        return [self._last] if self._last else []

    def grads_ready(self, layer: Layer, done: Task) -> Task | None:
        """The IPG bucket (`flushes_before`). Returns the host's wait when a flush was
        throttled: the backward's next kernels are issued after it."""
        self._host_wait = None
        size = self.job.cfg.knobs.reduce_bucket_size
        for tensor in reversed(layer.tensors):
            numel = tensor.per_rank(self.job.cfg.tp)
            if flushes_before(self._bucket.numel, numel, size):
                self.flush()
            self._bucket.numel += numel
            self._bucket.tensors.append(tensor)
            self._bucket.ready = [done]
        return self._host_wait

    def flush(self, deps: Sequence[Task] = ()) -> None:
        """Reduce the bucket: stage 3 reduce-scatters it; stages 1-2 all-reduce it whole
        (use_multi_rank_bucket_allreduce, the default) or reduce each owner's slice to it."""
        if not self._bucket.numel:
            return
        job, cfg, writer = self.job, self.job.cfg, self.writer
        bucket, self._bucket = self._bucket, _Bucket()
        numel, ready, tensors = bucket.numel, [*bucket.ready, *deps], bucket.tensors
        throttled, waited = self._throttled(), []
        if throttled and len(self._flushes) > MAX_PARAM_REDUCE_EVENTS:
            waited = [self._flushes[-(MAX_PARAM_REDUCE_EVENTS + 1)]]  # the host waits for it
            self._host_wait = self._throttle(waited)
            ready = [*ready, self._host_wait]
        if self.host is not None and not job.qgz_nodes:  # reduce_scatter_coalesced's walk
            walk = self.host.charge("reduce", cfg.dp, len(tensors), waited)
            if walk is not None:
                ready, self._host_wait = [*ready, walk], walk
        stream = Stream.REDUCE if cfg.overlap_comm else Stream.COMPUTE
        comm_stream = stream
        if (
            cfg.zero_stage is ZeroStage.PARAMETERS
            and cfg.overlap_comm
            and cfg.one_dp_group
            and not job.gloo
        ):
            comm_stream = Stream.GATHER  # ProcessGroupNCCL: one NCCL stream per group, device
        work_stream = Stream.COMPUTE if job.gloo else stream
        before, after = bucket_passes(job, tensors)
        ready = [writer.memory_pass("bucket_prepare", before, ready, work_stream)]
        if job.qgz_nodes:
            streams = (work_stream, comm_stream)
            ready = [quantized_average(job, writer, tensors, ready, streams)]
        for comm in self._calls(numel):
            ready = [writer.comm("grad_reduce", comm, Category.GRAD_REDUCE, ready, comm_stream)]
        self._last = writer.memory_pass("bucket_scatter", after, ready, work_stream)
        if throttled:
            self._flushes.append(self._last)

    def _throttle(self, waited: list[Task]) -> Task:
        """The hook's `synchronize()` on the oldest reduction: the rank's host thread blocks
        (`zero3_host`), the device runs on through what was launched before."""
        blocked = self.host.wait("reduce_throttle", waited) if self.host else None
        assert blocked is not None, "ZeRO-3 throttles on the host thread its gathers model"
        return blocked

    def _calls(self, numel: int) -> list[Comm]:
        """The bucket's collectives (none where qgZ averages it tensor by tensor, or over one
        rank: the module's doc)."""
        job, cfg, d = self.job, self.job.cfg, self.job.element_bytes
        if cfg.dp == 1:
            return []
        if cfg.zero_stage is ZeroStage.PARAMETERS:
            if job.qgz_nodes:
                return []
            return [Comm(CollectiveOp.REDUCE_SCATTER, job.padded(numel) * d, Group.DP)]
        if cfg.knobs.use_multi_rank_bucket_allreduce or not cfg.knobs.reduce_scatter:
            return [Comm(CollectiveOp.ALL_REDUCE, numel * d, Group.DP)]
        share = numel / cfg.dp * d
        return [Comm(CollectiveOp.REDUCE, share, Group.DP, root=r) for r in range(cfg.dp)]

    def _throttled(self) -> bool:
        """ZeRO-3 on CUDA with overlap_comm records an event per flush and throttles on them."""
        cfg = self.job.cfg
        return cfg.zero_stage is ZeroStage.PARAMETERS and cfg.overlap_comm and not self.job.gloo

    def boundary_reduce(self, deps: list[Task]) -> list[Task]:
        """Reductions after the last backward, in parameter (forward) order: stage 0's
        `buffered_allreduce_fallback` (buckets of `STAGE0_ALLREDUCE_BUCKET_NUMEL`, flushed
        after the parameter that crosses the size) and stage 1's `reduce_gradients` without
        overlap_comm."""
        job, cfg, writer = self.job, self.job.cfg, self.writer
        if cfg.zero_stage >= ZeroStage.GRADIENTS or self._reduced_in_hooks:
            return deps
        tensors = job.tensors()
        if cfg.zero_stage is ZeroStage.OPTIMIZER:
            done = deps[-1]
            for t in tensors:
                self.grads_ready(Layer("", LayerKind.LINEAR, (t,)), done)
            self.flush(deps)
            return [self._last] if self._last else deps
        last, numel, d = deps, 0, job.element_bytes
        before, after = stage0_passes(cfg.dp)
        for i, t in enumerate(tensors):
            numel += t.per_rank(cfg.tp)
            if numel > STAGE0_ALLREDUCE_BUCKET_NUMEL or i == len(tensors) - 1:
                last = [writer.memory_pass("flatten", before * d * numel, last)]
                if cfg.dp > 1:
                    comm = Comm(CollectiveOp.ALL_REDUCE, numel * d, Group.DP)
                    last = [writer.comm("grad_allreduce", comm, Category.GRAD_REDUCE, last)]
                last = [writer.memory_pass("unflatten_and_scale", after * d * numel, last)]
                numel = 0
        return last


def stage0_passes(dp: int) -> tuple[int, int]:
    """Copies of a bucket around stage 0's `allreduce_bucket`, before and after its
    all-reduce: the flatten; the copy back, after the postscale divide where dp > 1 (skipped
    at dp 1: gradient_predivide_factor 1.0 equals the world)."""
    return 1, (1 if dp == 1 else 2)


def one_rank_copies_s(job: StageJob) -> float:
    """The copies DeepSpeed makes of a rank's gradients per step over a data-parallel group
    of one (the module's doc; the planner's closed form): one reduction's copies, on every
    micro-batch from stage 2 on."""
    cfg = job.cfg
    times = cfg.grad_accum if cfg.zero_stage >= ZeroStage.GRADIENTS else 1
    return job.device.copy_time_s(times * reduction_copy_bytes(job), job.dtype)


def reduction_copy_bytes(job: StageJob) -> float:
    """Bytes DeepSpeed copies around one reduction of a rank's gradients, all buckets
    together: `stage0_passes` at stage 0, `bucket_passes` from stage 1 on."""
    cfg, tensors = job.cfg, job.tensors()
    if cfg.zero_stage is ZeroStage.NONE:
        numel = sum(t.per_rank(cfg.tp) for t in tensors)
        return sum(stage0_passes(cfg.dp)) * job.element_bytes * numel
    return sum(bucket_passes(job, tensors))


def bucket_passes(job: StageJob, tensors: Sequence[ParamTensor]) -> tuple[float, float]:
    """Bytes DeepSpeed copies around one bucket's reduction, before and after it.

    Counted from a torch.profiler trace of DeepSpeed 0.19 on CPU (calls and shapes):
    stages 1-2 copy each gradient into the IPG bucket, divide it by dp in place and
    flatten its partition slices (`average_tensor`, `allreduce_and_scatter`), then copy
    this rank's slices out to its gradient partition; stage 3 copies into the bucket,
    interleaves the ranks' chunks (`reduce_scatter_coalesced`) and divides, then adds its
    chunk to the gradient partition (gloo's own clone and chunk copy are in the
    collective's plan). With qgZ (`zsim.step.qgz`) a quantized tensor is only copied
    into the bucket, and one reduce-scattered alone is divided in place, interleaved
    (`torch.cat`) only where its size does not divide by the world.
    """
    b = job.element_bytes
    n = sum(t.per_rank(job.cfg.tp) for t in tensors)
    if not job.qgz_nodes:
        return 3 * b * n, b * n / job.cfg.dp
    world = job.cfg.world_size
    alone = [t.numel for t in tensors if not quantizes(t, world)]
    interleaved = sum(x for x in alone if x % world)
    return b * (n + sum(alone) + interleaved), b * n / job.cfg.dp
