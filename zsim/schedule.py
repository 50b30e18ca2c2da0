"""The op DAG of one training step on one pipeline stage, with DeepSpeed's and Megatron's
semantics.

A `Program` is the list of tasks one rank issues, in issue order. Each task runs on a stream
(tasks of one stream run one after another, as on a CUDA stream) once its dependencies are done.
A task is either compute (a duration from the device profile) or communication (a collective
over a process group, or a pipeline send/recv), which the engine runs on the flow network.

What each ZeRO stage issues, and when, follows DeepSpeed 0.19 (cited inline):
- stage 0: `DeepSpeedEngine.allreduce_gradients` all-reduces all gradients after the backward
  of the last micro-batch, in buckets of MEMORY_OPT_ALLREDUCE_SIZE elements
  (`buffered_allreduce_fallback`), on the compute stream;
- stage 1: `DeepSpeedZeroOptimizer.reduce_gradients` at the accumulation boundary only, in
  reduce_bucket_size buckets; after the step, `all_gather_dp_groups` gathers the updated
  parameters in allgather_bucket_size pieces;
- stage 2: the same buckets are reduced during every micro-batch's backward, as gradients become
  ready (`reduce_independent_p_g_buckets_and_remove_grads`), on the reduction stream when
  overlap_comm is on;
- stage 3: each submodule's parameters are all-gathered before its forward and again before its
  backward (`PartitionedParameterCoordinator.fetch_sub_module`), prefetching the next
  submodules up to stage3_prefetch_bucket_size elements, except persistent small parameters;
  gradients are reduce-scattered in reduce_bucket_size buckets during every backward.
Megatron's tensor parallelism adds all-reduces (or all-gather + reduce-scatter with sequence
parallelism) inside each layer; pipelines follow GPipe, 1F1B or interleaved 1F1B.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from functools import partial
from typing import NamedTuple, Protocol, TypeVar

from zsim import zero3
from zsim.calibrate.keys import ADAM_STEP_BYTES_PER_PARAM, layer_time_key
from zsim.collective_model import CollectiveOp
from zsim.errors import InputError
from zsim.hardware import DeviceProfile
from zsim.layout import layer_passes, rank_chunks
from zsim.model import ComputeOp, Layer, LayerKind, ModelSpec
from zsim.parallel import (
    Offload,
    ParallelConfig,
    PipelineEngine,
    PipelineSchedule,
    Precision,
    ZeroStage,
)

MEMORY_OPT_ALLREDUCE_SIZE = 500_000_000  # deepspeed/runtime/constants.py, stage-0 buckets


class Stream(StrEnum):
    COMPUTE = "compute"
    REDUCE = "reduce"  # DeepSpeed's reduction stream (overlap_comm)
    GATHER = "gather"  # ZeRO-3 parameter all-gathers (prefetch)
    TP = "tp"  # Megatron's async input-gradient all-reduce, overlapped with wgrad
    P2P = "p2p"  # pipeline sends
    PCIE = "pcie"  # offload copies
    HOST = "host"  # the optimizer step on the CPU (offload)


class Category(StrEnum):
    FORWARD = "forward"
    BACKWARD = "backward"
    RECOMPUTE = "recompute"
    OPTIMIZER = "optimizer"
    TP_COMM = "tp_comm"
    GRAD_REDUCE = "grad_reduce"
    PARAM_GATHER = "param_gather"
    PP_COMM = "pp_comm"
    OFFLOAD = "offload"


class Group(StrEnum):
    """Which process group of the rank a collective runs in."""

    TP = "tp"
    DP = "dp"
    PP = "pp"  # send/recv to the neighbouring stage
    EMBEDDING = "embedding"  # first and last pipeline stage (tied embedding gradients)


@dataclass(frozen=True)
class Comm:
    """A communication call. `nbytes` follows nccl-tests: the full buffer for all-reduce,
    the output of all-gather, the input of reduce-scatter, the message of a send."""

    op: CollectiveOp
    nbytes: float
    group: Group
    peer: int = 0  # send/recv: +1 to the next virtual stage, -1 to the previous
    tag: str = ""  # matches a send with its receive
    root: int = 0  # reduce: the owner (index in the group)


class Part(NamedTuple):
    """A piece of a fused task: what ran, on which stream, from `start_s` after it began.
    (A NamedTuple: a 175B step has hundreds of thousands of them.)"""

    name: str
    category: Category
    stream: Stream
    start_s: float
    duration_s: float
    comm: Comm | None = None


@dataclass(eq=False)
class Task:
    name: str
    stream: Stream
    category: Category
    duration_s: float = 0.0
    comm: Comm | None = None
    deps: list[Task] = field(default_factory=list)
    receives: bool = False  # a recv: completes when the matching send's data has arrived
    index: int = 0
    parts: tuple[Part, ...] = ()  # set when consecutive fixed-time tasks were fused

    def __repr__(self) -> str:
        return f"Task({self.index}:{self.name})"


@dataclass
class Program:
    """The tasks of one rank of one pipeline stage, in issue order."""

    stage: int
    tasks: list[Task] = field(default_factory=list)

    def add(self, task: Task) -> Task:
        task.index = len(self.tasks)
        self.tasks.append(task)
        return task


# ---- emitting work: as tasks, or as timed parts of one fused task ---------------------------

H = TypeVar("H")


class Emitter(Protocol[H]):
    def compute(
        self,
        name: str,
        seconds: float,
        category: Category,
        deps: Sequence[H],
        stream: Stream = Stream.COMPUTE,
    ) -> H: ...

    def comm(
        self,
        name: str,
        comm: Comm,
        category: Category,
        deps: Sequence[H],
        stream: Stream = Stream.COMPUTE,
    ) -> H: ...


class _PartTimer:
    """Times work with fixed durations as streams would run it; handles are end times."""

    def __init__(self, comm_time: Callable[[Comm], float]) -> None:
        self.comm_time = comm_time
        self.parts: list[Part] = []
        self.free: dict[Stream, float] = {}

    def compute(
        self,
        name: str,
        seconds: float,
        category: Category,
        deps: Sequence[float],
        stream: Stream = Stream.COMPUTE,
        comm: Comm | None = None,
    ) -> float:
        start = max([self.free.get(stream, 0.0), *deps])
        self.free[stream] = start + seconds
        if seconds > 0:
            self.parts.append(Part(name, category, stream, start, seconds, comm))
        return start + seconds

    def comm(
        self,
        name: str,
        comm: Comm,
        category: Category,
        deps: Sequence[float],
        stream: Stream = Stream.COMPUTE,
    ) -> float:
        return self.compute(name, self.comm_time(comm), category, deps, stream, comm)


# ---- pipeline order -----------------------------------------------------------------------


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


# ---- building one rank's program ----------------------------------------------------------


@dataclass
class _Bucket:
    """Gradients waiting in DeepSpeed's IPG bucket."""

    numel: int = 0
    ready: list[Task] = field(default_factory=list)


