"""Synthetic calibration rows from closed forms written here, with known parameters: what the
calibration tests fit and expect to recover."""

import numpy as np

from zsim.calibrate.fit import fit_profile
from zsim.calibrate.measurement import Kind, Measurement
from zsim.calibrate.profile import (
    Calibration,
)
from zsim.cluster.device import layer_time_key
from zsim.workload.model import LayerKind
from zsim.workload.model_presets import preset

MIB = 2**20


INFO = {"memory_bytes": 8e9, "reserved_bytes": 1e8, "backend": "gloo", "cache_bytes": 32 * MIB}


# the "true" device the synthetic measurements come from
GEMM_RATE, GEMM_OVERHEAD = 80e9, 6e-6  # FLOP/s, s


MEM_RATE, MEM_OVERHEAD = 9e9, 3e-6  # B/s, s


ATTN_RATE = 30e9


COPY_RATE = 7e9


ADAM_PARAMS_PER_S = 90e6


def synthetic_rows(noise=0.0, seed=0, repeats=9):
    """Measurements from closed forms written here (t = overhead + work / rate), with
    multiplicative noise per repeat."""
    rng = np.random.default_rng(seed)

    def samples(t):
        return tuple(float(t * (1 + noise * rng.standard_normal())) for _ in range(repeats))

    rows = []
    for s in (16, 32, 64, 128, 256, 512, 1024):
        flops = 2.0 * s**3
        rows.append(
            Measurement(
                Kind.GEMM,
                "mm",
                "fp32",
                samples(GEMM_OVERHEAD + flops / GEMM_RATE),
                flops=flops,
                shape=(s, s, s, 1),
            )
        )
    for size in (1024, 4096, 256 * MIB, 768 * MIB):
        rows.append(
            Measurement(
                Kind.MEMORY, "add", "fp32", samples(MEM_OVERHEAD + size / MEM_RATE), size_bytes=size
            )
        )
    for f in (1e8, 4e8, 1.6e9):
        rows.append(
            Measurement(
                Kind.ATTENTION,
                "sdpa",
                "fp32",
                samples(GEMM_OVERHEAD + f / ATTN_RATE),
                flops=f,
                micro_batch=1,
            )
        )
    for size in (64 * MIB, 256 * MIB):
        rows.append(
            Measurement(
                Kind.HOST_COPY, "memcpy", "fp32", samples(size / COPY_RATE), size_bytes=size
            )
        )
    for p in (2**22, 2**24):
        rows.append(
            Measurement(Kind.OPTIMIZER, "adamw", "fp32", samples(p / ADAM_PARAMS_PER_S), params=p)
        )
    key = layer_time_key(preset("toy-mlp"), LayerKind.LINEAR, 4, "fp32")
    rows.append(Measurement(Kind.LAYER_FORWARD, "linear", "fp32", samples(1e-3), layer_key=key))
    rows.append(Measurement(Kind.LAYER_BACKWARD, "linear", "fp32", samples(2e-3), layer_key=key))
    rows.append(
        Measurement(Kind.LAYER_ACCUMULATE, "linear", "fp32", samples(2.5e-3), layer_key=key)
    )
    return tuple(rows)


def one_gpu_rows():
    """What the CUDA worker writes for one H200-like GPU (bf16, no collectives: one rank),
    from closed forms written here: GEMMs, HBM-streaming adds beyond 4x a 60 MB L2, pinned
    host<->device copies both ways, fused AdamW on the GPU and torch AdamW on the host."""
    gemm_rate, gemm_overhead, hbm_rate, pcie_rate = 700e12, 8e-6, 4.0e12, 50e9
    rows = [
        Measurement(
            Kind.GEMM,
            "mm",
            "bf16",
            (gemm_overhead + 2.0 * s**3 / gemm_rate,) * 5,
            flops=2.0 * s**3,
            shape=(s, s, s, 1),
        )
        for s in (256, 1024, 4096, 8192)
    ]
    rows += [
        Measurement(Kind.MEMORY, "add", "bf16", (3e-6 + moved / hbm_rate,) * 5, size_bytes=moved)
        for moved in (192, 768, 3 * 256 * MIB, 3 * 1024 * MIB)
    ]
    rows += [
        Measurement(Kind.HOST_COPY, op, "fp32", (size / pcie_rate,) * 5, size_bytes=size)
        for op in ("h2d", "d2h")
        for size in (64 * MIB, 256 * MIB)
    ]
    rows += [
        Measurement(Kind.OPTIMIZER, op, "fp32", (p / rate,) * 5, params=p)
        for op, rate in (("adamw", 20e9), ("host_adamw", 400e6))
        for p in (2**24, 2**25)
    ]
    info = {
        "memory_bytes": 141e9,
        "reserved_bytes": 0.5e9,
        "backend": "nccl",
        "cache_bytes": 60e6,
        "sm_count": 132,  # the worker's torch.cuda.get_device_properties().multi_processor_count
        "topology": "1x1-nvlink",
    }
    truth = {"gemm": (gemm_rate, gemm_overhead), "hbm": hbm_rate, "pcie": pcie_rate}
    return tuple(rows), info, truth


