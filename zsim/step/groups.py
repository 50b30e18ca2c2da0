"""The groups a simulated rank's collectives and sends run in, and the replicas it stands for.

Ranks that are symmetric (every data- and tensor-parallel peer of a pipeline stage) run the
same program, so by default only one rank per pipeline stage is simulated; a collective of
one then stands for the same collective in the groups of the ranks not simulated (its
replicas), of which those whose routes share a link with it load the network too.
"""

from __future__ import annotations

import itertools

from zsim.cluster.grid import GroupKind, RankGrid
from zsim.network.collective import CollectiveOp
from zsim.network.communicator import Communicator
from zsim.step.program import Comm, Group

# groups of `block` (Group.CP: `cp`) consecutive data-parallel ranks, and those of the ranks
# `block` apart
_BLOCKS = (Group.HPZ, Group.SHARD, Group.NODE, Group.CP)
_STRIDES = (Group.REPLICA, Group.ACROSS)


class RankGroups:
    def __init__(
        self, grid: RankGrid, comms: Communicator, full: bool, block: int, cp: int = 1
    ) -> None:
        self.grid = grid
        self.comms = comms
        self.full = full
        # consecutive data-parallel ranks: ZeRO++'s secondary partition or qgZ's node, FSDP's
        # hybrid shard
        self.block = max(1, block)
        self.cp = cp  # ... and context parallelism's groups (zsim.workload.context_parallel)
        self.ranks = self._simulated_ranks()
        self.simulated = set(self.ranks)
        self.coord = {
            grid.rank(d, p, t): (d, p, t)
            for d, p, t in itertools.product(range(grid.dp), range(grid.pp), range(grid.tp))
        }
        self._replicas: dict[tuple[int, Group], list[tuple[int, ...]]] = {}
        self._groups: dict[tuple[int, Group], tuple[int, ...]] = {}
        self._interned: dict[tuple[int, ...], tuple[int, ...]] = {}
        self._contending: dict[tuple[int, CollectiveOp], list[tuple[int, ...]]] = {}
        self._peers: dict[tuple[int, int], int] = {}

    def _simulated_ranks(self) -> tuple[int, ...]:
        g = self.grid
        if self.full:
            return tuple(range(g.world_size))
        return tuple(g.rank(0, s, 0) for s in range(g.pp))

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(dp_i, pp_i, tp_i) of a rank."""
        return self.coord[rank]

    def group_of(self, rank: int, group: Group) -> tuple[int, ...]:
        key = (rank, group)
        if key not in self._groups:  # one tuple per group, shared by its members' lookups
            members = self._members(rank, group)
            self._groups[key] = self._interned.setdefault(members, members)
        return self._groups[key]

    def _members(self, rank: int, group: Group) -> tuple[int, ...]:
        dp_i, pp_i, tp_i = self.coords(rank)
        g = self.grid
        if group is Group.TP:
            return tuple(g.rank(dp_i, pp_i, t) for t in range(g.tp))
        if group is Group.DP:
            return tuple(g.rank(d, pp_i, tp_i) for d in range(g.dp))
        if group is Group.EMBEDDING:
            return (g.rank(dp_i, 0, tp_i), g.rank(dp_i, g.pp - 1, tp_i))
        if group in _BLOCKS:
            size = self._block_of(group)
            first = dp_i - dp_i % size
            return tuple(g.rank(d, pp_i, tp_i) for d in range(first, first + size))
        if group in _STRIDES:
            return tuple(g.rank(d, pp_i, tp_i) for d in range(dp_i % self.block, g.dp, self.block))
        if group is Group.STAGE:
            pairs = itertools.product(range(g.dp), range(g.tp))
            return tuple(sorted(g.rank(d, pp_i, t) for d, t in pairs))
        return tuple(g.rank(dp_i, p, tp_i) for p in range(g.pp))

    def _block_of(self, group: Group) -> int:
        return self.cp if group is Group.CP else self.block

    def copies(self, rank: int, group: Group) -> int:
        """How many groups one call of `rank`'s stands for: its own and, in symmetric mode, the
        same call in the groups of the ranks not simulated."""
        return 1 + len(self.replicas(rank, group))

    def replicas(self, rank: int, group: Group) -> list[tuple[int, ...]]:
        """The same collective in the groups of the ranks not simulated (symmetric mode)."""
        if self.full:
            return []
        if (rank, group) not in self._replicas:
            self._replicas[(rank, group)] = self._find_replicas(rank, group)
        return self._replicas[(rank, group)]

    def contending_replicas(self, members: tuple[int, ...], comm: Comm) -> list[tuple[int, ...]]:
        """Replica groups whose flows would share a link with this collective's."""
        key = (id(members), comm.op)  # groups are cached tuples: no hashing of all members
        if key not in self._contending:
            self._contending[key] = [
                grp
                for grp in self.replicas(members[0], comm.group)
                if self.comms.shares_links(comm.op, members, grp)
            ]
        return self._contending[key]

    def _find_replicas(self, rank: int, group: Group) -> list[tuple[int, ...]]:
        if group is Group.STAGE:  # one group holds every rank of the stage
            return []
        _, pp_i, _ = self.coords(rank)
        kind = {Group.TP: GroupKind.TP, Group.DP: GroupKind.DP}.get(group)
        mine = self.group_of(rank, group)
        if group in _BLOCKS or group in _STRIDES:
            g = self.grid
            size = self._block_of(group)
            firsts = range(size) if group in _STRIDES else range(0, g.dp, size)
            pairs = itertools.product(firsts, range(g.tp))
            blocks = [self.group_of(g.rank(d, pp_i, t), group) for d, t in pairs]
            return [grp for grp in blocks if grp != mine]
        if kind is None:  # embedding groups: one per (dp, tp) pair
            pairs = itertools.product(range(self.grid.dp), range(self.grid.tp))
            others: list[tuple[int, ...]] = [
                (self.grid.rank(d, 0, t), self.grid.rank(d, self.grid.pp - 1, t)) for d, t in pairs
            ]
        else:
            others = [grp for grp in self.grid.groups(kind) if self.coords(grp[0])[1] == pp_i]
        return [grp for grp in others if grp != mine]

    def peer(self, rank: int, offset: int) -> int:
        found = self._peers.get((rank, offset))
        if found is None:  # asked for every send and receive: kept
            dp_i, pp_i, tp_i = self.coords(rank)
            found = self.grid.rank(dp_i, (pp_i + offset) % self.grid.pp, tp_i)
            self._peers[(rank, offset)] = found
        return found
