"""How DeepSpeed's PipelineModule cuts a model into pipeline stages (`partition_method`).

`PipelineModule._partition_layers` (deepspeed/runtime/pipe/module.py) weighs each layer spec
and splits the list into contiguous parts: "parameters" (its default) by each layer's
parameter count, "type:REGEX" by 1 for the layers whose class name matches and 0 for the
rest. Megatron-DeepSpeed's GPTModelPipe passes "type:transformer" unless
`--pp-partition-method` says otherwise (BigScience's fork, 00f5f889, 2022-02-28); its specs
are the embedding, the blocks, the final norm and the tied embedding again as the output
layer, so "type:transformer|embedding" makes each embedding a unit beside the blocks
(BigScience's tr11 chronicles, "Rebalancing layers": "2+nlayers" units per stage count).

`partition_balanced` changed in DeepSpeed 0.12.5 (#4312, 2bdf061): before it, the smallest
bottleneck found by bisection and the parts packed greedily from the first (`Balancer.BISECT`;
78 blocks over 12 stages give eleven stages 7 and the last 1, as the chronicles' "Re-do" says);
since, the split minimising the heaviest part minus the lightest by dynamic programming
(`Balancer.DP`; 7 blocks on six stages, 6 on six). Both are written here from DeepSpeed's
description and checked against its code and tests (`tests/test_pipe_partition.py`).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from enum import StrEnum
from functools import lru_cache

import numpy as np

BISECT_EPS = 1e-3
"""`partition_balanced`'s bisection tolerance before 0.12.5 (its `eps` default)."""


class PartitionMethod(StrEnum):
    UNIFORM = "uniform"
    """The blocks as evenly as possible, the first stages one more (`partition_uniform` since
    DeepSpeed 0.10.1), the embedding before them and the head after: zsim's default, and
    Megatron's own split where pp divides the layers."""
    PARAMETERS = "parameters"
    """Balanced by each layer's parameters (PipelineModule's default)."""
    TRANSFORMER = "type:transformer"
    """Balanced by blocks, the embedding and head weighing nothing (Megatron-DeepSpeed)."""
    TRANSFORMER_EMBEDDING = "type:transformer|embedding"
    """Balanced by blocks and both embeddings, one unit each (BLOOM's tr11 from 2022-02-27)."""


class Balancer(StrEnum):
    DP = "dp"
    """DeepSpeed >= 0.12.5: the least spread between the heaviest and lightest part."""
    BISECT = "bisect"
    """DeepSpeed before 0.12.5: the least bottleneck, parts packed greedily from the first."""


def balanced_bounds(weights: Sequence[float], parts: int, balancer: Balancer) -> tuple[int, ...]:
    """The `parts + 1` boundaries of a contiguous split of `weights` (DeepSpeed's `parts`)."""
    return _bounds(tuple(weights), parts, balancer)


@lru_cache(maxsize=1024)  # a planner splits the same model over the same stages many times
def _bounds(weights: tuple[float, ...], parts: int, balancer: Balancer) -> tuple[int, ...]:
    n = len(weights)
    if n <= parts:  # one item a part, then empty ones (both versions' `partition_uniform`)
        return tuple(min(p, n) for p in range(parts + 1))
    if balancer is Balancer.BISECT:
        return _bisect_bounds(weights, parts)
    return _dp_bounds(weights, parts)


def _probe(prefix: list[float], parts: int, bottleneck: float) -> tuple[list[int], bool]:
    """Pack greedily: each part ends before the item that takes it past the bottleneck
    (DeepSpeed's `_lprobe`; its windowed bisect finds the same index as a plain one)."""
    n = len(prefix)
    bounds = [0] + [n] * parts
    target = bottleneck
    for p in range(1, parts):
        bounds[p] = bisect_left(prefix, target)
        if bounds[p] == n:  # the rest fits: DeepSpeed weighs this part from its first item on
            return bounds, prefix[-1] - prefix[bounds[p - 1]] < bottleneck
        target = prefix[bounds[p] - 1] + bottleneck
    return bounds, target >= prefix[-1]


def _bisect_bounds(weights: tuple[float, ...], parts: int) -> tuple[int, ...]:
    prefix = list(np.cumsum(weights, dtype=float))
    lower, upper = prefix[-1] / parts, prefix[-1]
    while upper > lower + BISECT_EPS:
        mid = lower + (upper - lower) / 2
        if _probe(prefix, parts, mid)[1]:
            upper = mid
        else:
            lower = mid + BISECT_EPS
    return tuple(_probe(prefix, parts, upper)[0])


def _dp_bounds(weights: tuple[float, ...], parts: int) -> tuple[int, ...]:
    """The linear partition minimising (heaviest - lightest); among equal splits the last
    boundary as late as it can go, as DeepSpeed's `>=` in its loop over k chooses."""
    n = len(weights)
    prefix = np.zeros(n + 1)
    prefix[1:] = np.cumsum(weights)
    inf = np.inf
    most = np.full((n + 1, parts + 1), inf)
    least = np.full((n + 1, parts + 1), inf)
    cost = np.full((n + 1, parts + 1), inf)
    where = np.zeros((n + 1, parts + 1), dtype=int)
    most[0, 0] = cost[0, 0] = 0.0
    for i in range(1, n + 1):
        last = prefix[i] - prefix[:i]  # the part (k, i] for every k < i
        for j in range(1, min(i, parts) + 1):
            hi = np.maximum(most[:i, j - 1], last)
            lo = np.minimum(least[:i, j - 1], last)
            spread = hi - lo
            k = int(np.flatnonzero(spread == spread.min())[-1])
            most[i, j], least[i, j], cost[i, j], where[i, j] = hi[k], lo[k], spread[k], k
    bounds = [n]
    for j in range(parts, 0, -1):
        bounds.append(int(where[bounds[-1], j]))
    return tuple(reversed(bounds))