def calibration(rows=None):
    rows = rows or synthetic_rows(noise=0.05, seed=1)
    fit = fit_profile("synthetic", rows, INFO)
    return Calibration("synthetic", fit.profile, rows, fit.residuals, provenance=INFO)


CALL_S, LINK_LATENCY_S, LINK_BPS = 120e-6, 15e-6, 1.5e9


P2P_CALL_S = 80e-6  # send/recv, posted on the caller's thread


MESSAGE_S = 25e-6  # CPU per message a rank handles


# each op's own CPU per byte a rank sends plus receives; broadcast's none (the wire's reference)
OWN_S_PER_BYTE = {"all_gather": 0.3e-9, "all_reduce": 0.05e-9, "reduce_scatter": 0.08e-9}


OWN_S_PER_BYTE |= {"send_recv": 0.02e-9, "broadcast": 0.0}


# the own cost per call of the ops torch wraps around gloo's (allocations, clones, copies)
OWN_CALL_S = {"all_gather": 60e-6, "reduce_scatter": 40e-6}


SUM_BPS = MEM_RATE / 3  # output bytes of a + b: the elementwise rate moves three operands


# all_gather's flat output is allocated on gloo's worker thread: beyond a thread arena's 64 MiB
# heap (glibc HEAP_MAX_SIZE) it is mapped afresh and faulted in on every call
TOUCH_BPS, FRESH_ABOVE = 2.5e9, 63 * 2**20


def gloo_two_ranks_s(op, size):
    """gloo's algorithms for n = 2 ranks (docs/collectives.md section 1.6), on the
    CPU topology where a message crosses two loopback links (rank -> host -> rank): alpha = 2 x
    link latency; a rank's link is half duplex, so B is shared by what it sends and receives;
    two segments in flight, so a ring step costs one alpha; each rank's CPU pays MESSAGE_S per
    message it sends or receives (per call), its copies run at the memcpy rate, its sums at a
    third of the elementwise rate, and the op's own OWN_S_PER_BYTE on what it sends plus
    receives (all_gather S, all_reduce 2 S, send/recv S per call, broadcast S) and the wrapped
    ops their OWN_CALL_S; send/recv has its own call latency. all_gather's flat output above
    FRESH_ABOVE is faulted in at TOUCH_BPS; every other temporary comes from memory already
    touched."""
    alpha = 2 * LINK_LATENCY_S
    segments = -(-max(-(-size // MIB), 4) // 2) * 2  # roundUp(max(S / 1 MiB, 2n), n)
    # reduce-scatter and all-gather loops: each rank sends and receives its k segments, but an
    # 8-byte buffer fills only segments 0 and 1 of 4: one rank sends both, the other receives
    messages = 4 if size < 16 else 2 * segments
    all_reduce = CALL_S + 2 * alpha + 2 * (size / 2) / (LINK_BPS / 2)
    all_reduce += messages * MESSAGE_S + (size / 2) / SUM_BPS
    if op == "all_reduce":
        return all_reduce + 2 * size * OWN_S_PER_BYTE["all_reduce"]
    if op == "reduce_scatter_tensor":  # clone, all_reduce, copy the own half
        own = 2 * size * OWN_S_PER_BYTE["reduce_scatter"] + OWN_CALL_S["reduce_scatter"]
        return size / COPY_RATE + all_reduce + (size / 2) / COPY_RATE + own
    if op == "all_gather_into_tensor":  # flat output, prime own half, ring, copy out
        local = (size / 2) / COPY_RATE + 4 * MESSAGE_S + size / COPY_RATE
        local += size * OWN_S_PER_BYTE["all_gather"] + OWN_CALL_S["all_gather"]
        local += size / TOUCH_BPS if size > FRESH_ABOVE else 0.0
        return CALL_S + alpha + (size / 2) / (LINK_BPS / 2) + local
    if op == "broadcast":  # one message, alone on both ranks' links
        return CALL_S + alpha + size / LINK_BPS + MESSAGE_S + size * OWN_S_PER_BYTE["broadcast"]
    # send/recv: each rank sends to the other at once, so each link carries both directions
    own = size * OWN_S_PER_BYTE["send_recv"]
    return P2P_CALL_S + alpha + size / (LINK_BPS / 2) + MESSAGE_S + own


def collective_rows(noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for op in (
        "all_gather_into_tensor",
        "reduce_scatter_tensor",
        "all_reduce",
        "broadcast",
        "sendrecv",
    ):
        for size in (8, 1024, 65536, 2**20, 16 * 2**20, 256 * 2**20):
            t = gloo_two_ranks_s(op, size)
            samples = tuple(float(t * (1 + noise * rng.standard_normal())) for _ in range(9))
            rows.append(
                Measurement(
                    Kind.COLLECTIVE,
                    op,
                    "fp32",
                    samples,
                    size_bytes=size,
                    group="intra",
                    ranks=2,
                    link_class="loopback",
                )
            )
    return tuple(rows)


def row_of(*samples: float, op: str = "add") -> Measurement:
    return Measurement(Kind.MEMORY, op, "fp32", samples, size_bytes=1024)