class _Builder:
    def __init__(
        self,
        model: ModelSpec,
        cfg: ParallelConfig,
        device: DeviceProfile,
        stage: int,
        gloo: bool,
        tp_time: Callable[[Comm], float] | None,
    ):
        self.model, self.cfg, self.device, self.stage = model, cfg, device, stage
        self.program = Program(stage)
        self.dtype = str(cfg.precision)
        self.d = cfg.precision.bytes
        self.v = cfg.virtual_stages
        self.chunks = rank_chunks(model, cfg, stage)
        self.gloo = gloo
        self.bucket = _Bucket()
        self.last_reduce: Task | None = None
        self.reduced_in_hooks = False
        self._seconds: dict[tuple[ComputeOp, ...], float] = {}
        self.tp_time = tp_time  # fixed TP collective times: whole passes become one task
        self._templates: dict[tuple[Layer, bool], tuple[tuple[Part, ...], float]] = {}
        self._fused: dict[tuple[tuple[Layer, ...], bool], tuple[tuple[Part, ...], float]] = {}
        # ZeRO-3: the gathers DeepSpeed issues at each trace position, and those in flight
        self.z3_gathers: dict[int, list[zero3.Gather]] = {}
        self.z3_inflight: dict[tuple[str, str], Task] = {}
        self.z3_blocking: list[Task] = []
        self.z3_pos = 0
        self.z3_current: tuple[str, str] | None = None

    # -- primitives --

    def compute(
        self,
        name: str,
        seconds: float,
        category: Category,
        deps: Sequence[Task],
        stream: Stream = Stream.COMPUTE,
    ) -> Task:
        return self.program.add(Task(name, stream, category, seconds, deps=list(deps)))

    def comm(
        self,
        name: str,
        comm: Comm,
        category: Category,
        deps: Sequence[Task],
        stream: Stream = Stream.COMPUTE,
    ) -> Task:
        if self.gloo and stream in (Stream.REDUCE, Stream.TP):
            stream = Stream.COMPUTE  # DeepSpeed's CPU accelerator has no real streams
        return self.program.add(Task(name, stream, category, comm=comm, deps=list(deps)))

    def op_seconds(self, ops: Sequence[ComputeOp]) -> float:
        key = tuple(ops)
        if key not in self._seconds:
            self._seconds[key] = sum(self.device.op_time_s(op, self.dtype) for op in ops)
        return self._seconds[key]

    def measured_scale(self, layer: Layer, forward: bool, ops: Sequence[ComputeOp]) -> float:
        """Calibrated layer times replace the roofline: scale each segment by measured/modelled."""
        c = self.cfg
        key = layer_time_key(
            self.model, layer.kind, c.micro_batch, self.dtype, c.tp, c.flash_attention
        )
        measured = self.device.layer_time(key)
        modelled = self.op_seconds(ops)
        if measured is None or modelled <= 0:
            return 1.0
        return (measured.forward_s if forward else measured.backward_s) / modelled

    # -- tensor parallelism (Megatron) --

    def tp_points(self, forward: bool) -> dict[str, CollectiveOp]:
        """Where Megatron communicates inside a layer: after these ops.

        Forward: row-parallel outputs (proj, fc2) are all-reduced (reduce-scattered with
        sequence parallelism), the vocab-parallel embedding output too. Backward: the input
        gradients of column-parallel GEMMs (qkv, fc1, logits) are all-reduced. With sequence
        parallelism the inputs of column-parallel GEMMs are all-gathered first.
        """
        if self.cfg.tp == 1:
            return {}
        sp = self.cfg.sequence_parallel
        reduce = CollectiveOp.REDUCE_SCATTER if sp else CollectiveOp.ALL_REDUCE
        if forward:
            points = {"proj": reduce, "fc2": reduce, "embedding_lookup": reduce}
            if sp:
                points |= {
                    "ln1": CollectiveOp.ALL_GATHER,
                    "ln2": CollectiveOp.ALL_GATHER,
                    "ln_f": CollectiveOp.ALL_GATHER,
                }
            return points
        points = {"qkv_dgrad": reduce, "fc1_dgrad": reduce, "logits_dgrad": reduce}
        if sp:
            points |= {
                "residual2_bwd": CollectiveOp.ALL_GATHER,
                "residual1_bwd": CollectiveOp.ALL_GATHER,
            }
        return points

    def tp_bytes(self) -> float:
        c = self.cfg
        return float(c.micro_batch * self.model.seq_len * self.model.hidden * self.d)

    # -- layers --

    def run_ops(
        self,
        emit: Emitter[H],
        layer: Layer,
        ops: Sequence[ComputeOp],
        forward: bool,
        category: Category,
        deps: list[H],
        tag: str,
        gather: Callable[[ComputeOp, list[H]], list[H]] | None = None,
    ) -> H:
        """Compute segments, split at TP communication points and (through `gather`) ZeRO-3
        parameter gathers; `emit` makes tasks, or times a fused pass."""
        scale = self.measured_scale(layer, forward, ops)
        points = self.tp_points(forward)
        segment: list[ComputeOp] = []
        last = deps
        overlapped: H | None = None  # a TP all-reduce running beside the next wgrad

        def flush() -> None:
            nonlocal last, segment
            if segment:
                seconds = scale * self.op_seconds(segment)
                last = [emit.compute(f"{tag}.{segment[0].name}", seconds, category, last)]
                segment = []

        for op in ops:
            gathers = gather(op, last) if gather else []
            if gathers:
                flush()
                last = last + gathers
            segment.append(op)
            if overlapped is not None and op.name.endswith("_wgrad"):
                flush()  # Megatron overlaps the input-gradient all-reduce with the wgrad GEMM
                last, overlapped = [*last, overlapped], None
            if op.name in points:
                flush()
                comm = Comm(points[op.name], self.tp_bytes(), Group.TP)
                name = f"{tag}.tp_{comm.op}"
                if not forward and op.name.endswith("_dgrad"):
                    overlapped = emit.comm(name, comm, Category.TP_COMM, last, Stream.TP)
                else:
                    last = [emit.comm(name, comm, Category.TP_COMM, last)]
        flush()
        if overlapped is not None:
            last = [*last, overlapped]
        return last[0] if len(last) == 1 else emit.compute(f"{tag}.join", 0.0, category, last)

    def layer_pass(self, layer: Layer, forward: bool, deps: list[Task], tag: str) -> Task:
        """One layer's forward, or its backward with any recompute replay first."""
        passes = layer_passes(self.model, self.cfg, layer)
        gather = partial(self.zero3_use, layer, tag=tag)
        if forward:
            return self.run_ops(
                self, layer, passes.forward, True, Category.FORWARD, deps, tag, gather
            )
        if passes.replay:
            deps = [
                self.run_ops(
                    self, layer, passes.replay, True, Category.RECOMPUTE, deps, f"{tag}.re", gather
                )
            ]
        return self.run_ops(
            self, layer, passes.backward, False, Category.BACKWARD, deps, tag, gather
        )

    def fused_pass(
        self, layers: Sequence[Layer], forward: bool, deps: list[Task], tag: str
    ) -> Task:
        """A whole forward or backward of a chunk as one task, when every collective inside
        it takes a fixed time (TP on its own links): the same timing, far fewer events."""
        key = (tuple(layers), forward)
        if key not in self._fused:  # the same for every micro-batch
            parts: list[Part] = []
            offset = 0.0
            for layer in layers:
                layer_parts, seconds = self.pass_template(layer, forward)
                parts += [p._replace(start_s=p.start_s + offset) for p in layer_parts]
                offset += seconds
            self._fused[key] = (tuple(parts), offset)
        parts_of_pass, seconds_of_pass = self._fused[key]
        category = Category.FORWARD if forward else Category.BACKWARD
        task = Task(tag, Stream.COMPUTE, category, seconds_of_pass, deps=deps, parts=parts_of_pass)
        return self.program.add(task)

    def pass_template(self, layer: Layer, forward: bool) -> tuple[tuple[Part, ...], float]:
        key = (layer, forward)
        if key not in self._templates:
            assert self.tp_time is not None  # fused passes need fixed-time TP collectives
            timer = _PartTimer(self.tp_time)
            passes = layer_passes(self.model, self.cfg, layer)
            end = 0.0
            if forward:
                end = self.run_ops(
                    timer, layer, passes.forward, True, Category.FORWARD, [end], layer.name
                )
            else:
                if passes.replay:
                    end = self.run_ops(
                        timer,
                        layer,
                        passes.replay,
                        True,
                        Category.RECOMPUTE,
                        [end],
                        f"{layer.name}.re",
                    )
                end = self.run_ops(
                    timer, layer, passes.backward, False, Category.BACKWARD, [end], layer.name
                )
            self._templates[key] = (tuple(timer.parts), end)
        return self._templates[key]

    # -- ZeRO-3 parameter gathering --

    def zero3_start(self, layers: Sequence[Layer]) -> None:
        """Replay DeepSpeed's coordinator over this micro-step (forward + backward)."""
        trace = zero3.module_trace(self.model, self.cfg, layers)
        self.z3_trace = trace
        self.z3_gathers = {}
        for g in zero3.replay(trace, self.cfg.knobs).gathers:
            self.z3_gathers.setdefault(g.at, []).append(g)
        self.z3_pos = 0
        self.z3_current = None

    def zero3_use(self, layer: Layer, op: ComputeOp, last: list[Task], tag: str) -> list[Task]:
        """At a module's first op: issue the gathers DeepSpeed issues there (its blocking
        fetch, then one prefetch bucket) and wait for this module's parameters."""
        if self.cfg.zero_stage is not ZeroStage.PARAMETERS or not op.modules:
            return []
        waits: list[Task] = []
        for module in op.modules:
            key = (layer.name, module)
            if key == self.z3_current or not zero3.module_numels(layer, module, self.cfg)[1]:
                continue
            self.z3_current = key
            for g in self.z3_gathers.pop(self.z3_pos, []):
                comm = Comm(CollectiveOp.ALL_GATHER, self.padded(g.numel) * self.d, Group.DP)
                task = self.comm(
                    f"{tag}.gather",
                    comm,
                    Category.PARAM_GATHER,
                    last if g.blocking else [*last, *self.z3_blocking],
                    Stream.GATHER,
                )
                self.z3_blocking = [task] if g.blocking else []
                for k in g.keys:
                    self.z3_inflight[k] = task
            self.z3_pos += 1
            if key in self.z3_inflight:
                waits.append(self.z3_inflight.pop(key))
        self.z3_blocking = []
        return waits

    def padded(self, numel: float) -> float:
        """A gather's output: each rank's shard is ceil(n / dp) elements."""
        return -(-numel // self.cfg.dp) * self.cfg.dp

    # -- gradient reduction --

    def reduces_in_hooks(self, boundary: bool) -> bool:
        """Whether gradients are reduced as backward produces them (DeepSpeed's IPG hooks):
        stages 2 and 3 on every micro-batch, stage 1 with overlap_comm at the boundary only
        (`process_gradients`, stage_1_and_2.py:2284-2294)."""
        stage = self.cfg.zero_stage
        if self.cfg.dp == 1:
            return False
        if stage >= ZeroStage.GRADIENTS:
            return True
        return stage is ZeroStage.OPTIMIZER and self.cfg.overlap_comm and boundary

    def grads_ready(self, layer: Layer, done: Task) -> None:
        """The IPG bucket: flush before a gradient that would overflow reduce_bucket_size; a
        gradient larger than the bucket is reduced alone (stage_1_and_2.py:1414-1450,
        stage3.py:1569-1645)."""
        size = self.cfg.knobs.reduce_bucket_size
        for tensor in reversed(layer.tensors):
            numel = tensor.per_rank(self.cfg.tp)
            if self.bucket.numel and self.bucket.numel + numel > size:
                self.flush_bucket()
            self.bucket.numel += numel
            self.bucket.ready = [done]
            if numel > size:
                self.flush_bucket()

    def flush_bucket(self, deps: Sequence[Task] = ()) -> None:
        """Reduce the bucket: stage 3 reduce-scatters it; stages 1-2 all-reduce it whole
        (use_multi_rank_bucket_allreduce, the default) or reduce each owner's slice to it."""
        if not self.bucket.numel:
            return
        numel, ready = self.bucket.numel, [*self.bucket.ready, *deps]
        self.bucket = _Bucket()
        stream = Stream.REDUCE if self.cfg.overlap_comm else Stream.COMPUTE
        if self.cfg.zero_stage is ZeroStage.PARAMETERS:
            calls = [Comm(CollectiveOp.REDUCE_SCATTER, self.padded(numel) * self.d, Group.DP)]
        elif self.cfg.knobs.use_multi_rank_bucket_allreduce or not self.cfg.knobs.reduce_scatter:
            calls = [Comm(CollectiveOp.ALL_REDUCE, numel * self.d, Group.DP)]
        else:
            share = numel / self.cfg.dp * self.d
            calls = [Comm(CollectiveOp.REDUCE, share, Group.DP, root=r) for r in range(self.cfg.dp)]
        work_stream = Stream.COMPUTE if self.gloo else stream
        before, after = self.bucket_passes(numel)
        ready = [self.memory_pass("bucket_prepare", before, ready, work_stream)]
        for comm in calls:
            self.last_reduce = self.comm("grad_reduce", comm, Category.GRAD_REDUCE, ready, stream)
            ready = [self.last_reduce]
        self.last_reduce = self.memory_pass("bucket_scatter", after, ready, work_stream)

    def bucket_passes(self, numel: float) -> tuple[float, float]:
        """Bytes DeepSpeed copies around one bucket's reduction, before and after it.

        Counted from a torch.profiler trace of DeepSpeed 0.19 on CPU (calls and shapes):
        stages 1-2 copy each gradient into the IPG bucket, divide it by dp in place and
        flatten its partition slices (`average_tensor`, `allreduce_and_scatter`), then copy
        this rank's slices out to its gradient partition; stage 3 copies into the bucket,
        interleaves the ranks' chunks (`reduce_scatter_coalesced`) and divides, then adds its
        chunk to the gradient partition (gloo's own clone and chunk copy are in the
        collective's plan).
        """
        b, n, dp = self.d, numel, self.cfg.dp
        return 3 * b * n, b * n / dp

    def memory_pass(
        self, name: str, nbytes: float, deps: Sequence[Task], stream: Stream = Stream.COMPUTE
    ) -> Task:
        """Bandwidth-bound bookkeeping (copies, scaling in place) of `nbytes` copied."""
        seconds = self.device.copy_time_s(nbytes, self.dtype)
        return self.compute(name, seconds, Category.OPTIMIZER, deps, stream)

    def boundary_reduce(self, deps: list[Task]) -> list[Task]:
        """Reductions after the last backward, in parameter (forward) order: stage 0's
        `buffered_allreduce_fallback` (5e8-element buckets, flushed after the parameter that
        crosses the size) and stage 1's `reduce_gradients` without overlap_comm."""
        cfg = self.cfg
        if cfg.dp == 1 or cfg.zero_stage >= ZeroStage.GRADIENTS or self.reduced_in_hooks:
            return deps
        tensors = [t for chunk in self.chunks for x in chunk for t in x.tensors]
        if cfg.zero_stage is ZeroStage.OPTIMIZER:
            done = deps[-1]
            for t in tensors:
                self.grads_ready(Layer("", LayerKind.LINEAR, (t,)), done)
            self.flush_bucket(deps)
            return [self.last_reduce] if self.last_reduce else deps
        last, numel = deps, 0
        for i, t in enumerate(tensors):
            numel += t.per_rank(self.cfg.tp)
            if numel > MEMORY_OPT_ALLREDUCE_SIZE or i == len(tensors) - 1:
                # `allreduce_bucket`: flatten (a copy), all-reduce, divide by dp, copy back
                comm = Comm(CollectiveOp.ALL_REDUCE, numel * self.d, Group.DP)
                last = [self.memory_pass("flatten", self.d * numel, last)]
                last = [self.comm("grad_allreduce", comm, Category.GRAD_REDUCE, last)]
                last = [self.memory_pass("unflatten_and_scale", 2 * self.d * numel, last)]
                numel = 0
        return last

    # -- the step --

    def compute_pass(self, work: Work, deps: list[Task], tag: str) -> Task:
        """One forward or backward of one chunk, with ZeRO's hooks and gathers inside."""
        cfg = self.cfg
        layers = self.chunks[work.chunk]
        if work.forward and cfg.zero_stage is ZeroStage.PARAMETERS:
            self.zero3_start(layers)  # ZeRO-3 runs without pipelining: F then B per micro-step
        hooks = self.reduces_in_hooks(work.micro_batch == cfg.grad_accum - 1)
        self.reduced_in_hooks |= hooks and not work.forward
        done = deps
        order = layers if work.forward else tuple(reversed(layers))
        fusable = self.tp_time is not None and not (hooks and not work.forward)
        if fusable and cfg.zero_stage is not ZeroStage.PARAMETERS:
            done = [self.fused_pass(order, work.forward, done, tag)]
        else:
            for layer in order:
                task = self.layer_pass(layer, work.forward, done, f"{tag}.{layer.name}")
                if hooks and not work.forward:
                    self.grads_ready(layer, task)
                done = [task]
        if not work.forward and hooks:
            self.flush_bucket()  # the backward epilogue reduces what is left in the bucket
        if not work.forward and self.accumulates_in_fp32():
            done = [self.memory_pass("fp32_grad_accumulate", 5 * self.stage_params(), done)]
        return done[0]

    def accumulates_in_fp32(self) -> bool:
        """DeepSpeed's pipeline engine with bf16 trains through BF16_Optimizer, which adds
        every micro-batch's bf16 gradients into fp32 ones (`_update_hp_grad`): read 2 + 4,
        write 4 bytes per parameter of the stage."""
        cfg = self.cfg
        return (
            cfg.pp > 1
            and cfg.pipeline_engine is PipelineEngine.DEEPSPEED
            and cfg.precision is Precision.BF16
        )

    def activation_bytes(self) -> float:
        cfg = self.cfg
        return self.model.layer_input_bytes(cfg.micro_batch, cfg.tp, cfg.sequence_parallel, self.d)

    def megatron_micro_batch(self, work: Work, ready: dict[str, Task]) -> None:
        """A Megatron pipeline step: receive, compute, then send asynchronously (its batched
        isend/irecv run beside compute)."""
        p, act = self.cfg.pp, self.activation_bytes()
        virtual = work.chunk * p + self.stage
        tag = f"{'F' if work.forward else 'B'}{work.micro_batch}c{work.chunk}"
        deps: list[Task] = []
        first, last = virtual == 0, virtual == p * self.v - 1
        if work.forward and not first:
            deps.append(self.recv(f"act{work.micro_batch}v{virtual}", act, -1))
        if not work.forward:
            deps.append(ready[f"F{work.micro_batch}c{work.chunk}"])
            if not last:
                deps.append(self.recv(f"grad{work.micro_batch}v{virtual}", act, +1))
        done = [self.compute_pass(work, deps, tag)]
        ready[tag] = done[0]
        if work.forward and not last:
            self.send(f"act{work.micro_batch}v{virtual + 1}", act, +1, done, Stream.P2P)
        if not work.forward and not first:
            self.send(f"grad{work.micro_batch}v{virtual - 1}", act, -1, done, Stream.P2P)

    def deepspeed_pipeline(self, ready: dict[str, Task]) -> None:
        """DeepSpeed's PipelineEngine: the instructions of its TrainSchedule, run one after
        the other; its p2p sends block (`p2p.send`: dist.send / broadcast, async_op=False)."""
        act, s = self.activation_bytes(), self.stage
        cursor: list[Task] = []
        for command, mb in deepspeed_train_commands(self.cfg.pp, self.cfg.grad_accum, s):
            if command is PipeCommand.RECV_ACTIVATION:
                cursor = [*cursor, self.recv(f"act{mb}v{s}", act, -1)]
            elif command is PipeCommand.RECV_GRAD:
                cursor = [*cursor, self.recv(f"grad{mb}v{s}", act, +1)]
            elif command is PipeCommand.SEND_ACTIVATION:
                cursor = [self.send(f"act{mb}v{s + 1}", act, +1, cursor, Stream.COMPUTE)]
            elif command is PipeCommand.SEND_GRAD:
                cursor = [self.send(f"grad{mb}v{s - 1}", act, -1, cursor, Stream.COMPUTE)]
            else:
                work = Work(command is PipeCommand.FORWARD, mb, 0)
                tag = f"{'F' if work.forward else 'B'}{mb}c0"
                deps = cursor if work.forward else [*cursor, ready[f"F{mb}c0"]]
                cursor = [self.compute_pass(work, deps, tag)]
                ready[tag] = cursor[0]

    def build(self) -> Program:
        ready: dict[str, Task] = {}
        if self.cfg.pp > 1 and self.cfg.pipeline_engine is PipelineEngine.DEEPSPEED:
            self.deepspeed_pipeline(ready)
        else:
            for work in pipeline_order(self.cfg, self.stage):
                self.megatron_micro_batch(work, ready)
        deps = [t for k, t in ready.items() if k.startswith("B")]
        deps += [self.last_reduce] if self.last_reduce else []
        deps = self.tied_embedding_reduce(deps)
        deps = self.boundary_reduce(deps)
        deps = self.grad_norm(deps)
        deps = self.optimizer(deps)
        self.post_step_gather(deps)
        return self.program

    def grad_norm(self, deps: list[Task]) -> list[Task]:
        """The global gradient norm: a one-element all-reduce every step (ZeRO 1-2 fp32 as
        compute_grad_norm=True, ZeRO-3 fp64; stage 0 clips with the default
        gradient_clipping=1.0)."""
        if self.cfg.dp == 1:
            return deps
        nbytes = 8 if self.cfg.zero_stage is ZeroStage.PARAMETERS else 4
        comm = Comm(CollectiveOp.ALL_REDUCE, nbytes, Group.DP)
        return [self.comm("grad_norm", comm, Category.GRAD_REDUCE, deps)]

    def stage_params(self) -> int:
        return sum(x.params(self.cfg.tp) for chunk in self.chunks for x in chunk)

    def optimizer(self, deps: list[Task]) -> list[Task]:
        """The Adam step on this rank's partition (all of it without ZeRO)."""
        cfg = self.cfg
        shard = self.stage_params() / (cfg.dp if cfg.zero_stage >= ZeroStage.OPTIMIZER else 1)
        if cfg.offload is not Offload.NONE:
            return self.offloaded_step(shard, deps)
        deps = [self.memory_pass("step_prepare", self.step_passes(shard), deps)]
        seconds = shard * ADAM_STEP_BYTES_PER_PARAM / self.device.optimizer_bytes_per_s
        return [self.compute("optimizer_step", seconds, Category.OPTIMIZER, deps)]

    def step_passes(self, shard: float) -> float:
        """Bytes copied around the Adam step on a partition of `shard` elements: the gradient
        norm (a read: half a copy) and the clipping scale with the default gradient_clipping
        = 1.0; ZeRO also flattens the gradients, casts them into an fp32 partition and copies
        the fp32 master back into the 16-bit parameters (`DeepSpeedZeroOptimizer.step`,
        stage3 `_prepare_fp32_grad_for_sub_group`)."""
        passes = 0.5 * 4 * shard + 4 * shard  # the norm reads, the clip scales in place
        if self.cfg.zero_stage >= ZeroStage.OPTIMIZER:
            passes += (self.d + 4 + self.d) * shard  # flatten, to fp32, master -> 16-bit
        return passes

    def post_step_gather(self, deps: list[Task]) -> None:
        """ZeRO-1/2 gather the updated parameters in one all_gather_into_tensor of the padded
        flat group (`all_gather_dp_groups`; allgather_bucket_size only bounds a fallback);
        ZeRO-3 gathers each persistent parameter with its own call (`_post_step`)."""
        cfg, stage = self.cfg, self.cfg.zero_stage
        if cfg.dp == 1 or stage is ZeroStage.NONE:
            return
        if stage is not ZeroStage.PARAMETERS:
            align = 2 * cfg.dp  # nccl_start_alignment_factor x dp (stage_1_and_2.py:387)
            numel = -(-self.stage_params() // align) * align
            comm = Comm(CollectiveOp.ALL_GATHER, numel * self.d, Group.DP)
            self.comm("param_allgather", comm, Category.PARAM_GATHER, deps)
            return
        threshold = cfg.knobs.param_persistence_threshold
        for chunk in self.chunks:
            for layer in chunk:
                for t in layer.tensors:
                    if t.per_rank(self.cfg.tp) <= threshold:
                        comm = Comm(
                            CollectiveOp.ALL_GATHER,
                            self.padded(t.per_rank(self.cfg.tp)) * self.d,
                            Group.DP,
                        )
                        self.comm(
                            "persistent_gather", comm, Category.PARAM_GATHER, deps, Stream.GATHER
                        )

    def offloaded_step(self, shard: float, deps: list[Task]) -> list[Task]:
        """ZeRO-Offload: fp32 gradients to the host, CPU Adam, 16-bit parameters back."""
        link = self.device.host_link_bytes_per_s
        down = self.compute("grads_to_host", shard * 4 / link, Category.OFFLOAD, deps, Stream.PCIE)
        rate = self.device.host_adam_params_per_s
        if rate <= 0:
            raise InputError(
                "profile",
                self.device.name,
                "a profile with a host Adam rate (calibrate) to simulate offload",
            )
        step = self.compute("cpu_adam", shard / rate, Category.OPTIMIZER, [down], Stream.HOST)
        seconds = shard * self.d / link
        return [self.compute("params_to_device", seconds, Category.OFFLOAD, [step], Stream.PCIE)]

    def tied_embedding_reduce(self, deps: list[Task]) -> list[Task]:
        """Megatron all-reduces the tied word embedding's gradient between the first and last
        pipeline stage before the optimizer step."""
        m, cfg = self.model, self.cfg
        if cfg.pp == 1 or not m.tied_embeddings or self.stage not in (0, cfg.pp - 1):
            return deps
        numel = -(-m.vocab // cfg.tp) * m.hidden
        comm = Comm(CollectiveOp.ALL_REDUCE, numel * self.d, Group.EMBEDDING)
        return [self.comm("tied_embedding_allreduce", comm, Category.GRAD_REDUCE, deps)]

    def recv(self, tag: str, nbytes: float, peer: int) -> Task:
        comm = Comm(CollectiveOp.SEND_RECV, nbytes, Group.PP, peer, tag)
        task = Task(f"recv.{tag}", Stream.P2P, Category.PP_COMM, comm=comm, receives=True)
        return self.program.add(task)

    def send(self, tag: str, nbytes: float, peer: int, deps: list[Task], stream: Stream) -> Task:
        comm = Comm(CollectiveOp.SEND_RECV, nbytes, Group.PP, peer, tag)
        return self.comm(f"send.{tag}", comm, Category.PP_COMM, deps, stream)


def build_program(
    model: ModelSpec,
    cfg: ParallelConfig,
    device: DeviceProfile,
    stage: int,
    gloo: bool = False,
    tp_time: Callable[[Comm], float] | None = None,
) -> Program:
    """The program of every rank of pipeline stage `stage` (they are identical).

    `gloo`: the CPU backend, where DeepSpeed's streams are no-ops and its calls block.
    `tp_time`: when tensor-parallel collectives take a fixed time (their links carry nothing
    else), passes without other communication are fused into one task each.
    """
    return _Builder(model, cfg, device, stage, gloo, tp_time).build()


def iter_comm(program: Program) -> Iterator[Task]:
    return (t for t in program.tasks if t.comm is not None)
