"""A topology as a JSON-ready summary: its counts, each link class with its numbers, and on a gloo
fabric its ranks' local work (`zsim topology`)."""

from __future__ import annotations

from typing import Any

from zsim.cluster.fabric import Backend, LocalWork
from zsim.cluster.topology import Topology


def describe(topo: Topology) -> dict[str, Any]:
    """A JSON-ready summary: counts, each link class with its numbers, and on a gloo fabric
    its ranks' local work."""
    gloo = gloo_fabric(topo)
    kinds: dict[str, int] = {}
    for _, data in topo.graph.nodes(data=True):
        kinds[data["kind"]] = kinds.get(data["kind"], 0) + 1
    return {
        "name": topo.name,
        "fabric": topo.fabric.name,
        "description": topo.fabric.description,
        "gpu": topo.gpu_model,
        "backend": str(topo.fabric.backend),
        "nodes": topo.nodes,
        "gpus_per_node": topo.gpus_per_node,
        "gpus": topo.world_size,
        "vertices": kinds,
        "rail_optimized": topo.fabric.rail_optimized,
        "oversubscription": topo.fabric.oversubscription,
        "call_latency_us": round(topo.call_latency_s * 1e6, 6),
        **(
            {"p2p_call_latency_us": round(topo.p2p_call_latency_s * 1e6, 6)}
            if topo.p2p_call_latency_s is not None
            else {}
        ),
        "links": [
            {
                "class": str(cls),
                "bandwidth_GBps": round(bw / 1e9, 9),
                "latency_us": round(lat * 1e6, 6),
                "duplex": "half" if half else "full",
                "directed_edges": count,
            }
            for cls, bw, lat, half, count in topo.link_classes()
        ],
        **({"local_work": _local_work_summary(topo.local_work)} if gloo else {}),
        **_nvlink_line(topo),
    }


def _nvlink_line(topo: Topology) -> dict[str, Any]:
    """The NVLink line rate and link count where NCCL's rate replaces it (`zsim.cluster.nvlink`)."""
    fabric = topo.fabric
    if fabric.nvswitch is None or fabric.nvlinks_per_gpu is None or gloo_fabric(topo):
        return {}
    return {
        "nvlink_line_GBps": round(fabric.nvswitch.bandwidth_bytes_per_s / 1e9, 9),
        "nvlinks_per_gpu": fabric.nvlinks_per_gpu,
    }


def gloo_fabric(topo: Topology) -> bool:
    return topo.fabric.backend is Backend.GLOO


def _local_work_summary(work: LocalWork) -> dict[str, Any]:
    out: dict[str, Any] = {
        "message_us": round(work.message_s * 1e6, 6),
        "copy_GBps": round(work.copy_bytes_per_s / 1e9, 9),
        "reduce_GBps": round(work.reduce_bytes_per_s / 1e9, 9),
        "first_touch_GBps": round(work.first_touch_bytes_per_s / 1e9, 9),
        "fresh_above_bytes": work.fresh_above_bytes,
    }
    if work.op_s_per_byte:
        out["op_ns_per_byte"] = {
            str(op): round(v * 1e9, 9) for op, v in sorted(work.op_s_per_byte.items())
        }
    if work.op_call_s:
        out["op_call_us"] = {str(op): round(v * 1e6, 6) for op, v in sorted(work.op_call_s.items())}
    return out
