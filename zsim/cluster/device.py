"""The device model: memory, peak rates and the fitted time of each kernel.

A GPU preset is a spec sheet (peaks, memory) plus an efficiency fitted from public
microbenchmarks (`zsim.cluster.gpu_spec`): never from end-to-end training runs. A calibrated
profile (`zsim calibrate`) replaces the fit with local measurements and may carry measured
times of whole layers, which take precedence.

Kernel time model (one place): a GEMM takes `overhead + max(flops / gemm_rate + outputs x
per_output, bytes / memory_rate)` (a roofline, the compute side with a cost per output element
where the fit has one); a bandwidth-bound
kernel takes `overhead + bytes / memory_rate`; a fused attention kernel `overhead + flops /
attention_rate`. The rates are achieved rates at large sizes; the overhead is the fitted
intercept (launch plus tail effects).

Also the names calibration and the simulator share: the key of a measured layer time, and the
bytes an Adam step streams per parameter (the conversion behind `optimizer_bytes_per_s`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from itertools import pairwise

from zsim.cluster.flash_rates import time_scale
from zsim.errors import InputError
from zsim.workload.model import ComputeOp, LayerKind, ModelKind, ModelSpec, OpKind

GiB = 1024**3


GB = 1e9


@dataclass(frozen=True)
class ComputeRates:
    """Achieved rates of one dtype on one device."""

    gemm_flops_per_s: float
    gemm_overhead_s: float
    attention_flops_per_s: float
    memory_bytes_per_s: float
    memory_overhead_s: float
    # a GEMM's cost per output element (its tiles' epilogue and fill, amortized over k): what
    # makes small-k GEMMs slow at any size; 0 where the fit has no such term
    gemm_s_per_output: float = 0.0
    # the figure (zsim.cluster.flash_rates) that scales the attention rate by mask, kernel and
    # shape, and the (head dim, sequence) it was measured at; "" where it is used as measured
    flash_family: str = ""
    flash_anchor: tuple[int, int] = (0, 0)

    def op_time_s(self, op: ComputeOp) -> float:
        if op.kind is OpKind.GEMM:  # roofline: thin GEMMs (attention's, small k) stream
            m, n, _ = op.gemm_shape
            compute = (
                op.flops / self.gemm_flops_per_s + m * n * op.gemm_batch * self.gemm_s_per_output
            )
            return self.gemm_overhead_s + max(compute, op.bytes_moved / self.memory_bytes_per_s)
        if op.kind is OpKind.ATTENTION:
            scale = 1.0
            if self.flash_family and op.attention is not None:
                scale = time_scale(self.flash_family, self.flash_anchor, op.attention)
            return self.gemm_overhead_s + op.flops * scale / self.attention_flops_per_s
        return op.kernels * self.memory_overhead_s + op.bytes_moved / self.memory_bytes_per_s


@dataclass(frozen=True)
class LayerTime:
    """Measured forward and backward time of one layer at one shape (calibration).

    `accumulate_s`: its backward when `.grad` already holds an earlier micro-batch's
    gradients, so that autograd's AccumulateGrad adds into them inside the pass instead of
    keeping the new tensors (None: not measured)."""

    forward_s: float
    backward_s: float
    accumulate_s: float | None = None


@dataclass(frozen=True)
class LinkFit:
    """A link class's fitted latency and bandwidth (per direction), from calibration."""

    latency_s: float
    bandwidth_bytes_per_s: float


