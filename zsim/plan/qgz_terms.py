"""ZeRO++'s qgZ in the planner's closed form: a micro-step's gradient averaging, tensor by
tensor as `zsim.step.qgz` runs it, every kernel and call one after another on the reduction
stream, in place of ZeRO-3's bucketed reduce-scatters."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from zsim.cluster.device import DeviceProfile
from zsim.network.collective import CollectiveOp
from zsim.plan.fsdp_terms import Keep, fsdp_groups
from zsim.step.job import StageJob
from zsim.step.program import Group
from zsim.step.qgz import tensor_ops
from zsim.step.zero_reduce import bucket_passes
from zsim.workload.model import ParamTensor

Averaged = tuple[float, float, float]  # seconds, bytes sent, seconds of the calls across nodes
Peered = Callable[[CollectiveOp, float, tuple[int, ...], tuple[tuple[int, ...], ...]], float]


def qgz_terms(
    job: StageJob,
    device: DeviceProfile,
    collective_s: Peered,
    peers: tuple[tuple[int, ...], ...],
    group: tuple[int, ...],
    kept: Keep,
) -> Averaged:
    """(seconds, bytes one GPU sends, seconds of the calls across the nodes) of one
    micro-step's averaging of the rank's gradients, the buckets' copies included (they run on
    the same stream). `group`: the data-parallel group, `peers` the calls beside it; the
    node's and the stride's all-to-alls run beside every node's and every stride's."""
    local, across, beside = fsdp_groups(group, peers, job.node_gpus, kept)
    groups = {Group.DP: group, Group.NODE: local, Group.ACROSS: across}
    b, world, dtype = job.element_bytes, job.cfg.world_size, job.dtype
    tensors = job.tensors()
    before, after = bucket_passes(job, tensors)
    seconds, sent, crossing = device.copy_time_s(before + after, dtype), 0.0, 0.0
    kinds = Counter((t.numel, t.shape) for t in tensors)  # a model repeats a few shapes
    for (numel, shape), count in kinds.items():
        tensor = ParamTensor("", numel, True, shape)
        for op in tensor_ops(tensor, b, job.node_gpus, world):
            if op.comm is None:
                seconds += count * device.copy_time_s(op.copied, dtype)
                continue
            members = groups[op.comm.group]
            call_s = count * collective_s(op.comm.op, op.comm.nbytes, members, beside[id(members)])
            seconds += call_s
            crossing += call_s if op.comm.group is not Group.NODE else 0.0
            sent += count * (len(members) - 1) / len(members) * op.comm.nbytes
    return seconds, sent, crossing
