"""The compute of a layer's passes: its kernels timed by the device profile, split where
Megatron's tensor parallelism communicates and where ZeRO-3 waits for gathered parameters.

A pass whose collectives all take a fixed time (TP on links nothing else uses) is timed once
and becomes one task per micro-batch (`fused_pass`): the same timing, far fewer events.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cached_property
from typing import Generic, TypeVar

from zsim.cluster.device import LayerTime, layer_time_key
from zsim.network.collective import CollectiveOp
from zsim.step.job import StageJob
from zsim.step.program import (
    Category,
    Comm,
    Emitter,
    Group,
    Part,
    PartTimer,
    ProgramWriter,
    Stream,
    Task,
)
from zsim.step.tensor_parallel import (
    CROSS_ENTROPY_ALL_REDUCES,
    PIPELINE_SPLITS,
    PIPELINED,
    RING_EXCHANGED_AFTER,
    cross_entropy_bytes,
    gathered_before,
    regathered,
    tp_bytes,
    tp_points,
)
from zsim.workload.context_parallel import kv_exchange_bytes
from zsim.workload.layout import layer_passes
from zsim.workload.mechanisms import Mechanism
from zsim.workload.model import ComputeOp, Layer, OpKind
from zsim.workload.parallel import Precision
from zsim.workload.te_overlap import gemm_slowdown

H = TypeVar("H")
Ended = Callable[[], list[Task]]
Gather = Callable[[ComputeOp, list[Task], Ended], list[Task]]
"""ZeRO's hooks before an op, given the tasks so far and `ended` (the kernels before it as a
task): what it waits for (ZeRO-3's gathers, a gradient hook's host work)."""


class LayerKernels:
    """Times and emits layer passes; caches what is the same for every micro-batch."""

    def __init__(self, job: StageJob, tp_time: Callable[[Comm], float] | None) -> None:
        self.job = job
        self.tp_time = tp_time  # fixed TP collective times: whole passes become one task
        self._seconds: dict[tuple[ComputeOp, ...], float] = {}
        self._templates: dict[tuple[Layer, bool, bool], tuple[tuple[Part, ...], float]] = {}
        self._fused: dict[tuple[int, bool, bool], tuple[tuple[Part, ...], float]] = {}

    @property
    def can_fuse(self) -> bool:
        return self.tp_time is not None

    @cached_property
    def overlap_slowdown(self) -> dict[str, float]:
        """With --tp-comm-overlap, each GEMM's time on the SMs TE leaves it, over its time."""
        cfg = self.job.cfg
        if not cfg.tp_comm_overlap or cfg.tp == 1 or not cfg.models(Mechanism.TE_SM_MARGINS):
            return {}
        return gemm_slowdown(cfg.tp_overlap_sms, self.job.device.sm_count)

    def op_seconds(self, ops: Sequence[ComputeOp]) -> float:
        key = tuple(ops)
        if key not in self._seconds:
            device, dtype = self.job.device, self.job.dtype
            self._seconds[key] = sum(device.op_time_s(op, dtype) for op in ops)
        return self._seconds[key]

    def sm_share(self, ops: Sequence[ComputeOp]) -> float:
        """Of the ops' time, the SM-bound kernels' (GEMMs, attention; `Task.sm_share`)."""
        total = self.op_seconds(ops)
        on_sms = [op for op in ops if op.kind in (OpKind.GEMM, OpKind.ATTENTION)]
        return self.op_seconds(on_sms) / total if total > 0 else 0.0

    def measured(self, layer: Layer) -> LayerTime | None:
        """The calibrated times of `layer` at the job's shape, if the profile has them (its
        layers ran whole sequences in 16 or 32 bits: none with context parallelism or FP8)."""
        c, job = self.job.cfg, self.job
        if c.cp > 1 or c.precision is Precision.FP8:  # not what the profile timed
            return None
        key = layer_time_key(
            job.model, layer.kind, c.micro_batch, job.dtype, c.tp, c.flash_attention
        )
        return job.device.layer_time(key)

    def accumulates_in_pass(self, layer: Layer) -> bool:
        """The profile timed `layer`'s backward adding into gradients already in `.grad`."""
        measured = self.measured(layer)
        return measured is not None and measured.accumulate_s is not None

    def measured_scale(
        self, layer: Layer, forward: bool, ops: Sequence[ComputeOp], accumulating: bool = False
    ) -> float:
        """Calibrated layer times replace the roofline: scale each segment by measured/modelled
        (`accumulating`: a backward whose gradients add into `.grad`, where it was timed so)."""
        measured = self.measured(layer)
        modelled = self.op_seconds(ops)
        if measured is None or modelled <= 0:
            return 1.0
        if forward:
            return measured.forward_s / modelled
        if accumulating and measured.accumulate_s is not None:
            return measured.accumulate_s / modelled
        return measured.backward_s / modelled

    def run_ops(
        self,
        emit: Emitter[H],
        layer: Layer,
        ops: Sequence[ComputeOp],
        forward: bool,
        category: Category,
        deps: list[H],
        tag: str,
        gather: Callable[[ComputeOp, list[H], Callable[[], list[H]]], list[H]] | None = None,
        accumulating: bool = False,
    ) -> H:
        """Compute segments, split at TP communication points and (through `gather`) ZeRO-3's
        parameter gathers and ZeRO's gradient hooks; `emit` makes tasks, or times a fused pass."""
        scale = self.measured_scale(layer, forward, ops, accumulating)
        tp = _TpCollectives(self, emit, forward, category, tag, scale, deps)
        for op in ops:
            gathers = gather(op, tp.last, tp.ended) if gather else []
            if gathers:
                tp.flush()
                tp.last = tp.last + gathers
            tp.add(op)
        tp.flush()
        assert tp.ring is None, "a ring-exchanged gather with no GEMM after it in the pass"
        assert not tp.needed, "a re-gathered input with no wgrad after it in the pass"
        last = [*tp.last, *tp.beside]
        return last[0] if len(last) == 1 else emit.compute(f"{tag}.join", 0.0, category, last)

    def layer_pass(
        self,
        writer: ProgramWriter,
        layer: Layer,
        forward: bool,
        deps: list[Task],
        tag: str,
        gather: Gather,
        accumulating: bool = False,
        hooks: Gather | None = None,
    ) -> Task:
        """One layer's forward, or its backward with any recompute replay first
        (`accumulating`: its gradients add into `.grad`; `hooks`: the backward's own)."""
        passes = layer_passes(self.job.model, self.job.cfg, layer)
        if forward:
            return self.run_ops(
                writer, layer, passes.forward, True, Category.FORWARD, deps, tag, gather
            )
        if passes.replay:
            replay = passes.replay
            deps = [
                self.run_ops(
                    writer, layer, replay, True, Category.RECOMPUTE, deps, f"{tag}.re", gather
                )
            ]
        backward, category = passes.backward, Category.BACKWARD
        hooked = hooks or gather
        return self.run_ops(
            writer, layer, backward, False, category, deps, tag, hooked, accumulating
        )

    def fused_pass(
        self,
        writer: ProgramWriter,
        chunk: int,
        layers: Sequence[Layer],
        forward: bool,
        deps: list[Task],
        tag: str,
        accumulating: bool = False,
    ) -> Task:
        """A whole forward or backward of a chunk (its `layers` in running order) as one task,
        when every collective inside it takes a fixed time (TP on its own links): the same
        timing, far fewer events."""
        key = (chunk, forward, accumulating)
        if key not in self._fused:  # the same for every micro-batch
            parts: list[Part] = []
            offset = 0.0
            for layer in layers:
                layer_parts, seconds = self.pass_template(layer, forward, accumulating)
                parts += [p._replace(start_s=p.start_s + offset) for p in layer_parts]
                offset += seconds
            self._fused[key] = (tuple(parts), offset)
        parts_of_pass, seconds_of_pass = self._fused[key]
        category = Category.FORWARD if forward else Category.BACKWARD
        return writer.fused(tag, category, parts_of_pass, seconds_of_pass, deps)

    def pass_template(
        self, layer: Layer, forward: bool, accumulating: bool = False
    ) -> tuple[tuple[Part, ...], float]:
        key = (layer, forward, accumulating)
        if key not in self._templates:
            assert self.tp_time is not None  # fused passes need fixed-time TP collectives
            timer = PartTimer(self.tp_time)
            passes = layer_passes(self.job.model, self.job.cfg, layer)
            end = 0.0
            if forward:
                end = self.run_ops(
                    timer, layer, passes.forward, True, Category.FORWARD, [end], layer.name
                )
            else:
                if passes.replay:
                    replay, name = passes.replay, f"{layer.name}.re"
                    end = self.run_ops(timer, layer, replay, True, Category.RECOMPUTE, [end], name)
                end = self.run_ops(
                    timer,
                    layer,
                    passes.backward,
                    False,
                    Category.BACKWARD,
                    [end],
                    layer.name,
                    accumulating=accumulating,
                )
            self._templates[key] = (tuple(timer.parts), end)
        return self._templates[key]


