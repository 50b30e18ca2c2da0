"""The closed form of NCCL's kernels holding SMs beside compute (`zsim.step.sm_hold`).

A pass of `compute` seconds alone runs `slow` times as long while a collective holds SMs:
beside a collective of `comm` seconds that starts with it, it does `comm / slow` of its work
in that time and the rest alone, so both are done at max(comm, compute + comm (1 - 1/slow)).
"""

from __future__ import annotations

from zsim.cluster.device import DeviceProfile
from zsim.cluster.topology import Topology
from zsim.network.nccl_ctas import comm_channels
from zsim.step.job import StageJob
from zsim.step.kernels import LayerKernels
from zsim.step.sm_hold import slowdown
from zsim.workload.model import LayerKind
from zsim.workload.shapes import Shard, backward_ops, forward_ops


def beyond(compute: float, comm: float, slow: float) -> float:
    """How much later than `compute` alone a pass and a collective beside it are both done."""
    return max(comm - compute, comm * (1.0 - 1.0 / slow), 0.0)


def block_sm_share(job: StageJob) -> float:
    """Of a block's forward and backward time, its GEMMs' and attention's (`Task.sm_share`)."""
    block = next((x for c in job.chunks for x in c if x.kind is LayerKind.BLOCK), None)
    if block is None:
        return 0.0
    kernels, forward = LayerKernels(job, None), forward_ops(job.model, block, Shard.of(job.cfg))
    ops = (*forward, *backward_ops(forward))
    return kernels.sm_share(ops)


def sm_slow(
    topology: Topology, device: DeviceProfile, job: StageJob, group: tuple[int, ...]
) -> float:
    """A pass's time beside one of `group`'s large collectives over its time alone: its SM
    share on the SMs the collective's channels leave."""
    if not device.sm_count or len(group) < 2:
        return 1.0
    return slowdown(device.sm_count, comm_channels(topology, group), block_sm_share(job))
