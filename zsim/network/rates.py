"""Max-min fair rates of the flows on a network, solved once per set of active flows.

A pattern is the flows of one phase (sources and destinations, interned by content, so every
call of a collective on one group shares it, whatever its size) with their routes. A flow set
is some of a pattern's flows, those that move data together: at first all of them (or those
of one route latency), later the part of a set whose rates came out equal. Rates depend only
on the active flows' routes and the capacities, so `FlowSets.rates` solves the flows of a
given multiset of flow sets once and answers from memory when it recurs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from zsim.cluster.build import (
    CLASSES,
    FloatArray,
    IntArray,
    Ints,
    digest,
    distinct,
    distinct_inverse,
)
from zsim.cluster.topology import Topology


def max_min_rates(
    pair_flow: Ints, pair_link: Ints, capacity: FloatArray, n_flows: int
) -> FloatArray:
    """Max-min fair rates of `n_flows` flows; flow f crosses link l for each pair (f, l).

    Progressive filling (Bertsekas & Gallager, Data Networks, 2nd ed., section 6.5.2): every
    flow not yet frozen gets the same increment until some link is full; flows through full
    links freeze. Each round freezes at least one link, so rounds <= distinct bottlenecks.
    Flows frozen in the same round get bitwise-equal rates.
    """
    links, local = distinct_inverse(np.asarray(pair_link))
    full = capacity[links].astype(np.float64)
    left = full.copy()
    rate = np.zeros(n_flows, dtype=np.float64)
    frozen = np.zeros(n_flows, dtype=bool)
    active = np.ones(pair_flow.shape[0], dtype=bool)
    while active.any():
        count = np.bincount(local[active], minlength=links.shape[0]).astype(np.float64)
        used = count > 0
        share = np.full(links.shape[0], np.inf)
        share[used] = left[used] / count[used]
        tightest = int(np.argmin(share))
        increment = share[tightest]
        rate[~frozen] += increment
        left -= increment * count
        saturated = used & (left <= 1e-9 * full)
        saturated[tightest] = True
        frozen[pair_flow[active & saturated[local]]] = True
        active &= ~frozen[pair_flow]
    return rate


@dataclass(frozen=True)
class Pattern:
    """A phase's flows: those that cross links (`moving_set`; -1 if none), those that do not
    (a GPU to itself), and the moving ones split by route latency (each group enters after its
    own delay; the local flows go with the zero-delay group)."""

    moving_set: int
    local_count: int
    by_latency: tuple[tuple[float, int, int], ...]  # (route latency, flow set, local flows)


@dataclass(frozen=True, eq=False)
class FlowSet:
    """Some of a pattern's moving flows and the (flow, edge) pairs of their routes."""

    pattern: int
    index: IntArray  # into the pattern's moving flows
    src: IntArray
    dst: IntArray
    pair_row: Ints  # a flow of this set, 0..count-1
    pair_edge: Ints
    pair_resource: Ints
    class_pairs: FloatArray  # (flow, edge) pairs per link class

    @property
    def count(self) -> int:
        return int(self.index.shape[0])


@dataclass(frozen=True, eq=False)
class _Routed:
    src: IntArray
    dst: IntArray
    latency_s: FloatArray
    pair_flow: Ints
    pair_edge: Ints