class _TpCollectives(Generic[H]):
    """A pass's kernels as segments between Megatron's TP collectives (`tensor_parallel`):
    the collectives on the compute stream, or beside the GEMMs that hide them."""

    def __init__(
        self,
        kernels: LayerKernels,
        emit: Emitter[H],
        forward: bool,
        category: Category,
        tag: str,
        scale: float,
        deps: list[H],
    ) -> None:
        cfg = kernels.job.cfg
        self.kernels, self.emit, self.forward, self.category = kernels, emit, forward, category
        self.tag, self.scale, self.tp = tag, scale, cfg.tp
        self.points = tp_points(cfg, forward)
        self.regathered = regathered(cfg, forward)
        self.gathered_before = gathered_before(cfg, forward)
        self.overlap, self.slow = cfg.tp_comm_overlap, kernels.overlap_slowdown
        self.async_dgrad = cfg.async_tp_allreduce or cfg.sequence_parallel
        self.nbytes = tp_bytes(kernels.job.model, cfg)
        self.ce_bytes = cross_entropy_bytes(kernels.job.model, cfg)
        self.segment: list[ComputeOp] = []
        self.last: list[H] = deps
        self.beside: list[H] = []  # collectives beside the next wgrad GEMM (bulk)
        self.after_wgrad: list[CollectiveOp] = []  # blocking reduces after the next wgrad
        self.needed: list[H] = []  # the re-gathered input the next wgrad GEMM waits for
        self.ring: H | None = None  # a gather the next GEMM is ring-exchanged with
        self.cp = cfg.cp
        self.kv_bytes = kv_exchange_bytes(
            kernels.job.model, cfg.micro_batch, cfg.tp, cfg.cp, cfg.precision.bytes
        )
        self.kv: H | None = None  # context parallelism: the exchange the next step waits for
        self.exchanges_left = 0

    def _seconds(self, ops: list[ComputeOp]) -> float:
        """The ops' time, each GEMM TE overlaps on the SMs its kernels leave it."""
        seconds = self.kernels.op_seconds(ops)
        if self.slow:
            slowed = [(self.slow[op.name], op) for op in ops if op.name in self.slow]
            seconds += sum((f - 1.0) * self.kernels.op_seconds([op]) for f, op in slowed)
        return self.scale * seconds

    def flush(self) -> None:
        if self.segment:
            seconds, share = self._seconds(self.segment), self.kernels.sm_share(self.segment)
            name = f"{self.tag}.{self.segment[0].name}"
            self.last = [self.emit.compute(name, seconds, self.category, self.last, sm_share=share)]
            self.segment = []

    def ended(self) -> list[H]:
        self.flush()
        return self.last

    def _gemm(self, op: ComputeOp, share: float, deps: list[H], part: str) -> H:
        seconds = share * self._seconds([op])
        name = f"{self.tag}.{op.name}{part}"
        return self.emit.compute(name, seconds, self.category, deps, sm_share=1.0)

    def _comm(
        self, op: CollectiveOp, share: float, deps: list[H], stream: Stream, nbytes: float = 0.0
    ) -> H:
        comm = Comm(op, share * (nbytes or self.nbytes), Group.TP)
        return self.emit.comm(f"{self.tag}.tp_{op}", comm, Category.TP_COMM, deps, stream)

    def add(self, op: ComputeOp) -> None:
        if self.cp > 1 and op.kind is OpKind.ATTENTION:
            self._cp_step(op)
            return
        if op.name in self.gathered_before:
            self.flush()
            self.last = [self._comm(CollectiveOp.ALL_GATHER, 1.0, self.last, Stream.COMPUTE)]
        if op.name in self.regathered:  # the input again, for the wgrad, beside the dgrad
            self.flush()
            self.needed.append(self._comm(CollectiveOp.ALL_GATHER, 1.0, self.last, Stream.TP))
        if self.needed and op.name.endswith("_wgrad"):
            self.flush()
            self.last, self.needed = [*self.last, *self.needed], []
        if self.ring is not None and op.kind is OpKind.GEMM:
            self.flush()  # all but the last chunk's GEMM beside the ring's exchanges
            first = self._gemm(op, (self.tp - 1) / self.tp, self.last, "")
            self.last = [self._gemm(op, 1 / self.tp, [first, self.ring], ".last_chunk")]
            self.ring = None
            self._after(op)
            return
        if self.overlap and self.forward and op.name in PIPELINED:
            self.flush()
            self._pipelined(op)
            return
        self.segment.append(op)
        if self.beside and op.name.endswith("_wgrad"):
            self.flush()  # Megatron overlaps the input-gradient reduce with the wgrad GEMM
            self.last, self.beside = [*self.last, *self.beside], []
        if self.after_wgrad and op.name.endswith("_wgrad"):
            self.flush()  # without the async all-reduce, autograd's copy node reduces it
            for kind in self.after_wgrad:  # after the linear's node ran both GEMMs
                self.last = [self._comm(kind, 1.0, self.last, Stream.COMPUTE)]
            self.after_wgrad = []
        self._after(op)

    def _after(self, op: ComputeOp) -> None:
        """The collective Megatron issues after `op`, if any."""
        if self.forward and self.tp > 1 and op.name == "logits":
            self.flush()
            for _ in range(CROSS_ENTROPY_ALL_REDUCES):
                all_reduce = CollectiveOp.ALL_REDUCE
                self.last = [self._comm(all_reduce, 1.0, self.last, Stream.COMPUTE, self.ce_bytes)]
        kind = self.points.get(op.name)
        if kind is None:
            return
        self.flush()
        if self.overlap and op.name in RING_EXCHANGED_AFTER:
            self.ring = self._comm(kind, 1.0, self.last, Stream.TP)
        elif not self.forward and op.name.endswith("_dgrad") and not self.async_dgrad:
            self.after_wgrad.append(kind)
        elif not self.forward and op.name.endswith("_dgrad"):
            self.beside.append(self._comm(kind, 1.0, self.last, Stream.TP))
        else:
            self.last = [self._comm(kind, 1.0, self.last, Stream.COMPUTE)]

    def _cp_step(self, op: ComputeOp) -> None:
        """One of TE's context-parallel attention steps (`zsim.workload.context_parallel`),
        its ring exchange posted as it starts, beside it: in the forward the next step's keys
        and values, once its own have arrived; in the backward with them the key and value
        gradients of the step before (so after that step too), and beside the last step only
        those gradients, sent home, which the layer waits for."""
        self.flush()
        arrived = [] if self.kv is None else [self.kv]
        if not arrived:  # the pass's first step: the ring starts
            self.exchanges_left = self.cp - 1
        deps = [*self.last, *arrived]
        carried = not self.forward and bool(arrived)  # the previous step's gradients
        ahead = home = None
        if self.exchanges_left:
            nbytes = self.kv_bytes * (2.0 if carried else 1.0)
            ahead = self._cp_comm(deps if carried else (arrived or self.last), nbytes)
            self.exchanges_left -= 1
        elif carried:
            home = self._cp_comm(deps, self.kv_bytes)
        seconds = self._seconds([op])
        name = f"{self.tag}.{op.name}"
        step = self.emit.compute(name, seconds, self.category, deps, sm_share=1.0)
        self.kv = ahead
        self.last = [step] if home is None else [step, home]

    def _cp_comm(self, deps: list[H], nbytes: float) -> H:
        """A ring step: every rank of the group sends `nbytes` to the next; timed as the ring
        all-gather in which every rank sends that much (output cp x nbytes / (cp - 1))."""
        comm = Comm(CollectiveOp.ALL_GATHER, nbytes * self.cp / (self.cp - 1), Group.CP)
        return self.emit.comm(f"{self.tag}.cp_exchange", comm, Category.CP_COMM, deps, Stream.CP)

    def _pipelined(self, op: ComputeOp) -> None:
        """GEMM + reduce-scatter in PIPELINE_SPLITS chunks: each chunk's reduce-scatter runs
        beside the next chunk's GEMM; the last one's after it."""
        share = 1 / PIPELINE_SPLITS
        kind = self.points[op.name]
        first = self._gemm(op, share, self.last, ".chunk0")
        rest = self._gemm(op, 1 - share, [first], ".chunks")
        early = self._comm(kind, 1 - share, [first], Stream.TP)
        self.last = [self._comm(kind, share, [rest, early], Stream.TP)]
