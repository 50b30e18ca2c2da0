"""The SMs a rank's running NCCL collectives hold, and what that leaves its compute kernels.

A collective's kernel holds one SM per channel it runs on from its launch to its end
(`network.nccl_ctas`). A compute kernel launched beside it on another stream runs its CTAs on
the SMs left: a GEMM or an attention kernel, which needs every SM it is given, takes
`sm / (sm - held)` times as long while the collective runs (the mechanism TransformerEngine's
SM margins make explicit, `workload.te_overlap`, and that an H100 profile shows for FSDP's
prefetched all-gather: 24 CTAs of NCCL's kernel pushing a 132-tile GEMM into a second wave,
NVIDIA developer forum 337991). Bandwidth-bound kernels are assumed to keep their rate (the
SMs left still draw most of the HBM's bandwidth; no measurement in reach says how much less),
and the HBM the collective's own copies take is not modelled.

Which collectives: those the step issues on its own streams beside the compute stream (DP's
reduce-scatters and all-reduces, ZeRO-3's and FSDP's gathers). Not: TP's (under TE's overlap
userbuffers, whose SMs are its margins; Megatron's async all-reduce beside the wgrad GEMM is
inside a fused pass's fixed timing), pipeline and context-parallel p2p (their own channel
counts, not modelled), and anything on the compute stream itself (nothing runs beside it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from zsim.cluster.topology import Topology
from zsim.network.collective import CollectiveOp
from zsim.network.nccl_ctas import call_ctas, comm_channels
from zsim.step.program import Comm, Group, Stream

BESIDE_COMPUTE = frozenset({Stream.REDUCE, Stream.GATHER, Stream.ALLREDUCE})
"""The streams the step issues its data-parallel collectives on, beside the compute stream."""
NOT_NCCL_GROUPS = frozenset({Group.TP, Group.CP, Group.PP})


@dataclass
class SmHold:
    """What NCCL's kernels hold on a GPU of `topology` with `sm_count` SMs."""

    topology: Topology
    sm_count: int
    _channels: dict[int, int] = field(default_factory=dict)  # id(group) -> channels

    @staticmethod
    def beside(comm: Comm, stream: Stream) -> bool:
        """Whether this call is an NCCL collective running beside the compute stream."""
        not_nccl = comm.group in NOT_NCCL_GROUPS or comm.op is CollectiveOp.SEND_RECV
        return stream in BESIDE_COMPUTE and not not_nccl

    def ctas(self, comm: Comm, members: tuple[int, ...]) -> int:
        """The SMs a collective of `members` beside the compute stream holds while it runs."""
        if len(members) < 2:
            return 0
        found = self._channels.get(id(members))  # groups are cached tuples: ids are theirs
        if found is None:
            found = self._channels[id(members)] = comm_channels(self.topology, members)
        return call_ctas(found, comm.nbytes)

    def rate(self, held: int, sm_share: float) -> float:
        """A compute task's progress per second (1: alone) while `held` SMs are taken: its
        SM-bound share runs on the SMs left."""
        return 1.0 / slowdown(self.sm_count, held, sm_share)


def slowdown(sm_count: int, held: int, sm_share: float) -> float:
    """A task's time while `held` of `sm_count` SMs are taken over its time alone: its
    SM-bound share on the SMs left."""
    if held <= 0 or sm_share <= 0:
        return 1.0
    return 1.0 + sm_share * (sm_count / max(sm_count - held, 1) - 1.0)
