"""How a backend performs a call: the algorithm it chooses, the phases of flows that algorithm
runs (`zsim.network.nccl`, `zsim.network.gloo`) and its closed form (`estimate_s`, the fast
path). send_recv pays the topology's send/recv call latency where it has one (gloo: torch posts
it on the caller's thread, not the worker queue)."""

from __future__ import annotations

from collections.abc import Callable

from zsim.cluster.fabric import Backend
from zsim.cluster.topology import Topology
from zsim.errors import require
from zsim.network.collective import Algorithm, CollectiveCall, CollectiveOp, Plan
from zsim.network.gloo import gloo
from zsim.network.nccl import nccl_prefers_tree, nccl_ring, nccl_tree
from zsim.network.nccl_hierarchical import hierarchical
from zsim.network.patterns import Built, point_to_point

Builder = Callable[[Topology, CollectiveCall], Built]


def _builder(topo: Topology, call: CollectiveCall) -> tuple[str, Builder]:
    algorithm, op = call.algorithm, call.op
    flat = algorithm in (Algorithm.AUTO, Algorithm.RING)
    if topo.fabric.backend is Backend.GLOO:
        require(flat, "algorithm", str(algorithm), "auto or ring: gloo has no other algorithm")
        return "gloo", gloo
    if op in (CollectiveOp.SEND_RECV, CollectiveOp.ALL_TO_ALL):
        require(flat, "algorithm", str(algorithm), f"auto or ring for {op} (point-to-point)")
        return "nccl-p2p", point_to_point
    if algorithm is Algorithm.TREE:
        require(op is CollectiveOp.ALL_REDUCE, "algorithm", "tree", "all_reduce only (NCCL)")
        return "nccl-tree", nccl_tree
    if algorithm is Algorithm.HIERARCHICAL:
        return "nccl-hierarchical", hierarchical
    return "nccl-ring", nccl_ring


def plan(topo: Topology, call: CollectiveCall) -> Plan:
    """The phases `call` runs as on `topo`, and its closed form (call latency included)."""
    topo.check_gpus(call.group)
    name, build = _builder(topo, call)
    overhead = topo.call_latency_s
    if call.op is CollectiveOp.SEND_RECV and topo.p2p_call_latency_s is not None:
        overhead = topo.p2p_call_latency_s
    overhead += topo.local_work.op_call(call.op)
    if len(call.group) == 1:
        return Plan(call, name, (), overhead, overhead)
    if name == "nccl-ring" and nccl_prefers_tree(topo, call):
        name, build = "nccl-tree", nccl_tree
    phases, closed = build(topo, call)
    return Plan(call, name, tuple(phases), overhead, overhead + closed)


def estimate_s(topo: Topology, call: CollectiveCall) -> float:
    """The fast path: the chosen algorithm's closed form, without simulating."""
    return plan(topo, call).closed_form_s
