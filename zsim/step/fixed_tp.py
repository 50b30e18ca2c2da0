"""When tensor-parallel collectives take a fixed time: their groups' links carry nothing else.

Then a TP collective's closed form equals its flow simulation on an uncontended ring, and the
builder can time whole passes ahead (`kernels.fused_pass`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from zsim.cluster.build import distinct
from zsim.cluster.grid import GroupKind, RankGrid
from zsim.network.collective import CollectiveCall, CollectiveOp
from zsim.network.communicator import Communicator
from zsim.network.patterns import member_pair_links
from zsim.step.program import Comm


def tp_fixed_time(grid: RankGrid, comms: Communicator) -> Callable[[Comm], float] | None:
    """Closed-form times for tensor-parallel collectives, when TP groups use links that no
    other TP group, no data-parallel collective and no pipeline send uses; None when they
    contend."""
    if grid.tp == 1:
        return None
    op = CollectiveOp.ALL_REDUCE
    tp_groups = grid.groups(GroupKind.TP)
    seen = _tp_links(tp_groups, comms)
    if seen is None:
        return None
    dp_groups = [grp for grp in grid.groups(GroupKind.DP) if len(grp) > 1]
    if not _apart(seen, dp_groups, comms) and any(
        not seen.isdisjoint(comms.links_of(CollectiveCall(op, 1.0, g))) for g in dp_groups
    ):
        return None
    if not seen.isdisjoint(_pipeline_links(grid, comms)):
        return None

    def seconds(comm: Comm) -> float:
        return comms.plan(CollectiveCall(comm.op, comm.nbytes, tp_groups[0])).closed_form_s

    return seconds


def _tp_links(groups: tuple[tuple[int, ...], ...], comms: Communicator) -> set[int] | None:
    """The links the TP groups' flows can cross, None when a link is reachable from two
    groups. Every ordered pair of members is taken (one batch of routes, no planning): a
    superset of any algorithm's flows, so disjoint here means disjoint rings."""
    links, owner = member_pair_links(comms.topology, groups)
    owned = distinct(links * len(groups) + owner) // len(groups)  # each (link, group) once
    used = distinct(owned)
    if len(used) < len(owned):
        return None  # some link serves two TP groups: they contend
    return set(used.tolist())


def _apart(seen: set[int], groups: list[tuple[int, ...]], comms: Communicator) -> bool:
    """Whether no route between two members of any of `groups` crosses a link in `seen`: then
    no algorithm's flows do, and the groups need not be planned (False: they may)."""
    return all(seen.isdisjoint(comms.reach(group)) for group in groups)


def _pipeline_links(grid: RankGrid, comms: Communicator) -> set[int]:
    """The links of every pipeline send (each stage to the next and back, the last to the
    first for interleaved schedules) and of the embedding all-reduce between the first and
    last stages (its flows join the same two GPUs): one batch of routes."""
    if grid.pp == 1:
        return set()
    stages = np.array(grid.groups(GroupKind.PP), dtype=np.int64)  # one row per (dp, tp)
    ahead = np.roll(stages, -1, axis=1)
    src = np.concatenate([stages.ravel(), ahead.ravel()])
    dst = np.concatenate([ahead.ravel(), stages.ravel()])
    routes = comms.topology.routes_of(src, dst)
    return set(distinct(comms.topology.resource[routes.pair_link]).tolist())
