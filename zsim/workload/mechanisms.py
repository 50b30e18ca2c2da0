"""The mechanisms zsim models beyond the textbook step, by name, so that each can be switched
off (`zsim run --without NAME`, the accuracy benchmark's ablation): what one is worth is the
step time with and without it. Each is taken from a framework's source, cited where it acts.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from enum import StrEnum

from zsim.errors import require


class Mechanism(StrEnum):
    NCCL_PROTOCOLS = "nccl-protocols"
    NVLINK_NCCL_RATE = "nvlink-nccl-rate"
    ONE_PROCESS_GROUP = "one-process-group"
    EPILOGUE_WAIT = "epilogue-wait"
    BLOCKING_P2P = "blocking-p2p"
    PIPE_PARTITIONED = "pipe-partitioned"
    FP32_GRAD_ACCUMULATE = "fp32-grad-accumulate"
    GRAD_ACCUMULATE = "grad-accumulate"
    GATHER_COPY_OUT = "gather-copy-out"
    ENGINE_HOST = "engine-host"
    TE_SM_MARGINS = "te-sm-margins"
    EAGER_OPS = "eager-ops"
    FP8_AMAX = "fp8-amax"
    SEND_QUEUE = "send-queue"
    NCCL_SMS = "nccl-sms"
    ZERO3_HOST = "zero3-host"


MECHANISMS: dict[Mechanism, str] = {
    Mechanism.NCCL_PROTOCOLS: "NCCL's LL / LL128 / Simple latencies and wire bytes by its tuner "
    "(off: the routes' latencies and bandwidths only)",
    Mechanism.NVLINK_NCCL_RATE: "NVLink at NCCL's per-link rate, src/graph/topo.h (off: the line "
    "rate)",
    Mechanism.ONE_PROCESS_GROUP: "ZeRO-3's gathers and reduce-scatters on one NCCL stream when "
    "DeepSpeed has an mpu (off: two communicators)",
    Mechanism.EPILOGUE_WAIT: "DeepSpeed's backward epilogue waits for its reductions with "
    "overlap_comm (off: the next micro-step runs on)",
    Mechanism.BLOCKING_P2P: "pipeline sends block the training loop: DeepSpeed's "
    "PipelineEngine, Megatron's non-interleaved schedules (off: they run beside compute)",
    Mechanism.PIPE_PARTITIONED: "DeepSpeed PipelineEngine's messages with TP: 1/tp of an "
    "activation or gradient sent, all-gathered over TP and copied on receipt "
    "(PartitionedTensor; off: whole tensors sent by every TP rank)",
    Mechanism.FP32_GRAD_ACCUMULATE: "BF16_Optimizer's per-micro-batch fp32 gradient "
    "accumulation pass with DeepSpeed's pipeline (off: none)",
    Mechanism.GRAD_ACCUMULATE: "autograd's in-place add of later micro-batches' gradients "
    "into .grad with ZeRO-0/1 (off: free)",
    Mechanism.GATHER_COPY_OUT: "ZeRO-3's copy of a coalesced gather into its parameters "
    "(torch.cat on the gather stream; off: views)",
    Mechanism.ENGINE_HOST: "DeepSpeed's own host time per engine call on CPU ranks, measured "
    "by zsim calibrate (off: none)",
    Mechanism.TE_SM_MARGINS: "TransformerEngine's --tp-comm-overlap GEMMs on the SMs its "
    "communication kernels leave them (num_sm, margin set or not; off: every SM)",
    Mechanism.EAGER_OPS: "a block's norms, RoPE and activation one kernel per PyTorch op where "
    "the job runs them eagerly, zsim.workload.eager (off: fused kernels)",
    Mechanism.FP8_AMAX: "TransformerEngine's delayed-scaling amax reductions: a blocking "
    "all-reduce over the stage's TP x DP x CP ranks after each chunk's forward and backward, "
    "zsim.workload.fp8 (off: none)",
    Mechanism.SEND_QUEUE: "a pipeline send waits for what was queued before it on the compute "
    "stream: Megatron-Core's grad scaling in the last micro-batch's backward (off: for the "
    "pass's own kernels only)",
    Mechanism.NCCL_SMS: "NCCL's data-parallel collectives hold an SM per channel while they "
    "run; GEMMs and attention beside them run on the SMs left, zsim.step.sm_hold (off: every "
    "SM)",
    Mechanism.ZERO3_HOST: "DeepSpeed ZeRO-3's host walks every data-parallel rank per coalesced "
    "gather and reduce-scatter, and the coordinator throttles on its fetches, zsim.step."
    "zero3_host (off: the host is always ahead)",
}


def parse_mechanisms(
    names: Iterable[str] | str | None, field: str = "without"
) -> frozenset[Mechanism]:
    """Mechanism names (a comma list or an iterable) as a set; an unknown name is an error."""
    if names is None:
        return frozenset()
    items = names.split(",") if isinstance(names, str) else list(names)
    out: set[Mechanism] = set()
    for name in (str(n).strip() for n in items):
        if not name:
            continue
        require(name in MECHANISMS, field, name, "one of " + ", ".join(MECHANISMS))
        out.add(Mechanism(name))
    return frozenset(out)


_open_records: list[set[Mechanism]] = []  # one per open `consulted` block, innermost last


def modelled(mechanism: Mechanism, without: frozenset[Mechanism]) -> bool:
    """Whether `mechanism` is modelled when `without` are switched off; every open
    `consulted` block records that it was asked."""
    for record in _open_records:
        record.add(mechanism)
    return mechanism not in without


@contextmanager
def consulted() -> Iterator[set[Mechanism]]:
    """The mechanisms a computation asks about inside the block. One it never asks about
    cannot change its result, so an ablation need not compute it again without that one.
    A cache keyed by a configuration answers without asking: whoever caches must union the
    records of equal configurations (the accuracy benchmark's `--ablate` does)."""
    record: set[Mechanism] = set()
    _open_records.append(record)
    try:
        yield record
    finally:
        _open_records.remove(record)
