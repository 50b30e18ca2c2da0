"""What a calibration run measures (`Plan`), and the rows it returns (`Measurement`).

The runner builds a Plan from the flags and hands it to every worker as JSON; the workers
return Measurement rows (each with all its repeat times), which the fit turns into a profile.
Both travel as plain dicts, so this module needs neither torch nor files.

Sizes follow nccl-tests (`doc/PERFORMANCE.md`): a collective's size S is the per-rank buffer
for all_reduce, broadcast and send/recv, the *output* for all_gather and the *input* for
reduce_scatter; algbw = S / t and busbw = algbw x `bus_factor`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np

from zsim.errors import InputError, require
from zsim.workload.model import ComputeOp, LayerKind, ModelKind, ModelSpec, OpKind
from zsim.workload.shapes import Shard, backward_ops, forward_ops

PROGRESS = "@zsim-progress"  # the worker's progress lines: PROGRESS DONE TOTAL LABEL
RANKS_ON_HOST_ENV = "ZSIM_RANKS_ON_HOST"  # all ranks on this machine, emulated nodes included
FIT_TOLERANCE = 0.10  # the 10% a fit is held to; a row's launches agree if one time is this close


class Kind(StrEnum):
    """What a measurement row times."""

    GEMM = "gemm"  # torch.mm / torch.bmm at (m, n, k) x batch
    MEMORY = "memory"  # a bandwidth-bound kernel (add, copy) over a size
    ATTENTION = "attention"  # fused scaled_dot_product_attention at a model's shape
    LAYER_FORWARD = "layer_forward"  # one module of the model, forward
    LAYER_BACKWARD = "layer_backward"  # the same module, backward
    HOST_COPY = "host_copy"  # host -> device and device -> host (offload); a memcpy on CPU
    OPTIMIZER = "optimizer"  # one AdamW step over a flat fp32 tensor
    COLLECTIVE = "collective"  # a torch.distributed collective over a process group


class Collective(StrEnum):
    """The torch.distributed calls DeepSpeed training issues (see notes/collectives_algorithms)."""

    ALL_GATHER = "all_gather_into_tensor"
    REDUCE_SCATTER = "reduce_scatter_tensor"
    ALL_REDUCE = "all_reduce"
    BROADCAST = "broadcast"
    SENDRECV = "sendrecv"  # every rank sends to rank+1 and receives from rank-1 at once


def bus_factor(op: Collective, ranks: int) -> float:
    """nccl-tests' busbw / algbw factor (`src/*.cu` `*GetBw`)."""
    if op in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER):
        return (ranks - 1) / ranks
    if op is Collective.ALL_REDUCE:
        return 2 * (ranks - 1) / ranks
    return 1.0


def algbw(row: Measurement, seconds: float) -> float:
    """nccl-tests' algorithm bandwidth of a collective row taking `seconds`: S / t, B/s."""
    return row.size_bytes / seconds


def busbw(row: Measurement, seconds: float) -> float:
    """nccl-tests' bus bandwidth: algbw x `bus_factor`, comparable across ops and ranks."""
    return algbw(row, seconds) * bus_factor(Collective(row.op), row.ranks)


