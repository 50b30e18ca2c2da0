"""What a calibration run measures (`Plan`): which shapes, sizes, groups, repeats, rounds and
launches. The runner builds a Plan from the flags and hands it to every worker as JSON; the
workers return `zsim.calibrate.measurement.Measurement` rows, which the fit turns into a
profile. Both travel as plain dicts, so this module needs neither torch nor files.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from zsim.calibrate.measurement import Collective
from zsim.workload.model import ComputeOp, LayerKind, ModelKind, ModelSpec, OpKind
from zsim.workload.shapes import Shard, backward_ops, forward_ops

PROGRESS = "@zsim-progress"  # the worker's progress lines: PROGRESS DONE TOTAL LABEL
RANKS_ON_HOST_ENV = "ZSIM_RANKS_ON_HOST"  # all ranks on this machine, emulated nodes included


@dataclass(frozen=True)
class Plan:
    """Everything a worker needs to know; built by the runner, sent as JSON."""

    device: str  # cpu or cuda
    dtype: str  # fp32, bf16 or fp16
    models: tuple[ModelSpec, ...] = ()
    micro_batches: tuple[int, ...] = (1, 2, 4)
    tp_degrees: tuple[int, ...] = (1,)  # transformer layers are also timed as these TP shards
    flash_attention: bool = False
    gemm_shapes: tuple[tuple[int, int, int, int], ...] = ()
    memory_sizes_bytes: tuple[int, ...] = ()
    host_copy_sizes_bytes: tuple[int, ...] = ()
    adam_params: tuple[int, ...] = ()
    collectives: tuple[Collective, ...] = tuple(Collective)
    collective_sizes_bytes: tuple[int, ...] = ()
    topology: str = ""  # the measured cluster as a zsim topology name, e.g. 1x2-cpu
    link_classes: dict[str, str] = field(default_factory=dict)  # group -> link class
    warmup: int = 3
    repeats: int = 9  # samples per row at least, spread over the rounds
    max_repeats: int = 150  # samples per row at most (fast rows get more, robust statistics)
    rounds: int = 3  # passes over the whole set, so a slow spell of a shared host hits every row
    # worker processes the rounds are spread over: the OS places a process's threads once
    # (2 gloo ranks on 2 cores ran all_reduce 1.65x apart, process to process), so a row's
    # samples come from several placements, as training launches get them
    launches: int = 1
    min_sample_s: float = 2e-4  # tiny ops are looped until one sample takes this long
    max_row_s: float = 4.0  # time per row (all rounds) beyond `repeats` samples
    engine_host: bool = False  # time DeepSpeed's host work per call (`engine_host`; CPU ranks)

    def per_launch(self) -> Plan:
        """What one of `launches` worker processes measures: its share of the rounds, of the
        samples and of the time per row (all launches together measure what the plan says)."""
        k = self.launches
        return dataclasses.replace(
            self,
            rounds=max(1, self.rounds // k),
            repeats=math.ceil(self.repeats / k),
            max_repeats=math.ceil(self.max_repeats / k),
            max_row_s=self.max_row_s / k,
            launches=1,
        )

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["models"] = [_model_dict(m) for m in self.models]
        return out

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Plan:
        values = dict(d)
        values["models"] = tuple(
            ModelSpec(**dict(m, kind=ModelKind(m["kind"]))) for m in d["models"]
        )
        values["collectives"] = tuple(Collective(c) for c in d["collectives"])
        values["gemm_shapes"] = tuple(tuple(s) for s in d["gemm_shapes"])
        for name in (
            "micro_batches",
            "tp_degrees",
            "memory_sizes_bytes",
            "host_copy_sizes_bytes",
            "adam_params",
            "collective_sizes_bytes",
        ):
            values[name] = tuple(d[name])
        return Plan(**values)


def _model_dict(model: ModelSpec) -> dict[str, Any]:
    return {
        k: str(v) if isinstance(v, ModelKind) else v for k, v in dataclasses.asdict(model).items()
    }


# ---- what to measure ----------------------------------------------------------------------


def powers(start: int, stop: int, factor: int = 4) -> tuple[int, ...]:
    """start, start*factor, ... up to and including stop."""
    out = [start]
    while out[-1] * factor <= stop:
        out.append(out[-1] * factor)
    return tuple(out)


def model_gemm_shapes(
    model: ModelSpec,
    micro_batches: tuple[int, ...],
    flash_attention: bool,
    tp_degrees: tuple[int, ...] = (1,),
) -> set[tuple[int, int, int, int]]:
    """The (m, n, k, batch) of every GEMM the simulator will time for `model`: the forward
    GEMMs and their backward ones (`shapes.backward_ops`), at each micro-batch size and TP
    degree."""
    shapes: set[tuple[int, int, int, int]] = set()
    layers = {layer.kind: layer for layer in model.layer_list()}
    for mb, tp in ((mb, tp) for mb in micro_batches for tp in layer_tp_degrees(model, tp_degrees)):
        for layer in layers.values():
            forward = forward_ops(model, layer, Shard(mb, tp, flash_attention=flash_attention))
            for op in (*forward, *backward_ops(forward)):
                if op.kind is OpKind.GEMM:
                    shapes.add((*op.gemm_shape, op.gemm_batch))
    return shapes


def attention_ops(
    model: ModelSpec, micro_batches: tuple[int, ...], dtype_bytes: int
) -> list[tuple[int, ComputeOp]]:
    """(micro-batch, the fused attention op) of a transformer, at each micro-batch size."""
    if model.kind is not ModelKind.TRANSFORMER:
        return []
    block = next(la for la in model.layer_list() if la.kind is LayerKind.BLOCK)
    out = []
    for mb in micro_batches:
        ops = forward_ops(model, block, Shard(mb, flash_attention=True, dtype_bytes=dtype_bytes))
        out += [(mb, op) for op in ops if op.kind is OpKind.ATTENTION]
    return out


def layer_kinds(model: ModelSpec) -> list[LayerKind]:
    """The distinct layer kinds of a model, in forward order."""
    seen: list[LayerKind] = []
    for layer in model.layer_list():
        if layer.kind not in seen and layer.kind is not LayerKind.TIED_COPY:
            seen.append(layer.kind)
    return seen


def layer_tp_degrees(model: ModelSpec, tp_degrees: tuple[int, ...]) -> tuple[int, ...]:
    """The TP degrees a model's layers are timed at: 1 always; others for transformers whose
    heads, kv-heads and ffn width they divide (an MLP's layers are never split)."""
    if model.kind is not ModelKind.TRANSFORMER:
        return (1,)
    split = [
        t
        for t in tp_degrees
        if t > 1 and not (model.heads % t or model.n_kv_heads % t or model.ffn_hidden % t)
    ]
    return (1, *sorted(set(split)))


MAX_SWEEP_FLOPS = {"cpu": 2e10, "cuda": 1.2e12}
"""The largest GEMM a sweep times (model GEMMs above it are in their layers' times): the 2048^3
square on a CPU; on a GPU the 8192^3 square, ~1.4 ms on an H200, where its bf16 rate tops out
(KINDS.md of the device library: 8192^3 bf16 at 769-798 TFLOP/s)."""
MAX_MEMORY_BYTES = {"cpu": 256 * 2**20, "cuda": 2**30}
"""The largest elementwise / copy buffer: the DRAM regime the memory-bound model is fitted on
starts at 4x the last-level cache (`zsim.calibrate.fit.in_model_regime`): 32 MiB of L3 here,
an H200's 60 MB of L2 (240 MB) needs sizes out to a gigabyte."""


def default_plan(
    device: str,
    dtype: str,
    models: tuple[ModelSpec, ...],
    micro_batches: tuple[int, ...],
    quick: bool,
    flash_attention: bool = False,
    topology: str = "",
    tp_degrees: tuple[int, ...] = (1,),
    link_classes: dict[str, str] | None = None,
    max_collective_bytes: int = 256 * 2**20,
    launches: int | None = None,
) -> Plan:
    """The standard measurement set; `quick` is a small one for tests (well under a minute).
    `launches` defaults to 3 worker processes on CPU, where placement varies from process to
    process, and 1 on CUDA or `quick`."""
    if launches is None:
        launches = 1 if quick or device == "cuda" else 3
    largest = MAX_SWEEP_FLOPS[device]
    squares = (16, 64, 256, 512) if quick else powers(16, round((largest / 2) ** (1 / 3)), 2)
    gemms = {(s, s, s, 1) for s in squares}
    for model in models:  # the giant ones (a large vocabulary's logits) are timed as layers
        gemms |= {
            s
            for s in model_gemm_shapes(model, micro_batches, flash_attention, tp_degrees)
            if 2.0 * s[0] * s[1] * s[2] * s[3] <= largest
        }
    mib = 2**20
    return Plan(
        device=device,
        dtype=dtype,
        models=models,
        micro_batches=micro_batches,
        tp_degrees=tp_degrees,
        flash_attention=flash_attention,
        gemm_shapes=tuple(sorted(gemms, key=lambda s: (2 * s[0] * s[1] * s[2] * s[3], s))),
        # 64 B and 256 B: the fixed overhead alone; then from cache out to DRAM
        memory_sizes_bytes=(64, 256, 16 * mib)
        if quick
        else (64, 256, *powers(64 * 1024, MAX_MEMORY_BYTES[device])),
        host_copy_sizes_bytes=(16 * mib,) if quick else (64 * mib, 128 * mib, 256 * mib),
        adam_params=(2**20,) if quick else (2**22, 2**23, 2**24, 2**25),
        # 8 B: the gradient-norm all_reduce DeepSpeed issues every step
        collective_sizes_bytes=(8, 1024, 64 * 1024, 4 * mib)
        if quick
        else (8, *powers(1024, max_collective_bytes)),
        topology=topology,
        link_classes=dict(link_classes or {}),
        warmup=1 if quick else 3,
        repeats=5 if quick else 9,
        max_repeats=15 if quick else 150,
        rounds=max(1 if quick else 3, launches),
        launches=launches,
        max_row_s=0.3 if quick else 4.0,
        engine_host=device == "cpu" and not quick,
    )