@dataclass(frozen=True)
class DeviceProfile:
    """What the simulator knows of one device (a GPU, or a CPU socket acting as one)."""

    name: str
    memory_bytes: float
    reserved_bytes: float
    peak_flops: Mapping[str, float]
    rates: Mapping[str, ComputeRates]  # by dtype name: fp16, bf16, fp32
    host_link_bytes_per_s: float  # device <-> host copies (offload)
    optimizer_bytes_per_s: float  # streaming rate of the fused Adam step on the device
    host_adam_params_per_s: float = 0.0  # CPU Adam rate for offload; 0 = unknown
    host_memory_bytes: float = 0.0  # this rank's share of its host's DRAM (offload); 0 = unknown
    sm_count: int = 0  # streaming multiprocessors (spec sheet); 0 = unknown (CPU ranks)
    layer_times: Mapping[str, LayerTime] = field(default_factory=dict)
    links: Mapping[str, LinkFit] = field(default_factory=dict)  # by link class; overrides presets
    call_latency_s: float | None = None  # fitted fixed cost per collective call; None = preset's
    message_s: float | None = None  # fitted CPU per gloo message a rank handles; None = preset's
    first_touch_bytes_per_s: float | None = None  # fitted page faults of fresh memory (gloo)
    # fitted fixed cost of a gloo send/recv (posted on the caller's thread, not the process
    # group's worker queue); None = call_latency_s
    p2p_call_latency_s: float | None = None
    # fitted CPU seconds per byte a rank sends plus receives in each gloo op (by CollectiveOp
    # value) beyond the wire and the modelled copies and sums (fabric.LocalWork.op_s_per_byte)
    op_s_per_byte: Mapping[str, float] = field(default_factory=dict)
    # fitted CPU seconds per call of each gloo op beyond call_latency_s (fabric.LocalWork.op_call_s)
    op_call_s: Mapping[str, float] = field(default_factory=dict)
    # DeepSpeed's own host seconds beyond what the simulator charges, per call ("z<stage>.
    # <phase>": forward, backward, step) and per parameter tensor ("..._per_tensor"):
    # calibrate.engine_fit, CPU ranks only
    engine_host_s: Mapping[str, float] = field(default_factory=dict)
    # DeepSpeed ZeRO-3's host seconds per data-parallel rank of a call ("gather_issue" per
    # coalesced gather; "gather_wait", "reduce" per parameter as well): calibrate.zero3_host,
    # GPU ranks (a CPU rank's engine_host_s holds its own at its world size)
    zero3_rank_host_s: Mapping[str, float] = field(default_factory=dict)
    backend: str = "nccl"  # "gloo" for CPU ranks: collectives and stream semantics differ
    notes: tuple[str, ...] = ()

    @property
    def usable_bytes(self) -> float:
        return self.memory_bytes - self.reserved_bytes

    def rates_for(self, dtype: str) -> ComputeRates:
        if dtype not in self.rates:
            raise InputError(
                "precision",
                dtype,
                f"one this device profile has rates for: {', '.join(self.rates)}",
            )
        return self.rates[dtype]

    def op_time_s(self, op: ComputeOp, dtype: str) -> float:
        return self.rates_for("fp8" if op.fp8 else dtype).op_time_s(op)

    def copy_time_s(self, nbytes: float, dtype: str) -> float:
        """A device-memory copy of `nbytes` (flatten, copy into a bucket, scale in place).

        A bandwidth-bound kernel's rate counts bytes read plus written, so a copy moves its
        bytes at half of it. On a CPU profile (gloo) the host link *is* the CPU's own copy:
        calibration times torch's `copy_` on the host, which is what DeepSpeed's copies are.
        """
        if self.backend == "gloo":
            return nbytes / self.host_link_bytes_per_s
        return 2 * nbytes / self.rates_for(dtype).memory_bytes_per_s

    def layer_time(self, key: str) -> LayerTime | None:
        return self.layer_times.get(key)


def with_memory(profile: DeviceProfile, memory_bytes: float) -> DeviceProfile:
    return replace(profile, memory_bytes=memory_bytes)


def fits(total_bytes: float, profile: DeviceProfile) -> bool:
    return total_bytes <= profile.usable_bytes and math.isfinite(total_bytes)


# ---- names shared with calibration --------------------------------------------------------

ADAM_STEP_BYTES_PER_PARAM = 28
"""Bytes one Adam(W) step moves per parameter, counted as a fused kernel would: the fp32
master weight, m and v are each read and written (3 x 2 x 4 = 24) and the gradient is read
(4 in fp32; in mixed precision a 2-byte gradient read plus a 2-byte low-precision weight write,
also 4). Calibration times torch's AdamW per parameter and reports
`optimizer_bytes_per_s = params_per_s * ADAM_STEP_BYTES_PER_PARAM`, so a simulator that charges
`params * ADAM_STEP_BYTES_PER_PARAM / optimizer_bytes_per_s` recovers the measured time."""


