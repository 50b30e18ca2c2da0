"""The compute of a layer's passes: its kernels timed by the device profile, split where
Megatron's tensor parallelism communicates and where ZeRO-3 waits for gathered parameters.

A pass whose collectives all take a fixed time (TP on links nothing else uses) is timed once
and becomes one task per micro-batch (`fused_pass`): the same timing, far fewer events.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from zsim.cluster.device import layer_time_key
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
from zsim.step.tensor_parallel import tp_bytes, tp_points
from zsim.workload.layout import layer_passes
from zsim.workload.model import ComputeOp, Layer

H = TypeVar("H")
Gather = Callable[[ComputeOp, list[Task]], list[Task]]
"""ZeRO-3's hook at an op: the gathers to wait for before it (none outside stage 3)."""


class LayerKernels:
    """Times and emits layer passes; caches what is the same for every micro-batch."""

    def __init__(self, job: StageJob, tp_time: Callable[[Comm], float] | None) -> None:
        self.job = job
        self.tp_time = tp_time  # fixed TP collective times: whole passes become one task
        self._seconds: dict[tuple[ComputeOp, ...], float] = {}
        self._templates: dict[tuple[Layer, bool], tuple[tuple[Part, ...], float]] = {}
        self._fused: dict[tuple[int, bool], tuple[tuple[Part, ...], float]] = {}

    @property
    def can_fuse(self) -> bool:
        return self.tp_time is not None

    def op_seconds(self, ops: Sequence[ComputeOp]) -> float:
        key = tuple(ops)
        if key not in self._seconds:
            device, dtype = self.job.device, self.job.dtype
            self._seconds[key] = sum(device.op_time_s(op, dtype) for op in ops)
        return self._seconds[key]

    def measured_scale(self, layer: Layer, forward: bool, ops: Sequence[ComputeOp]) -> float:
        """Calibrated layer times replace the roofline: scale each segment by measured/modelled."""
        c, job = self.job.cfg, self.job
        key = layer_time_key(
            job.model, layer.kind, c.micro_batch, job.dtype, c.tp, c.flash_attention
        )
        measured = job.device.layer_time(key)
        modelled = self.op_seconds(ops)
        if measured is None or modelled <= 0:
            return 1.0
        return (measured.forward_s if forward else measured.backward_s) / modelled

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
        points = tp_points(self.job.cfg, forward)
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
                comm = Comm(points[op.name], tp_bytes(self.job.model, self.job.cfg), Group.TP)
                name = f"{tag}.tp_{comm.op}"
                if not forward and op.name.endswith("_dgrad"):
                    overlapped = emit.comm(name, comm, Category.TP_COMM, last, Stream.TP)
                else:
                    last = [emit.comm(name, comm, Category.TP_COMM, last)]
        flush()
        if overlapped is not None:
            last = [*last, overlapped]
        return last[0] if len(last) == 1 else emit.compute(f"{tag}.join", 0.0, category, last)

    def layer_pass(
        self,
        writer: ProgramWriter,
        layer: Layer,
        forward: bool,
        deps: list[Task],
        tag: str,
        gather: Gather,
    ) -> Task:
        """One layer's forward, or its backward with any recompute replay first."""
        passes = layer_passes(self.job.model, self.job.cfg, layer)
        if forward:
            return self.run_ops(
                writer, layer, passes.forward, True, Category.FORWARD, deps, tag, gather
            )
        if passes.replay:
            deps = [
                self.run_ops(
                    writer,
                    layer,
                    passes.replay,
                    True,
                    Category.RECOMPUTE,
                    deps,
                    f"{tag}.re",
                    gather,
                )
            ]
        return self.run_ops(
            writer, layer, passes.backward, False, Category.BACKWARD, deps, tag, gather
        )

    def fused_pass(
        self,
        writer: ProgramWriter,
        chunk: int,
        layers: Sequence[Layer],
        forward: bool,
        deps: list[Task],
        tag: str,
    ) -> Task:
        """A whole forward or backward of a chunk (its `layers` in running order) as one task,
        when every collective inside it takes a fixed time (TP on its own links): the same
        timing, far fewer events."""
        key = (chunk, forward)
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
        return writer.fused(tag, category, parts_of_pass, seconds_of_pass, deps)

    def pass_template(self, layer: Layer, forward: bool) -> tuple[tuple[Part, ...], float]:
        key = (layer, forward)
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