@dataclass(frozen=True)
class Measurement:
    """One measured quantity: its repeat times (seconds per call, max over ranks) and what it is.

    Only the fields that apply to the kind are set; the others keep their zero defaults.
    """

    kind: Kind
    op: str
    dtype: str
    samples_s: tuple[float, ...]
    size_bytes: float = 0.0  # MEMORY: bytes moved; HOST_COPY: bytes copied; COLLECTIVE: S
    flops: float = 0.0  # GEMM, ATTENTION
    shape: tuple[int, int, int, int] = (0, 0, 0, 0)  # GEMM: (m, n, k, batch)
    params: int = 0  # OPTIMIZER: parameters stepped
    layer_key: str = ""  # LAYER_*: zsim.cluster.device.layer_key of the layer and shape
    micro_batch: int = 0  # LAYER_*, ATTENTION
    group: str = ""  # COLLECTIVE: intra, inter or full
    ranks: int = 0  # COLLECTIVE: group size
    link_class: str = ""  # COLLECTIVE: the topology's link class the group's traffic crosses
    inner: int = 1  # calls per timed sample (small ops are timed in loops)
    dropped: int = 0  # samples discarded (all ranks): the rank lost its core during them
    launch_samples: tuple[int, ...] = ()  # samples of each worker launch, in order; () if one

    def __post_init__(self) -> None:
        require(len(self.samples_s) > 0, "samples_s", self.samples_s, "at least one sample")
        require(
            not self.launch_samples or sum(self.launch_samples) == len(self.samples_s),
            "launch_samples",
            self.launch_samples,
            f"counts adding up to the {len(self.samples_s)} samples",
        )

    @property
    def median_s(self) -> float:
        return float(np.median(self.samples_s))

    @property
    def q1_s(self) -> float:
        return float(np.percentile(self.samples_s, 25))

    @property
    def q3_s(self) -> float:
        return float(np.percentile(self.samples_s, 75))

    @property
    def launch_medians_s(self) -> tuple[float, ...]:
        """The median of each worker launch's samples (one value when one launch measured)."""
        ends = np.cumsum(self.launch_samples or (len(self.samples_s),))
        parts = np.split(np.asarray(self.samples_s), ends[:-1])
        return tuple(float(np.median(part)) for part in parts)

    @property
    def launches_agree(self) -> bool | None:
        """Whether one time is within `FIT_TOLERANCE` of every launch's median (None: fewer
        than two launches recorded). Where not, the process a row was measured in moved it
        more than any one predicted time can follow."""
        if len(self.launch_samples) < 2:
            return None
        medians = self.launch_medians_s
        return max(medians) * (1 - FIT_TOLERANCE) <= min(medians) * (1 + FIT_TOLERANCE)

    @property
    def iqr_rel(self) -> float:
        """The spread: interquartile range over the median."""
        return (self.q3_s - self.q1_s) / self.median_s

    @property
    def label(self) -> str:
        """A short human name for tables and error messages."""
        if self.kind is Kind.GEMM:
            m, n, k, b = self.shape
            return f"{self.op} {m}x{n}x{k}" + (f" x{b}" if b > 1 else "")
        if self.kind in (Kind.LAYER_FORWARD, Kind.LAYER_BACKWARD):
            model = "-".join(self.layer_key.split("|", 1)[0].split("-")[:2])
            return f"{self.op} {self.kind.removeprefix('layer_')} mb{self.micro_batch} {model}"
        if self.kind is Kind.OPTIMIZER:
            return f"{self.op} {self.params} params"
        if self.kind is Kind.COLLECTIVE:
            return f"{self.op} {self.group} n={self.ranks} {_bytes(self.size_bytes)}"
        if self.kind is Kind.ATTENTION:
            return f"{self.op} mb{self.micro_batch} {self.flops:.3g} FLOP"
        return f"{self.op} {_bytes(self.size_bytes)}"

    def with_samples(self, samples_s: tuple[float, ...]) -> Measurement:
        return dataclasses.replace(self, samples_s=samples_s)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            k: (list(v) if isinstance(v, tuple) else str(v) if isinstance(v, Kind) else v)
            for k, v in dataclasses.asdict(self).items()
        }
        if not self.launch_samples:
            del out["launch_samples"]  # one launch (and every profile written before the field)
        return out

    @staticmethod
    def from_dict(row: dict[str, Any]) -> Measurement:
        known = {f.name for f in dataclasses.fields(Measurement)}
        extra = sorted(set(row) - known)
        require(not extra, "measurement", extra, f"only the fields {sorted(known)}")
        for name in ("kind", "op", "dtype", "samples_s"):
            require(name in row, f"measurement.{name}", None, "present in every measurement")
        try:
            kind = Kind(row["kind"])
        except ValueError:
            raise InputError("measurement.kind", row["kind"], "one of " + ", ".join(Kind)) from None
        samples = row["samples_s"]
        ok = isinstance(samples, list) and all(
            isinstance(s, int | float) and not isinstance(s, bool) and s > 0 for s in samples
        )
        require(ok and len(samples) > 0, "measurement.samples_s", samples, "positive seconds")
        values = dict(row, kind=kind, samples_s=tuple(float(s) for s in samples))
        if "shape" in row:
            values["shape"] = tuple(int(x) for x in row["shape"])
        if "launch_samples" in row:
            counts = row["launch_samples"]
            ok = isinstance(counts, list) and all(
                isinstance(c, int) and not isinstance(c, bool) and c > 0 for c in counts
            )
            require(ok, "measurement.launch_samples", counts, "positive sample counts")
            values["launch_samples"] = tuple(counts)
        return Measurement(**values)