ZERO3_HOST_COSTS = ("gather_issue", "gather_wait", "reduce")
"""The keys of a profile's `zero3_rank_host_s` (seconds per rank: per coalesced gather; per
parameter of its first wait; per gradient of a reduce-scatter call): zsim.step.zero3_host."""


FSDP_TINY_UNIT_BYTES = 4 * 64 * 64
"""A unit of the host-time microbenchmark's tiny FSDP2 step (Linear(64, 64), fp32): its costs
per call, unit and tensor (`calibrate.engine_fit`) are what a unit of this size pays."""
FSDP_UNIT_SWEEP_MIB = (1, 16)
"""Unit sizes (MiB of fp32 parameters) at which calibration also times that step: what a
unit of each size costs beyond the tiny one's is engine_host_s "<call>_per_unit_at_<n>MiB"."""


def per_unit_at_key(call: str, mib: int) -> str:
    return f"{call}_per_unit_at_{mib}MiB"


def unit_size_extra_s(host: Mapping[str, float], call: str, unit_bytes: float) -> float:
    """What one FSDP2 unit of `unit_bytes` costs per `call` beyond the tiny unit's: linear in
    the unit's bytes between the measured sizes (0 at the tiny unit's and below it), on the
    last two's slope beyond the largest; 0 where the profile measured no sizes."""
    points = [(float(FSDP_TINY_UNIT_BYTES), 0.0)] + [
        (float(mib << 20), host[per_unit_at_key(call, mib)])
        for mib in FSDP_UNIT_SWEEP_MIB
        if per_unit_at_key(call, mib) in host
    ]
    if len(points) == 1 or unit_bytes <= points[0][0]:
        return 0.0
    (b0, e0), (b1, e1) = next(
        (pair for pair in pairwise(points) if unit_bytes <= pair[1][0]),
        points[-2:],
    )
    return max(0.0, e0 + (e1 - e0) * (unit_bytes - b0) / (b1 - b0))


def layer_key(model_signature: str, layer_kind: str, micro_batch: int, tp: int, dtype: str) -> str:
    """The key under which calibration stores a measured layer time."""
    return f"{model_signature}|{layer_kind}|mb{micro_batch}|tp{tp}|{dtype}"


def model_signature(model: ModelSpec, flash_attention: bool = False) -> str:
    """Everything about a model that changes the time of one of its layers, as a short string.

    The layer count and the preset's name are left out (a layer's time does not depend on how
    many there are or what the model is called), so `gpt-125m` with 2 layers and with 12 share
    their layer times. Example: `transformer-h768-a12-kv12-f3072-s128-v50257-bias-drop-pos-tied`.
    """
    if model.kind is ModelKind.MLP:
        return f"mlp-h{model.hidden}" + ("-bias" if model.bias else "")
    if model.kind is ModelKind.PARAMS_ONLY:
        return f"params-{model.params_override}"
    flags = (
        ("gated", model.gated_mlp),
        ("rms", model.rmsnorm),
        ("bias", model.bias),
        ("drop", model.dropout),
        ("pos", model.learned_positions),
        ("tied", model.tied_embeddings),
        ("flash", flash_attention),
    )
    return (
        f"transformer-h{model.hidden}-a{model.heads}-kv{model.n_kv_heads}-f{model.ffn_hidden}"
        f"-s{model.seq_len}-v{model.vocab}" + "".join(f"-{name}" for name, on in flags if on)
    )


def layer_time_key(
    model: ModelSpec,
    kind: LayerKind,
    micro_batch: int,
    dtype: str,
    tp: int = 1,
    flash_attention: bool = False,
) -> str:
    """The key under which a profile stores the measured time of one layer of `model`."""
    return layer_key(model_signature(model, flash_attention), str(kind), micro_batch, tp, dtype)
