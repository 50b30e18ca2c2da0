"""ZeRO++'s quantized gradient averaging, qgZ (Wang et al. 2023, section 4.3), as DeepSpeed
0.19.8 runs it: with `zero_quantized_gradients` and a world of more than one node, stage3.py
`__avg_scatter_grads` hands a bucket's gradients to `coalesced_collectives.
all_to_all_quant_reduce` instead of one coalesced reduce-scatter. That averages them one
tensor at a time:

- a matrix whose size divides by 2 x world: `swizzle_quant` to int4 values and fp32 scales,
  an all-to-all of each among the node's GPUs (`local_<node>`), `quantized_reduction`
  (dequantize the node's pieces, sum, quantize the 1/L share again), an all-to-all of each
  among the same GPU of every node (`global_<gpu>`), `dequantize`, then the nodes' pieces
  summed into this rank's 1/world partition;
- any other tensor (a bias, a norm's weight): `reduce_scatter_coalesced([tensor])` alone,
  over the whole world, in the gradients' dtype.

Every call is synchronous on the reduction stream (`all_to_all_single` without async_op), so a
tensor's kernels and calls run one after another there. The kernels are memory-bound: each is
charged its bytes read and written at the device's copy rate.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from zsim.network.collective import CollectiveOp
from zsim.step.job import StageJob
from zsim.step.program import Category, Comm, Group, ProgramWriter, Stream, Task
from zsim.workload.model import ParamTensor

INT4_BYTES = 0.5  # qgZ's values: 4 bits (`num_bits=4` in all_to_all_quant_reduce)
SCALE_BYTES = 4  # one fp32 scale per quantization group


class QgzOp(NamedTuple):
    """One step of a tensor's average: a memory-bound kernel (`copied`: its bytes read and
    written over 2, as a copy of that many bytes moves them) or a collective."""

    name: str
    copied: float = 0.0
    comm: Comm | None = None


def quantizes(tensor: ParamTensor, world: int) -> bool:
    """Whether all_to_all_quant_reduce takes the quantized path for this tensor."""
    return len(tensor.shape) >= 2 and tensor.numel % (2 * world) == 0


def tensor_ops(tensor: ParamTensor, element_bytes: int, local: int, world: int) -> list[QgzOp]:
    """What averaging one tensor runs, in order (`local`: the GPUs of a node)."""
    n, b = tensor.numel, element_bytes
    if not quantizes(tensor, world):
        padded = -(-n // world) * world
        return [QgzOp("grad_reduce", comm=Comm(CollectiveOp.REDUCE_SCATTER, padded * b, Group.DP))]
    groups = max(*tensor.shape[:2], world)  # intra_quant_group: the node's scales
    share = n / local  # what the node's reduction keeps: its 1/L of the tensor

    def kernel(name: str, read: float, written: float) -> QgzOp:
        return QgzOp(f"qgz.{name}", copied=(read + written) / 2)

    def all_to_all(name: str, nbytes: float, group: Group) -> QgzOp:
        return QgzOp(f"qgz.{name}", comm=Comm(CollectiveOp.ALL_TO_ALL, nbytes, group))

    return [
        kernel("quantize", b * n, INT4_BYTES * n + SCALE_BYTES * groups),
        all_to_all("node", INT4_BYTES * n, Group.NODE),
        all_to_all("node_scales", SCALE_BYTES * groups, Group.NODE),
        kernel("reduce", INT4_BYTES * n, INT4_BYTES * share),
        all_to_all("across", INT4_BYTES * share, Group.ACROSS),
        all_to_all("across_scales", SCALE_BYTES * (groups // local), Group.ACROSS),
        # dequantize the nodes' pieces (1/L of the tensor), then sum them into 1/world
        kernel("dequantize", INT4_BYTES * share + b * share, b * share + b * n / world),
    ]


def quantized_average(
    job: StageJob,
    writer: ProgramWriter,
    tensors: Sequence[ParamTensor],
    ready: list[Task],
    streams: tuple[Stream, Stream],
) -> Task:
    """A bucket's gradients averaged as qgZ does, in the bucket's order; `streams`: the
    kernels' and all-to-alls' (the reduction stream: each call is synchronous there) and the
    lone reduce-scatters' (the data-parallel group's NCCL stream). Returns the last task."""
    last, world = ready, job.cfg.world_size
    for tensor in tensors:
        for op in tensor_ops(tensor, job.element_bytes, job.node_gpus, world):
            if op.comm is None:
                seconds = job.device.copy_time_s(op.copied, job.dtype)
                task = writer.compute(op.name, seconds, Category.GRAD_REDUCE, last, streams[0])
            else:
                stream = streams[1] if op.comm.group is Group.DP else streams[0]
                task = writer.comm(op.name, op.comm, Category.GRAD_REDUCE, last, stream)
            last = [task]
    return last[0]
