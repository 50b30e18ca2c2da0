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

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from zsim.collective_model import CollectiveOp
from zsim.hardware import DeviceProfile, layer_key
from zsim.memory import stage_layers
from zsim.model import ComputeOp, Layer, LayerKind, ModelSpec, module_of
from zsim.parallel import Offload, ParallelConfig, PipelineSchedule, Recompute, ZeroStage

MEMORY_OPT_ALLREDUCE_SIZE = 500_000_000  # deepspeed/runtime/constants.py, stage-0 buckets
ADAM_BYTES_PER_PARAM = 28  # fused Adam: reads p32, g, m, v (+16-bit p), writes p32, m, v


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
    if cfg.pp_schedule is PipelineSchedule.GPIPE or p == 1:
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


# ---- building one rank's program ----------------------------------------------------------


@dataclass
class _Bucket:
    """Gradients waiting in DeepSpeed's IPG bucket."""

    numel: int = 0
    ready: list[Task] = field(default_factory=list)


class _Builder:
    def __init__(
        self, model: ModelSpec, cfg: ParallelConfig, device: DeviceProfile, stage: int, gloo: bool
    ):
        self.model, self.cfg, self.device, self.stage = model, cfg, device, stage
        self.program = Program(stage)
        self.dtype = str(cfg.precision)
        self.d = cfg.precision.bytes
        self.v = cfg.virtual_stages
        self.chunks = [
            stage_layers(model, cfg.pp * self.v, c * cfg.pp + stage) for c in range(self.v)
        ]
        self.gloo = gloo
        self.bucket = _Bucket()
        self.last_reduce: Task | None = None
        self.queue: list[tuple[str, str, int]] = []  # ZeRO-3 modules to fetch this pass
        self.issued: dict[tuple[str, str], Task] = {}
        self.queue_index: dict[tuple[str, str], int] = {}

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
        return sum(self.device.op_time_s(op, self.dtype) for op in ops)

    def measured_scale(self, layer: Layer, forward: bool, ops: Sequence[ComputeOp]) -> float:
        """Calibrated layer times replace the roofline: scale each segment by measured/modelled."""
        key = layer_key(
            self.model.name, str(layer.kind), self.cfg.micro_batch, self.cfg.tp, self.dtype
        )
        measured = self.device.layer_time(key)
        modelled = self.op_seconds(ops)
        if measured is None or modelled <= 0:
            return 1.0
        return (measured.forward_s if forward else measured.backward_s) / modelled

    def layer_ops(self, layer: Layer) -> tuple[ComputeOp, ...]:
        c = self.cfg
        return self.model.forward_ops(
            layer, c.micro_batch, c.tp, c.sequence_parallel, c.flash_attention, self.d
        )

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
        layer: Layer,
        ops: Sequence[ComputeOp],
        forward: bool,
        category: Category,
        deps: list[Task],
        tag: str,
    ) -> Task:
        """Compute segments split at TP communication points and ZeRO-3 gathers."""
        scale = self.measured_scale(layer, forward, ops)
        points = self.tp_points(forward)
        segment: list[ComputeOp] = []
        pending_tp: list[Task] = []
        last = deps

        def flush() -> None:
            nonlocal last, segment, pending_tp
            if segment:
                name = f"{tag}.{segment[0].name}"
                last = [
                    self.compute(
                        name, scale * self.op_seconds(segment), category, last + pending_tp
                    )
                ]
                segment, pending_tp = [], []

        for op in ops:
            gather = self.zero3_fetch(layer, op, last, tag) if op.modules else []
            if gather:
                flush()
                last = last + gather
            segment.append(op)
            if op.name in points:
                flush()
                comm = Comm(points[op.name], self.tp_bytes(), Group.TP)
                overlapped = not forward and op.name.endswith("_dgrad")
                task = self.comm(
                    f"{tag}.tp_{points[op.name]}",
                    comm,
                    Category.TP_COMM,
                    last,
                    Stream.TP if overlapped else Stream.COMPUTE,
                )
                if overlapped:
                    pending_tp.append(task)  # Megatron overlaps it with the wgrad GEMM
                else:
                    last = [task]
        flush()
        return last[0] if len(last) == 1 else self.compute(f"{tag}.join", 0.0, category, last)

    def forward_layer(
        self, layer: Layer, deps: list[Task], tag: str, category: Category = Category.FORWARD
    ) -> Task:
        return self.run_ops(layer, self.layer_ops(layer), True, category, deps, tag)

    def backward_layer(self, layer: Layer, deps: list[Task], tag: str) -> Task:
        fwd = self.layer_ops(layer)
        if self.cfg.recompute is Recompute.FULL and layer.kind in (
            LayerKind.BLOCK,
            LayerKind.LINEAR,
        ):
            deps = [self.forward_layer(layer, deps, f"{tag}.recompute", Category.RECOMPUTE)]
        elif self.cfg.recompute is Recompute.SELECTIVE and layer.kind is LayerKind.BLOCK:
            core = [
                op for op in fwd if op.name in ("attn_scores", "softmax_dropout", "attn_values")
            ]
            deps = [
                self.compute(
                    f"{tag}.recompute_attention", self.op_seconds(core), Category.RECOMPUTE, deps
                )
            ]
        bwd = self.model.backward_ops(tuple(reversed(fwd)))
        return self.run_ops(layer, bwd, False, Category.BACKWARD, deps, tag)

    # -- ZeRO-3 parameter gathering --

    def module_numel(self, layer: Layer, module: str) -> int:
        return sum(
            -(-t.numel // self.cfg.tp) if t.tp_sharded else t.numel
            for t in layer.tensors
            if module_of(t) == module
        )

    def zero3_queue(self, layers: Sequence[Layer], forward: bool) -> None:
        """The modules this pass will fetch, in use order (what DeepSpeed's trace records).

        Persistent parameters (fewer than stage3_param_persistence_threshold elements) stay
        gathered and are never fetched.
        """
        self.queue = []
        self.issued = {}
        self.queue_index = {}
        if self.cfg.zero_stage is not ZeroStage.PARAMETERS:
            return
        for layer in layers:
            ops = self.layer_ops(layer)
            if not forward:
                ops = self.model.backward_ops(tuple(reversed(ops)))
            for op in ops:
                for module in op.modules:
                    numel = self.module_numel(layer, module)
                    key = (layer.name, module)
                    if numel >= self.cfg.knobs.param_persistence_threshold and all(
                        (n, m) != key for n, m, _ in self.queue
                    ):
                        self.queue.append((layer.name, module, numel))
        self.queue_index = {(n, m): i for i, (n, m, _) in enumerate(self.queue)}

    def zero3_fetch(self, layer: Layer, op: ComputeOp, last: list[Task], tag: str) -> list[Task]:
        """`fetch_sub_module`: gather this module if not in flight, prefetch the next ones
        within stage3_prefetch_bucket_size elements, then wait for this module's gather."""
        keys = [(layer.name, m) for m in op.modules if (layer.name, m) in self.queue_index]
        if not keys:
            return []
        waits = []
        for key in keys:
            position = self.queue_index[key]
            window = self.cfg.knobs.prefetch_bucket_size
            ahead = 0
            for name, module, numel in self.queue[position:]:
                if (name, module) != key and ahead + numel > window:
                    break
                if (name, module) != key:
                    ahead += numel
                if (name, module) not in self.issued:
                    comm = Comm(CollectiveOp.ALL_GATHER, numel * self.d, Group.DP)
                    self.issued[(name, module)] = self.comm(
                        f"{tag}.gather.{name}.{module}",
                        comm,
                        Category.PARAM_GATHER,
                        last,
                        Stream.GATHER,
                    )
            waits.append(self.issued[key])
            del self.queue_index[key]
        return waits

    # -- gradient reduction --

    def grads_ready(self, layer: Layer, done: Task) -> None:
        """DeepSpeed's IPG bucket: reduce when the next gradient would overflow it."""
        stage = self.cfg.zero_stage
        if stage in (ZeroStage.NONE, ZeroStage.OPTIMIZER) or self.cfg.dp == 1:
            return
        size = self.cfg.knobs.reduce_bucket_size
        for tensor in reversed(layer.tensors):
            numel = -(-tensor.numel // self.cfg.tp) if tensor.tp_sharded else tensor.numel
            if self.bucket.numel and self.bucket.numel + numel > size:
                self.flush_bucket()
            self.bucket.numel += numel
            self.bucket.ready = [done]

    def flush_bucket(self) -> None:
        if not self.bucket.numel:
            return
        stage = self.cfg.zero_stage
        op = (
            CollectiveOp.REDUCE_SCATTER
            if stage is ZeroStage.PARAMETERS
            else CollectiveOp.ALL_REDUCE
        )
        stream = Stream.REDUCE if self.cfg.overlap_comm else Stream.COMPUTE
        deps = list(self.bucket.ready) + ([self.last_reduce] if self.last_reduce else [])
        comm = Comm(op, self.bucket.numel * self.d, Group.DP)
        self.last_reduce = self.comm("grad_bucket", comm, Category.GRAD_REDUCE, deps, stream)
        self.bucket = _Bucket()

    def boundary_reduce(self, deps: list[Task]) -> list[Task]:
        """Stages 0 and 1 reduce all gradients once, after the last backward."""
        stage, cfg = self.cfg.zero_stage, self.cfg
        if stage > ZeroStage.OPTIMIZER or cfg.dp == 1:
            return deps
        numel = sum(x.params(cfg.tp) for chunk in self.chunks for x in chunk)
        size = (
            MEMORY_OPT_ALLREDUCE_SIZE if stage is ZeroStage.NONE else cfg.knobs.reduce_bucket_size
        )
        last = deps
        for start in range(0, numel, size):
            comm = Comm(CollectiveOp.ALL_REDUCE, min(size, numel - start) * self.d, Group.DP)
            last = [self.comm("grad_allreduce", comm, Category.GRAD_REDUCE, last)]
        return last

    # -- the step --

    def micro_batch(self, work: Work, ready: dict[str, Task]) -> None:
        """One forward or backward of one chunk, with its pipeline receive and send."""
        cfg, p = self.cfg, self.cfg.pp
        virtual = work.chunk * p + self.stage
        layers = self.chunks[work.chunk]
        tag = f"{'F' if work.forward else 'B'}{work.micro_batch}c{work.chunk}"
        act = self.model.layer_input_bytes(cfg.micro_batch, cfg.tp, cfg.sequence_parallel, self.d)
        deps: list[Task] = []
        first, last = virtual == 0, virtual == p * self.v - 1
        if work.forward and not first:
            deps.append(self.recv(f"act{work.micro_batch}v{virtual}", act, -1))
        if not work.forward:
            deps.append(ready[f"F{work.micro_batch}c{work.chunk}"])
            if not last:
                deps.append(self.recv(f"grad{work.micro_batch}v{virtual}", act, +1))
        order = layers if work.forward else tuple(reversed(layers))
        self.zero3_queue(order, work.forward)
        done = deps
        for layer in order:
            if work.forward:
                task = self.forward_layer(layer, done, f"{tag}.{layer.name}")
            else:
                task = self.backward_layer(layer, done, f"{tag}.{layer.name}")
                self.grads_ready(layer, task)
            done = [task]
        if not work.forward and self.cfg.zero_stage >= ZeroStage.GRADIENTS:
            self.flush_bucket()  # DeepSpeed reduces the remainder at the end of each backward
        ready[tag] = done[0]
        if work.forward and not last:
            self.send(f"act{work.micro_batch}v{virtual + 1}", act, +1, done)
        if not work.forward and not first:
            self.send(f"grad{work.micro_batch}v{virtual - 1}", act, -1, done)

    def recv(self, tag: str, nbytes: float, peer: int) -> Task:
        comm = Comm(CollectiveOp.SEND_RECV, nbytes, Group.PP, peer, tag)
        task = Task(f"recv.{tag}", Stream.P2P, Category.PP_COMM, comm=comm, receives=True)
        return self.program.add(task)

    def send(self, tag: str, nbytes: float, peer: int, deps: list[Task]) -> Task:
        comm = Comm(CollectiveOp.SEND_RECV, nbytes, Group.PP, peer, tag)
        return self.comm(f"send.{tag}", comm, Category.PP_COMM, deps, Stream.P2P)

    def optimizer(self, deps: list[Task]) -> list[Task]:
        """The Adam step on this rank's partition; ZeRO-1/2 then gather updated parameters."""
        cfg = self.cfg
        params = sum(x.params(cfg.tp) for chunk in self.chunks for x in chunk)
        shard = params / cfg.dp if cfg.zero_stage >= ZeroStage.OPTIMIZER else params
        if cfg.offload is Offload.NONE:
            seconds = shard * ADAM_BYTES_PER_PARAM / self.device.optimizer_bytes_per_s
            last = [self.compute("optimizer_step", seconds, Category.OPTIMIZER, deps)]
        else:
            last = self.offloaded_step(shard, deps)
        if cfg.zero_stage in (ZeroStage.OPTIMIZER, ZeroStage.GRADIENTS) and cfg.dp > 1:
            size = cfg.knobs.allgather_bucket_size * cfg.dp  # each rank's shard is one bucket
            for start in range(0, int(params), size):
                comm = Comm(CollectiveOp.ALL_GATHER, min(size, params - start) * self.d, Group.DP)
                last = [self.comm("param_allgather", comm, Category.PARAM_GATHER, last)]
        return last

    def offloaded_step(self, shard: float, deps: list[Task]) -> list[Task]:
        """ZeRO-Offload: fp32 gradients to the host, CPU Adam, 16-bit parameters back."""
        link = self.device.host_link_bytes_per_s
        down = self.compute("grads_to_host", shard * 4 / link, Category.OFFLOAD, deps, Stream.PCIE)
        rate = self.device.host_adam_params_per_s
        if rate <= 0:
            raise ValueError(f"profile {self.device.name} has no host Adam rate for offload")
        step = self.compute("cpu_adam", shard / rate, Category.OPTIMIZER, [down], Stream.HOST)
        up = self.compute(
            "params_to_device", shard * self.d / link, Category.OFFLOAD, [step], Stream.PCIE
        )
        return [up]

    def build(self) -> Program:
        ready: dict[str, Task] = {}
        for work in pipeline_order(self.cfg, self.stage):
            self.micro_batch(work, ready)
        backwards = [t for k, t in ready.items() if k.startswith("B")]
        deps = backwards + ([self.last_reduce] if self.last_reduce else [])
        deps = self.boundary_reduce(deps)
        deps = self.tied_embedding_reduce(deps)
        self.optimizer(deps)
        return self.program

    def tied_embedding_reduce(self, deps: list[Task]) -> list[Task]:
        """Megatron all-reduces the tied word embedding's gradient between the first and last
        pipeline stage before the optimizer step."""
        m, cfg = self.model, self.cfg
        if cfg.pp == 1 or not m.tied_embeddings or self.stage not in (0, cfg.pp - 1):
            return deps
        numel = -(-m.vocab // cfg.tp) * m.hidden
        comm = Comm(CollectiveOp.ALL_REDUCE, numel * self.d, Group.EMBEDDING)
        return [self.comm("tied_embedding_allreduce", comm, Category.GRAD_REDUCE, deps)]


def build_program(
    model: ModelSpec, cfg: ParallelConfig, device: DeviceProfile, stage: int, gloo: bool = False
) -> Program:
    """The program of every rank of pipeline stage `stage` (they are identical). `gloo`: the
    CPU backend, where DeepSpeed's streams are no-ops and its calls block."""
    return _Builder(model, cfg, device, stage, gloo).build()


def iter_comm(program: Program) -> Iterator[Task]:
    return (t for t in program.tasks if t.comm is not None)