class FlowSets:
    """Patterns, flow sets and their solved rates, for one topology."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self._patterns: dict[bytes, Pattern] = {}
        self._by_array: dict[tuple[int, int], tuple[Pattern, IntArray, IntArray]] = {}
        self._routed: list[_Routed] = []
        self._sets: list[FlowSet] = []
        self._set_ids: dict[tuple[int, bytes], int] = {}
        self._rates: dict[tuple[int, ...], list[list[tuple[int, float]]]] = {}
        self._overlaps: dict[tuple[int, int], bool] = {}
        self._distinct: dict[int, IntArray] = {}
        # every edge its own capacity (no half-duplex pair): a set's edges are its capacities
        resource = topology.resource
        self._own_capacity = bool((resource == np.arange(len(resource))).all())

    def pattern(self, src: IntArray, dst: IntArray) -> Pattern:
        """The pattern of these flows: found by the arrays themselves first (a plan's phase
        is started many times), then by their contents."""
        by_id = self._by_array.get((id(src), id(dst)))
        if by_id is not None:
            return by_id[0]
        key = digest(src, dst)
        found = self._patterns.get(key)
        if found is None:
            found = self._patterns[key] = self._new_pattern(src, dst)
        self._by_array[(id(src), id(dst))] = (found, src, dst)  # holding the arrays keeps ids
        return found

    def flow_set(self, flow_set: int) -> FlowSet:
        return self._sets[flow_set]

    def overlap(self, a: int, b: int) -> bool:
        """Whether two flow sets draw on a common capacity (then their rates interact)."""
        key = (a, b) if a <= b else (b, a)
        found = self._overlaps.get(key)
        if found is None:
            found = self._overlaps[key] = a == b or self._share_capacity(a, b)
        return found

    def _share_capacity(self, a: int, b: int) -> bool:
        ra, rb = self._capacities(a), self._capacities(b)
        if len(ra) < len(rb):
            ra, rb = rb, ra
        if len(rb) <= 64:  # a few lookups in the larger set's sorted capacities
            at = np.minimum(np.searchsorted(ra, rb), len(ra) - 1)
            return bool((ra[at] == rb).any())
        marked = np.zeros(self.topology.edge_count, dtype=bool)
        marked[ra] = True
        return bool(marked[rb].any())

    def _capacities(self, flow_set: int) -> IntArray:
        """The distinct capacities a flow set draws on, sorted (found once per set)."""
        found = self._distinct.get(flow_set)
        if found is None:
            found = self._distinct[flow_set] = distinct(self._sets[flow_set].pair_resource)
        return found

    def rates(self, flow_sets: tuple[int, ...]) -> list[list[tuple[int, float]]]:
        """For each of these (active) flow sets, its parts of equal rate: (flow set, rate)."""
        found = self._rates.get(flow_sets)
        if found is None:
            found = self._rates[flow_sets] = self._solve(flow_sets)
        return found

    # ---- building ---------------------------------------------------------------------

    def _new_pattern(self, src: IntArray, dst: IntArray) -> Pattern:
        moving = src != dst
        local = int((~moving).sum())
        if not moving.any():
            return Pattern(-1, local, ((0.0, -1, local),))
        routes = self.topology.routes_of(src[moving], dst[moving])
        routed = _Routed(
            src[moving], dst[moving], routes.latency_s, routes.pair_flow, routes.pair_link
        )
        pattern = len(self._routed)
        self._routed.append(routed)
        all_flows = np.arange(routed.src.shape[0], dtype=np.int64)
        delays, group = np.unique(routes.latency_s, return_inverse=True)
        by_latency = [
            (float(delay), self._intern(pattern, np.flatnonzero(group == k)), 0)
            for k, delay in enumerate(delays.tolist())
        ]
        if local:
            zero = [i for i, (delay, _, _) in enumerate(by_latency) if delay == 0.0]
            if zero:
                delay, fs, _ = by_latency[zero[0]]
                by_latency[zero[0]] = (delay, fs, local)
            else:
                by_latency.insert(0, (0.0, -1, local))
        return Pattern(self._intern(pattern, all_flows), local, tuple(by_latency))

    def _intern(self, pattern: int, index: IntArray) -> int:
        index = index.astype(np.int32, copy=False)
        key = (pattern, digest(index))
        found = self._set_ids.get(key)
        if found is None:
            found = self._set_ids[key] = len(self._sets)
            self._sets.append(self._new_set(pattern, index))
        return found

    def _new_set(self, pattern: int, index: IntArray) -> FlowSet:
        routed = self._routed[pattern]
        src, dst = routed.src, routed.dst
        if index.shape[0] == routed.src.shape[0]:  # all of them, in order: share the arrays
            rows, edges = routed.pair_flow, routed.pair_edge
        else:
            src, dst = src[index], dst[index]
            position = np.full(routed.src.shape[0], -1, dtype=np.int32)
            position[index] = np.arange(index.shape[0], dtype=np.int32)
            row = position[routed.pair_flow]
            keep = row >= 0
            rows, edges = row[keep], routed.pair_edge[keep]
        class_pairs = np.bincount(self.topology.class_id[edges], minlength=len(CLASSES))
        resources = edges if self._own_capacity else self.topology.resource[edges]
        return FlowSet(
            pattern,
            index,
            src,
            dst,
            rows,
            edges,
            resources,
            class_pairs.astype(np.float64),
        )

    # ---- solving ----------------------------------------------------------------------

    def _solve(self, flow_sets: tuple[int, ...]) -> list[list[tuple[int, float]]]:
        sets = [self._sets[i] for i in flow_sets]
        offsets = np.cumsum([0] + [s.count for s in sets])
        pair_flow = np.concatenate([s.pair_row + o for s, o in zip(sets, offsets, strict=False)])
        pair_link = np.concatenate([s.pair_resource for s in sets])
        rate = max_min_rates(
            pair_flow, pair_link, self.topology.bandwidth_bytes_per_s, int(offsets[-1])
        )
        out: list[list[tuple[int, float]]] = []
        for i, s in zip(flow_sets, sets, strict=True):
            mine = rate[offsets[len(out)] : offsets[len(out) + 1]]
            values, parts = np.unique(mine, return_inverse=True)
            if len(values) == 1:
                out.append([(i, float(values[0]))])
                continue
            out.append(
                [
                    (self._intern(s.pattern, s.index[parts == k]), float(v))
                    for k, v in enumerate(values.tolist())
                ]
            )
        return out
