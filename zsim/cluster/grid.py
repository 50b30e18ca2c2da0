"""Ranks and process groups of a layout: one (dp, pp, tp) grid with TP innermost, so TP groups
stay inside a node. By default DeepSpeed's order, rank = (pp_i * dp + dp_i) * tp + tp_i
(`PipeModelDataParallelTopology(axes=['pipe', 'data', 'model'])`, also Megatron's default), or
picotron's, rank = (dp_i * pp + pp_i) * tp + tp_i (`arange(world).view(dp, pp, tp)`). The two
agree when pp = 1. Rank r runs on GPU r.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from enum import StrEnum

from zsim.cluster.topology import Topology
from zsim.errors import InputError, positive_int


class RankOrder(StrEnum):
    """How (dp, pp, tp) coordinates become a rank; axes listed outermost first."""

    PP_DP_TP = "pp-dp-tp"
    """DeepSpeed's PipeModelDataParallelTopology and Megatron's default: rank =
    (pp_i * dp + dp_i) * tp + tp_i."""
    DP_PP_TP = "dp-pp-tp"
    """picotron's grid arange(world).view(dp, pp, tp): rank = (dp_i * pp + pp_i) * tp + tp_i."""


class GroupKind(StrEnum):
    TP = "tp"
    DP = "dp"
    PP = "pp"
    WORLD = "world"


@dataclass(frozen=True)
class RankGrid:
    """The (dp, pp, tp) layout of one job."""

    dp: int = 1
    pp: int = 1
    tp: int = 1
    order: RankOrder = RankOrder.PP_DP_TP

    def __post_init__(self) -> None:
        for name in ("dp", "pp", "tp"):
            positive_int(name, getattr(self, name))

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    def rank(self, dp_i: int, pp_i: int, tp_i: int) -> int:
        if self.order is RankOrder.PP_DP_TP:
            return (pp_i * self.dp + dp_i) * self.tp + tp_i
        return (dp_i * self.pp + pp_i) * self.tp + tp_i

    def groups(self, kind: GroupKind) -> tuple[tuple[int, ...], ...]:
        """Every group of one kind as rank tuples (members in group-rank order), ordered by
        their first rank."""
        return _groups_of(self, kind)

    def _build_groups(self, kind: GroupKind) -> tuple[tuple[int, ...], ...]:
        if kind is GroupKind.WORLD:
            return (tuple(range(self.world_size)),)
        groups = (tuple(self._members(kind, a, b)) for a, b in self._others(kind))
        return tuple(sorted(groups))

    def _others(self, kind: GroupKind) -> Iterator[tuple[int, int]]:
        sizes = {GroupKind.TP: (self.dp, self.pp), GroupKind.DP: (self.pp, self.tp)}
        first, second = sizes.get(kind, (self.dp, self.tp))
        for a in range(first):
            for b in range(second):
                yield a, b

    def _members(self, kind: GroupKind, a: int, b: int) -> Iterator[int]:
        if kind is GroupKind.TP:
            return (self.rank(a, b, t) for t in range(self.tp))
        if kind is GroupKind.DP:
            return (self.rank(d, a, b) for d in range(self.dp))
        return (self.rank(a, p, b) for p in range(self.pp))


def process_groups(topo: Topology, grid: RankGrid, kind: GroupKind) -> tuple[tuple[int, ...], ...]:
    """The GPU ids of every `kind` group of `grid` placed on `topo` (rank r on GPU r)."""
    if grid.world_size > topo.world_size:
        raise InputError(
            "layout",
            f"dp={grid.dp} x pp={grid.pp} x tp={grid.tp} = {grid.world_size} GPUs",
            f"at most {topo.world_size} GPUs (the size of {topo.name})",
        )
    return grid.groups(kind)


@functools.lru_cache(maxsize=32)  # 100,000 GPUs: 12,500 TP groups, asked for by every stage
def _groups_of(grid: RankGrid, kind: GroupKind) -> tuple[tuple[int, ...], ...]:
    return grid._build_groups(kind)
