"""The rows a calibration returns: one `Measurement` per microbenchmark and shape, with all its
repeat times (and, where the run recorded them, how many each worker launch gave).

Sizes follow nccl-tests (`doc/PERFORMANCE.md`): a collective's size S is the per-rank buffer
for all_reduce, broadcast and send/recv, the *output* for all_gather and the *input* for
reduce_scatter; algbw = S / t and busbw = algbw x `bus_factor`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np

from zsim.errors import InputError, is_whole, require

FIT_TOLERANCE = 0.10  # the 10% a fit is held to; a row's launches agree if one time is this close


class Kind(StrEnum):
    """What a measurement row times."""

    GEMM = "gemm"  # torch.mm / torch.bmm at (m, n, k) x batch
    MEMORY = "memory"  # a bandwidth-bound kernel (add, copy) over a size
    ATTENTION = "attention"  # fused scaled_dot_product_attention at a model's shape
    LAYER_FORWARD = "layer_forward"  # one module of the model, forward
    LAYER_BACKWARD = "layer_backward"  # the same module, backward
    LAYER_ACCUMULATE = "layer_accumulate"  # its backward again, adding into the gradients
    HOST_COPY = "host_copy"  # host -> device and device -> host (offload); a memcpy on CPU
    OPTIMIZER = "optimizer"  # one AdamW step over a flat fp32 tensor
    COLLECTIVE = "collective"  # a torch.distributed collective over a process group
    PINGPONG = "pingpong"  # one byte's TCP round trip between two ranks, halved (no gloo)
    ENGINE_HOST = "engine_host"  # a phase (op "z<stage>.<phase>") of a tiny DeepSpeed step


LAYER_FIELDS = {  # a layer row -> the LayerTime field it measures
    Kind.LAYER_FORWARD: "forward_s",
    Kind.LAYER_BACKWARD: "backward_s",
    Kind.LAYER_ACCUMULATE: "accumulate_s",
}


class Collective(StrEnum):
    """The torch.distributed calls DeepSpeed training issues (docs/collectives.md)."""

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
    params: int = 0  # OPTIMIZER: parameters stepped; ENGINE_HOST: layers
    layer_key: str = ""  # LAYER_*: zsim.cluster.device.layer_key of the layer and shape
    micro_batch: int = 0  # LAYER_*, ATTENTION
    group: str = ""  # COLLECTIVE, PINGPONG: intra, inter or full
    ranks: int = 0  # COLLECTIVE, PINGPONG: group size (ping-pong: the 2 ranks that played)
    link_class: str = ""  # COLLECTIVE, PINGPONG: the link class the group's traffic crosses
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
    def time_s(self) -> float:
        """What a call costs a step: the mean of the samples, the statistic every model is
        fitted to and scored against. A step sums its calls, and a sum's expected value is the
        sum of the means; a median leaves out a right tail that the step pays. On the shared
        2-core VM 25-50 % of the small and mid-size gloo collectives wait a scheduler tick
        (~3.5 ms, a 0.3 ms all_reduce of 256 KiB then takes 3.4): their means are 1.3-5x their
        medians, while compute rows' are within 1-15 % (`docs/collectives.md` 1.7). nccl-tests
        reports the mean too (its "time" is the average over its iterations)."""
        return float(np.mean(self.samples_s))

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
    def launch_times_s(self) -> tuple[float, ...]:
        """Each worker launch's `time_s` (one value when one launch measured)."""
        return tuple(float(np.mean(part)) for part in self._launch_parts())

    def _launch_parts(self) -> list[np.ndarray]:
        ends = np.cumsum(self.launch_samples or (len(self.samples_s),))
        return np.split(np.asarray(self.samples_s), ends[:-1])

    @property
    def launches_agree(self) -> bool | None:
        """Whether one time is within `FIT_TOLERANCE` of every launch's `time_s` (None: fewer
        than two launches recorded). Where not, the process a row was measured in moved it
        more than any one predicted time can follow."""
        if len(self.launch_samples) < 2:
            return None
        times = self.launch_times_s
        return max(times) * (1 - FIT_TOLERANCE) <= min(times) * (1 + FIT_TOLERANCE)

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
        if self.kind in LAYER_FIELDS:
            model = "-".join(self.layer_key.split("|", 1)[0].split("-")[:2])
            return f"{self.op} {self.kind.removeprefix('layer_')} mb{self.micro_batch} {model}"
        if self.kind is Kind.OPTIMIZER:
            return f"{self.op} {self.params} params"
        if self.kind is Kind.COLLECTIVE:
            return f"{self.op} {self.group} n={self.ranks} {_bytes(self.size_bytes)}"
        if self.kind is Kind.PINGPONG:
            return f"ping-pong {self.op} {self.group}"
        if self.kind is Kind.ENGINE_HOST:
            return f"DeepSpeed {self.op} of {self.params} tiny layers"
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
            ok = isinstance(counts, list) and all(is_whole(c, 1) for c in counts)
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
