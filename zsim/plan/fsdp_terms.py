"""PyTorch FSDP2's data-parallel terms in the planner's closed form: `zsim.step.fsdp`'s schedule
summed over its units (the same units, padding and dtypes).

Per micro-step the compute stream copies every gathered unit out and every unit's gradients
into the fp32 reduce-scatter input: exposed whole. The forward waits for its first gather (the
root's, or the first block's), the other gathers run behind it. The backward waits for its
first gather; its other gathers and the reduce-scatters run behind it (one network, shared),
a hybrid mesh's all-reduces beside them on other links, and the last unit's reduction is
waited for at its end (`finalize_backward`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from zsim.cluster.device import DeviceProfile
from zsim.network.collective import CollectiveOp
from zsim.plan.sm_terms import beyond
from zsim.step.fsdp import REDUCE_BYTES, SHARD_BYTES, Unit, padded, param_bytes
from zsim.step.fsdp import resharded_after_forward as resharded
from zsim.workload.parallel import ParallelConfig
from zsim.workload.sharding import FsdpSharding

Collective = Callable[[CollectiveOp, float, tuple[int, ...]], float]
Group = tuple[int, ...]
FsdpGroups = tuple[Group, Group, dict[int, tuple[Group, ...]]]
Keep = Callable[[tuple[object, ...], Group], Group]  # one tuple per group (`Estimator._kept`)


def fsdp_groups(
    group: Group,
    peers: tuple[Group, ...],
    h: int,
    kept: Keep,
) -> FsdpGroups:
    """The shard and replica groups of `group`'s first rank (the group itself unless hybrid),
    and, by id, what runs beside each: every data-parallel group's (`peers`: the other TP
    ranks') blocks of `h` and strides of `h`, at once."""
    every = (group, *peers)
    blocks = [tuple(g[i : i + h] for i in range(0, len(g), h)) for g in every]
    strides = [tuple(g[j::h] for j in range(h)) for g in every]
    shard, replicas = (
        group if h == len(group) else kept((k, h, id(group)), g[0][0])
        for k, g in (("b", blocks), ("s", strides))
    )
    beside = {
        id(shard): tuple(b for bs in blocks for b in bs if b != shard),
        id(replicas): tuple(r for rs in strides for r in rs if r != replicas),
        id(group): peers,
    }
    return shard, replicas, beside


def fsdp_terms(
    cfg: ParallelConfig,
    device: DeviceProfile,
    collective_s: Collective,
    groups: tuple[Group, Group],
    units: Sequence[Unit],
    passes: tuple[float, float],
    slow: float = 1.0,
) -> tuple[float, float]:
    """(exposed seconds, bytes one GPU sends) of a step's FSDP collectives and copies (`slow`:
    a pass beside them over alone, `sm_terms`):
    `groups` the shard group and the replica group (a hybrid mesh's; else the shard group
    alone), `units` the rank's (`zsim.step.fsdp.units`), `passes` a micro-step's forward and
    backward."""
    (shard, replicas), (forward, backward) = groups, passes
    n, b, dtype = len(shard), param_bytes(cfg), str(cfg.precision)
    hybrid = cfg.fsdp_sharding is FsdpSharding.HYBRID
    present = [u for u in units if u.numel]
    again = [u for u in reversed(present) if resharded(cfg, u)]  # gathered for the backward
    size = {u.index: padded(u.numel, n) for u in present}

    def gather(u: Unit) -> float:
        cast = device.copy_time_s(size[u.index] / n * (SHARD_BYTES + b) / 2, dtype)
        return cast + collective_s(CollectiveOp.ALL_GATHER, size[u.index] * b, shard)

    def reduce(u: Unit) -> tuple[float, float]:
        rs = collective_s(CollectiveOp.REDUCE_SCATTER, size[u.index] * REDUCE_BYTES, shard)
        ar = size[u.index] / n * REDUCE_BYTES
        return rs, collective_s(CollectiveOp.ALL_REDUCE, ar, replicas) if hybrid else 0.0

    ahead = [gather(u) for u in present]
    behind = [gather(u) for u in again]
    reductions = [reduce(u) for u in reversed(present)]
    scatters, reduces = sum(r for r, _ in reductions), sum(a for _, a in reductions)
    moved = sum(size.values()) * b + sum(size[u.index] for u in again) * b
    moved += sum(size.values()) * (b + REDUCE_BYTES) / 2  # the gradients' copy-in
    copies = device.copy_time_s(moved, dtype)
    first = ahead[0] + beyond(forward, sum(ahead[1:]), slow) if ahead else 0.0
    network = sum(behind[1:]) + scatters
    tail = sum(reductions[-1]) if reductions else 0.0
    late = max(network, reduces) if hybrid else network
    last = (behind[0] if behind else 0.0) + max(beyond(backward, late, slow), tail)
    exposed = cfg.grad_accum * (first + last + copies)
    ring = (n - 1) / n
    sent = (sum(size.values()) + sum(size[u.index] for u in again)) * b * ring
    sent += sum(size.values()) * REDUCE_BYTES * ring
    if hybrid:
        r = len(replicas)
        sent += 2 * (r - 1) / r * sum(size.values()) / n * REDUCE_BYTES
    return exposed, cfg.grad_accum * sent
