"""A calibrated profile on a topology: its fitted link classes, call latency and (gloo) the
ranks' local work replace the preset's numbers. The simulator and the calibration's fit use the
same function, `apply_profile`, so what was fitted is what is simulated."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from zsim.cluster.build import CLASSES
from zsim.cluster.device import DeviceProfile, LinkFit
from zsim.cluster.fabric import Backend, LinkClass
from zsim.cluster.topology import Topology
from zsim.errors import require

SUM_PASSES = 3
"""A sum out = a + b reads two operands and writes one: in output bytes it runs at a third of
the elementwise rate the profile measures (bytes moved)."""


def apply_profile(topo: Topology, profile: DeviceProfile) -> Topology:
    """`topo` with the profile's fitted links (by class) and call latency, and, for a gloo
    profile on a gloo fabric, send/recv's own call latency and its ranks' local work
    (`local_rates`, and the ops' own costs per byte)."""
    gloo = profile.backend == "gloo" and topo.fabric.backend is Backend.GLOO
    p2p = profile.p2p_call_latency_s if gloo else None
    topo = with_links(topo, profile.links, profile.call_latency_s, p2p)
    if gloo:
        topo = with_local_work(
            topo, dict(profile.op_s_per_byte), dict(profile.op_call_s), **local_rates(profile)
        )
    return topo


def local_rates(profile: DeviceProfile) -> dict[str, float]:
    """A CPU profile's rates of a gloo rank's own work: copies at its memcpy rate (on the CPU
    the host-copy rows time copy_ between host buffers, torch's own copies), sums at its
    elementwise rate (fp32, the dtype gloo reduces here, when measured), and the fitted cost
    per message and page-fault rate when the profile has them."""
    rates = profile.rates.get("fp32") or next(iter(profile.rates.values()))
    out = {
        "copy_bytes_per_s": profile.host_link_bytes_per_s,
        "reduce_bytes_per_s": rates.memory_bytes_per_s / SUM_PASSES,
    }
    if profile.message_s is not None:
        out["message_s"] = profile.message_s
    if profile.first_touch_bytes_per_s is not None:
        out["first_touch_bytes_per_s"] = profile.first_touch_bytes_per_s
    return out


def with_links(
    topo: Topology,
    links: Mapping[str, LinkFit],
    call_latency_s: float | None,
    p2p_call_latency_s: float | None = None,
) -> Topology:
    for cls in sorted(links):
        if any(str(CLASSES[i]) == cls for i in np.unique(topo.class_id).tolist()):
            link = links[cls]
            topo = with_link_class(
                topo,
                LinkClass(cls),
                bandwidth_bytes_per_s=link.bandwidth_bytes_per_s,
                latency_s=link.latency_s,
            )
    if call_latency_s is not None:
        topo = with_call_latency(topo, call_latency_s, p2p_call_latency_s)
    return topo


# ---- copies with measured numbers -----------------------------------------------------


def with_link_class(
    topo: Topology,
    link_class: LinkClass,
    *,
    bandwidth_bytes_per_s: float | None = None,
    latency_s: float | None = None,
) -> Topology:
    """A copy where every edge of `link_class` has the given bandwidth and/or latency.

    This is how a calibrated profile replaces spec-sheet numbers with measured ones.
    """
    require(
        bandwidth_bytes_per_s is None or bandwidth_bytes_per_s > 0,
        f"{link_class} bandwidth",
        bandwidth_bytes_per_s,
        "a positive number of bytes/s",
    )
    require(latency_s is None or latency_s >= 0, f"{link_class} latency", latency_s, ">= 0 s")
    mask = topo.class_id == CLASSES.index(link_class)
    bandwidth = topo.bandwidth_bytes_per_s.copy()
    latency = topo.latency_s.copy()
    if bandwidth_bytes_per_s is not None:
        bandwidth[mask] = bandwidth_bytes_per_s
    if latency_s is not None:
        latency[mask] = latency_s
    bandwidth.flags.writeable = False
    latency.flags.writeable = False
    return replace(
        topo,
        bandwidth_bytes_per_s=bandwidth,
        latency_s=latency,
        _routes={},
        _route_sets={},
        memo={},
    )


def with_call_latency(
    topo: Topology, call_latency_s: float, p2p_call_latency_s: float | None = None
) -> Topology:
    """A copy with a measured per-call collective latency and, when given, send/recv's own."""
    require(call_latency_s >= 0, "call latency", call_latency_s, ">= 0 s")
    p2p = p2p_call_latency_s
    require(p2p is None or p2p >= 0, "send/recv call latency", p2p, ">= 0 s")
    return replace(
        topo,
        call_latency_s=call_latency_s,
        p2p_call_latency_s=p2p,
        _routes={},
        _route_sets={},
        memo={},
    )


def with_local_work(
    topo: Topology,
    op_s_per_byte: Mapping[str, float] | None = None,
    op_call_s: Mapping[str, float] | None = None,
    **rates: float,
) -> Topology:
    """A copy whose ranks' local work has the given fields of `LocalWork` (calibrated rates),
    and, when given, the ops' own costs per byte and per call (`LocalWork.op_s_per_byte`,
    `LocalWork.op_call_s`, each replaced whole)."""
    for key, value in rates.items():
        if key == "message_s":
            require(value >= 0, "local work message_s", value, ">= 0 s")
        else:
            require(value > 0, f"local work {key}", value, "> 0 bytes/s")
    fields: dict[str, Any] = dict(rates)  # the float fields of LocalWork
    work = replace(topo.local_work, **fields)
    if op_s_per_byte is not None:
        for op, value in op_s_per_byte.items():
            require(value >= 0, f"local work op_s_per_byte.{op}", value, ">= 0 s per byte")
        work = replace(work, op_s_per_byte=dict(op_s_per_byte))
    if op_call_s is not None:
        for op, value in op_call_s.items():
            require(value >= 0, f"local work op_call_s.{op}", value, ">= 0 s")
        work = replace(work, op_call_s=dict(op_call_s))
    return replace(topo, local_work=work, _routes={}, _route_sets={}, memo={})