def merge_launches(launches: Sequence[list[Measurement]]) -> list[Measurement]:
    """The rows of several worker launches as one, each row knowing its launches' samples."""
    rows: list[Measurement] = []
    for launch in launches:
        rows = merge(rows, launch)
    if len(launches) < 2:
        return rows
    counts = zip(*([len(r.samples_s) for r in launch] for launch in launches), strict=True)
    return [dataclasses.replace(r, launch_samples=c) for r, c in zip(rows, counts, strict=True)]


def merge(before: list[Measurement], new: list[Measurement]) -> list[Measurement]:
    """The rows of one more round (or launch) appended to the same rows measured before."""
    if not before:
        return new
    require(
        [(a.kind, a.label) for a in before] == [(b.kind, b.label) for b in new],
        "measurements",
        len(new),
        "the same rows in every round and launch",
    )
    return [
        dataclasses.replace(a, samples_s=a.samples_s + b.samples_s, dropped=a.dropped + b.dropped)
        for a, b in zip(before, new, strict=True)
    ]


def _bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n:g} B"


@dataclass(frozen=True)
class Plan:
    """Everything a worker needs to know; built by the runner, sent as JSON."""

    device: str  # cpu or cuda
    dtype: str  # fp32, bf16 or fp16
    models: tuple[ModelSpec, ...] = ()
    micro_batches: tuple[int, ...] = (1, 2, 4)
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
    max_repeats: int = 150  # samples per row at most (fast rows get more, for robust medians)
    rounds: int = 3  # passes over the whole set, so a slow spell of a shared host hits every row
    # worker processes the rounds are spread over: the OS places a process's threads once
    # (2 gloo ranks on 2 cores ran all_reduce 1.65x apart, process to process), so a row's
    # samples come from several placements, as training launches get them
    launches: int = 1
    min_sample_s: float = 2e-4  # tiny ops are looped until one sample takes this long
    max_row_s: float = 4.0  # time per row (all rounds) beyond `repeats` samples

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
    model: ModelSpec, micro_batches: tuple[int, ...], flash_attention: bool
) -> set[tuple[int, int, int, int]]:
    """The (m, n, k, batch) of every GEMM the simulator will time for `model`: the forward
    GEMMs and their backward ones (`shapes.backward_ops`), at each micro-batch size."""
    shapes: set[tuple[int, int, int, int]] = set()
    layers = {layer.kind: layer for layer in model.layer_list()}
    for mb in micro_batches:
        for layer in layers.values():
            forward = forward_ops(model, layer, Shard(mb, flash_attention=flash_attention))
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
            for s in model_gemm_shapes(model, micro_batches, flash_attention)
            if 2.0 * s[0] * s[1] * s[2] * s[3] <= largest
        }
    mib = 2**20
    return Plan(
        device=device,
        dtype=dtype,
        models=models,
        micro_batches=micro_batches,
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
    )
