"""NCCL-style hierarchical collectives (not NCCL's default; there for comparison): an
intra-node ring stage, an inter-node ring stage between GPUs of the same local index, an
intra-node stage again (all_reduce: reduce_scatter, all_reduce of S/g, all_gather);
broadcast and reduce as a chain across nodes on the root's rail and one inside each node."""

from __future__ import annotations

import numpy as np

from zsim.cluster.build import IntArray
from zsim.cluster.topology import Topology
from zsim.errors import InputError
from zsim.network.collective import CollectiveCall, CollectiveOp, Phase
from zsim.network.nccl import (
    chain_phase,
    nccl_ring,
    regular_nodes,
    ring_basis,
    ring_phase,
    rotated_to,
)
from zsim.network.patterns import Built, by_node


def hierarchical(topo: Topology, call: CollectiveCall) -> Built:
    grid = regular_nodes(topo, call.group)
    if grid is None:
        members = [len(node) for node in by_node(topo, call.group)]
        what = "the same number of members on every node (hierarchical algorithm)"
        raise InputError("group", members, what)
    if grid.shape[0] == 1 or grid.shape[1] == 1:
        return nccl_ring(topo, call)
    stages = _stages(topo, call, grid)
    return [phase for phase, _ in stages], sum(closed for _, closed in stages)


def _stages(topo: Topology, call: CollectiveCall, nodes: IntArray) -> list[tuple[Phase, float]]:
    """The stages of a hierarchical call: `nodes` rows are nodes, its columns rails."""
    size, g, op, rails = call.nbytes, nodes.shape[1], call.op, nodes.T
    if op in (CollectiveOp.BROADCAST, CollectiveOp.REDUCE):
        return _rooted(topo, call, nodes)
    by_nodes, by_rails = ring_basis(topo, nodes), ring_basis(topo, rails)
    if op is CollectiveOp.ALL_REDUCE:
        return [
            ring_phase(topo, CollectiveOp.REDUCE_SCATTER, by_nodes, size, False),
            ring_phase(topo, CollectiveOp.ALL_REDUCE, by_rails, size / g, False),
            ring_phase(topo, CollectiveOp.ALL_GATHER, by_nodes, size, False),
        ]
    if op is CollectiveOp.ALL_GATHER:
        return [
            ring_phase(topo, op, by_rails, size / g, False),
            ring_phase(topo, op, by_nodes, size, False),
        ]
    return [  # reduce_scatter
        ring_phase(topo, op, by_nodes, size, False),
        ring_phase(topo, op, by_rails, size / g, False),
    ]


def _rooted(topo: Topology, call: CollectiveCall, nodes: IntArray) -> list[tuple[Phase, float]]:
    """Broadcast: a chain across nodes on the root's rail, then one inside every node; reduce
    the other way round."""
    size, rails, root = call.nbytes, nodes.T, call.group[call.root]
    slot = int(np.flatnonzero((rails == root).any(axis=1))[0])
    across = rotated_to(rails[slot : slot + 1], root)
    inside = np.roll(nodes, -slot, axis=1)
    if call.op is CollectiveOp.BROADCAST:
        return [chain_phase(topo, across, size, False), chain_phase(topo, inside, size, False)]
    return [chain_phase(topo, inside, size, True), chain_phase(topo, across, size, True)]
