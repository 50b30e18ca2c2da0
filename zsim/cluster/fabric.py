"""What a cluster is made of, as validated data: the fabric spec of a preset or a user's file.

A fabric preset (`topologies/<fabric>.yaml`) describes one kind of node (GPU model, NVSwitch or
PCIe or loopback inside, NICs) and the network between nodes (link class, rail-optimized or
not, leaf size, oversubscription). The node count N and GPUs per node G come from the name
(`zsim.cluster.names`). A user's cluster file is the same mapping plus `nodes` and
`gpus_per_node`.

Units: preset keys carry them (`bandwidth_GBps` = 1e9 bytes/s per direction, `rate_Gbps` =
1e9 bits/s, `latency_us`); this module converts to bytes/s and seconds once, here.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from zsim.errors import InputError, is_whole, positive_int, positive_number, require

GB = 1e9


US = 1e-6


class LinkClass(StrEnum):
    """The kind of a link; a calibrated profile overrides links by class."""

    NVLINK = "nvlink"
    PCIE = "pcie"
    LOOPBACK = "loopback"  # processes on one host (TCP over lo)
    IB = "ib"
    ROCE = "roce"
    ETHERNET = "ethernet"
    VETH = "veth"  # emulated node-to-node link (network namespaces)


NETWORK_CLASSES = (LinkClass.IB, LinkClass.ROCE, LinkClass.ETHERNET, LinkClass.VETH)


class Backend(StrEnum):
    """The communication library: it decides which algorithms a collective can use."""

    NCCL = "nccl"
    GLOO = "gloo"


class NicAttach(StrEnum):
    PCIE_SWITCH = "pcie_switch"  # NIC beside its GPUs under one PCIe switch (DGX, GPUDirect)
    HOST = "host"  # NIC on a CPU root port (or the host's network stack)


@dataclass(frozen=True)
class LinkSpec:
    """One link, per direction; a half-duplex link's two directions share one capacity (a rank's
    loopback TCP stack: its sends and receives run on the same core)."""

    bandwidth_bytes_per_s: float
    latency_s: float
    half_duplex: bool = False


@dataclass(frozen=True)
class LocalWork:
    """What a rank's own CPU spends in a gloo collective besides moving bytes (the CPU fabric;
    docs/collectives.md 1.1-1.5): a cost per message it sends or receives,
    torch's copies into memory already touched, gloo's elementwise reductions, the page
    faults of a freshly mapped temporary, and each op's own cost per byte it moves. The default
    costs nothing (GPU fabrics, test stars).

    `op_s_per_byte` (by `zsim.network.collective.CollectiveOp`; an op not in it costs nothing) is
    the CPU a rank spends per byte it sends plus receives in that op beyond everything else
    modelled here and beyond the wire (the link class's bandwidth): the work the ops do not
    share, such as torch's temporary output and copy-out around gloo's all_gather and gloo's
    half-block loop (docs/collectives.md 1.2), or its segment loop and scratch
    buffer in all_reduce. It is fitted per op from calibration (`zsim.calibrate.links`), the
    op that moves bytes most cheaply defining the wire.

    `op_call_s` is, likewise, an op's own fixed CPU per call beyond the backend's call latency
    (the op with the cheapest calls defining that latency): ProcessGroupGloo wraps each op
    differently (all_gather_into_tensor allocates and copies out a flat output,
    reduce_scatter_tensor clones its input and all-reduces it, broadcast and all_reduce run
    gloo's algorithm on the tensor), and on 2 ranks here their 8-byte calls took 0.22-0.34 ms."""

    message_s: float = 0.0  # CPU per message a rank sends or receives (syscalls, wake-ups)
    copy_bytes_per_s: float = math.inf  # memcpy into touched memory (torch copy_, clone)
    reduce_bytes_per_s: float = math.inf  # output bytes of a sum: reads two, writes one
    first_touch_bytes_per_s: float = math.inf  # page faults on the first write of a fresh block
    fresh_above_bytes: float = math.inf  # blocks larger than this are mapped fresh every call
    op_s_per_byte: Mapping[str, float] = field(default_factory=dict)  # by op: CPU s per byte moved
    op_call_s: Mapping[str, float] = field(default_factory=dict)  # by op: CPU s per call

    def copy_s(self, nbytes: float) -> float:
        return nbytes / self.copy_bytes_per_s

    def reduce_s(self, nbytes: float) -> float:
        return nbytes / self.reduce_bytes_per_s

    def op_s(self, op: str, moved_bytes: float) -> float:
        """`op`'s own CPU for `moved_bytes` a rank sends plus receives (`op_s_per_byte`)."""
        return moved_bytes * self.op_s_per_byte.get(op, 0.0)

    def op_call(self, op: str) -> float:
        """`op`'s own fixed CPU per call (`op_call_s`)."""
        return self.op_call_s.get(op, 0.0)

    def allocate_s(self, nbytes: float) -> float:
        """A temporary of `nbytes`: free when the allocator reuses memory, else its faults."""
        return nbytes / self.first_touch_bytes_per_s if nbytes > self.fresh_above_bytes else 0.0


@dataclass(frozen=True)
class FabricSpec:
    """A node type and the network between nodes (one preset file)."""

    name: str
    description: str
    gpu: str | None
    gpus_per_node: tuple[int, ...]  # allowed values of G
    backend: Backend
    call_latency_s: float  # fixed cost of one collective call (kernel launch, setup)
    host_cpu: str  # "intel" or "amd": NCCL's tuner costs a network step by the CPU vendor
    protocol: str  # NCCL's protocols: auto (its tuner), ll, ll128, simple, or ideal (none)
    nvswitch: LinkSpec | None  # GPU <-> NVSwitch plane, per GPU (the spec's line rate)
    nvlinks_per_gpu: int | None  # NVLinks behind it (spec sheet): NCCL's rate; None: the line's
    pcie: LinkSpec | None
    gpus_per_pcie_switch: int
    loopback: LinkSpec | None  # rank <-> host stack (CPU fabric)
    local_work: LocalWork  # a rank's own work in gloo's collectives (CPU fabric)
    nics_per_node: int
    nic: LinkSpec  # NIC <-> leaf switch
    nic_class: LinkClass
    nic_attach: NicAttach
    rail_optimized: bool
    leaf_ports: int  # NIC-facing ports per leaf switch
    oversubscription: float  # leaf down / up capacity
    switch_latency_s: float  # leaf <-> spine hop
    # NCCL's rings across nodes: 0, one channel per member slot, each on its own rail; N > 0,
    # N channels on one path, every node entered at its first member and left at its last
    ring_channels: int = 0


# ---- from a mapping (a preset or a user's file) ------------------------------------------

_TOP_KEYS = {
    "description",
    "gpu",
    "gpus_per_node",
    "backend",
    "nvswitch",
    "pcie",
    "loopback",
    "nics",
    "network",
    "local_work",
    "nodes",
}


def fabric_from_mapping(
    data: Mapping[str, Any], source: str, gpu_names: Collection[str]
) -> FabricSpec:
    """Validate a fabric mapping; `source` names the file in every error."""
    _known(data, _TOP_KEYS, source, "")
    pcie = _link(data, "pcie", source, required=False)
    loopback = _link(data, "loopback", source, required=False)
    nvswitch = _link(data, "nvswitch", source, required=False)
    require(
        (pcie is None) != (loopback is None),
        f"{source}:pcie/loopback",
        sorted(k for k in ("pcie", "loopback") if k in data),
        "exactly one of `pcie` (GPU servers) or `loopback` (processes on a host)",
    )
    require(
        nvswitch is None or pcie is not None,
        f"{source}:nvswitch",
        "without pcie",
        "an NVSwitch node also needs `pcie` (the path from GPUs to NICs)",
    )
    gpu = data.get("gpu")
    require(
        gpu is None or gpu in gpu_names,
        f"{source}:gpu",
        gpu,
        "one of " + ", ".join(sorted(gpu_names)) + " (or null for a CPU fabric)",
    )
    backend, call_latency_s, host_cpu, protocol, ring_channels = _backend(data, source)
    pcie_map = data.get("pcie") or {}
    return FabricSpec(
        name=source,
        description=str(data.get("description", "")),
        gpu=None if gpu is None else str(gpu),
        gpus_per_node=_int_list(data.get("gpus_per_node"), f"{source}:gpus_per_node"),
        backend=backend,
        call_latency_s=call_latency_s,
        host_cpu=host_cpu,
        protocol=protocol,
        ring_channels=ring_channels,
        nvswitch=nvswitch,
        nvlinks_per_gpu=_nvlinks(data, source),
        pcie=pcie,
        gpus_per_pcie_switch=positive_int(
            f"{source}:pcie.gpus_per_switch", pcie_map.get("gpus_per_switch", 1)
        ),
        loopback=loopback,
        local_work=_local_work(data, source),
        **_network(data, source, has_pcie=pcie is not None),
    )


def _network(data: Mapping[str, Any], source: str, has_pcie: bool) -> dict[str, Any]:
    """The NIC and switch fields of a FabricSpec, from the `nics` and `network` sections."""
    nics = _section(data, "nics", source)
    net = _section(data, "network", source)
    _known(nics, {"per_node", "rate_Gbps", "link_class", "attach", "latency_us"}, source, "nics.")
    _known(
        net, {"rail_optimized", "leaf_ports", "oversubscription", "latency_us"}, source, "network."
    )
    attach = _choice(nics, "attach", NicAttach, source, "nics.")
    require(
        attach is NicAttach.HOST or has_pcie,
        f"{source}:nics.attach",
        str(attach),
        "`host` unless the node has `pcie`",
    )
    return {
        "nics_per_node": positive_int(f"{source}:nics.per_node", nics.get("per_node")),
        "nic": LinkSpec(
            _rate_gbps(nics.get("rate_Gbps"), f"{source}:nics.rate_Gbps"),
            _latency(nics, source, "nics."),
        ),
        "nic_class": _nic_class(nics, source),
        "nic_attach": attach,
        "rail_optimized": _bool(
            net.get("rail_optimized", False), f"{source}:network.rail_optimized"
        ),
        "leaf_ports": positive_int(f"{source}:network.leaf_ports", net.get("leaf_ports")),
        "oversubscription": _oversubscription(net, source),
        "switch_latency_s": _latency(net, source, "network."),
    }


def _known(data: Mapping[str, Any], allowed: set[str], source: str, prefix: str) -> None:
    for key in data:
        require(
            key in allowed,
            f"{source}:{prefix}{key}",
            data[key],
            "a known key: " + ", ".join(sorted(allowed)),
        )


def _section(data: Mapping[str, Any], key: str, source: str) -> Mapping[str, Any]:
    value = data.get(key)
    if not isinstance(value, Mapping):
        raise InputError(f"{source}:{key}", value, "a mapping of keys to values")
    return value


def _link(data: Mapping[str, Any], key: str, source: str, required: bool) -> LinkSpec | None:
    if key not in data and not required:
        return None
    section = _section(data, key, source)
    allowed = {"bandwidth_GBps", "latency_us"} | ({"gpus_per_switch"} if key == "pcie" else set())
    allowed |= {"duplex"} if key == "loopback" else set()
    allowed |= {"links"} if key == "nvswitch" else set()
    _known(section, allowed, source, f"{key}.")
    bandwidth = positive_number(f"{source}:{key}.bandwidth_GBps", section.get("bandwidth_GBps"))
    duplex = section.get("duplex", "full")
    require(duplex in ("full", "half"), f"{source}:{key}.duplex", duplex, "full or half")
    return LinkSpec(bandwidth * GB, _latency(section, source, f"{key}."), duplex == "half")


def _nvlinks(data: Mapping[str, Any], source: str) -> int | None:
    section = data.get("nvswitch")
    if not isinstance(section, Mapping) or "links" not in section:
        return None
    return positive_int(f"{source}:nvswitch.links", section["links"])


_LOCAL_KEYS = {
    "message_us",
    "copy_GBps",
    "reduce_GBps",
    "first_touch_GBps",
    "fresh_above_bytes",
}


def _local_work(data: Mapping[str, Any], source: str) -> LocalWork:
    if "local_work" not in data:
        return LocalWork()
    section = _section(data, "local_work", source)
    _known(section, _LOCAL_KEYS, source, "local_work.")
    for key in sorted(_LOCAL_KEYS):
        require(key in section, f"{source}:local_work.{key}", None, "required in local_work")

    def rate(key: str) -> float:
        return positive_number(f"{source}:local_work.{key}", section[key]) * GB

    return LocalWork(
        message_s=_microseconds(section["message_us"], f"{source}:local_work.message_us"),
        copy_bytes_per_s=rate("copy_GBps"),
        reduce_bytes_per_s=rate("reduce_GBps"),
        first_touch_bytes_per_s=rate("first_touch_GBps"),
        fresh_above_bytes=positive_number(
            f"{source}:local_work.fresh_above_bytes", section["fresh_above_bytes"]
        ),
    )


def _latency(section: Mapping[str, Any], source: str, prefix: str) -> float:
    return _microseconds(section.get("latency_us", 0.0), f"{source}:{prefix}latency_us")


def _microseconds(value: Any, field: str) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value < 1e9
    require(ok, field, value, "a number of microseconds >= 0")
    return float(value) * US


def _rate_gbps(value: Any, field: str) -> float:
    return positive_number(field, value) * GB / 8


HOST_CPUS = ("intel", "amd")
PROTOCOL_CHOICES = ("auto", "ll", "ll128", "simple", "ideal")
"""`backend.protocol`: NCCL's tuner picks (auto), one forced as NCCL_PROTO would, or none
(ideal: the routes' latencies and bandwidths only, the textbook alpha-beta network)."""


def _backend(data: Mapping[str, Any], source: str) -> tuple[Backend, float, str, str, int]:
    section = _section(data, "backend", source)
    keys = {"name", "call_latency_us", "host_cpu", "protocol", "ring_channels"}
    _known(section, keys, source, "backend.")
    call_latency_s = _microseconds(
        section.get("call_latency_us", 0.0), f"{source}:backend.call_latency_us"
    )
    cpu = section.get("host_cpu", "intel")  # NCCL's own default branch
    require(cpu in HOST_CPUS, f"{source}:backend.host_cpu", cpu, "intel or amd")
    protocol = section.get("protocol", "auto")
    require(
        protocol in PROTOCOL_CHOICES,
        f"{source}:backend.protocol",
        protocol,
        "one of " + ", ".join(PROTOCOL_CHOICES),
    )
    backend = _choice(section, "name", Backend, source, "backend.")
    channels = section.get("ring_channels", 0)
    ok = is_whole(channels) and (channels == 0 or backend is Backend.NCCL)
    require(ok, f"{source}:backend.ring_channels", channels, "a whole number >= 0 (NCCL only)")
    return backend, call_latency_s, str(cpu), str(protocol), channels


def _choice(section: Mapping[str, Any], key: str, enum: Any, source: str, prefix: str) -> Any:
    value = section.get(key)
    try:
        return enum(value)
    except ValueError:
        allowed = "one of " + ", ".join(str(e.value) for e in enum)
        raise InputError(f"{source}:{prefix}{key}", value, allowed) from None


def _nic_class(nics: Mapping[str, Any], source: str) -> LinkClass:
    value = nics.get("link_class")
    for cls in NETWORK_CLASSES:
        if value == str(cls):
            return cls
    raise InputError(f"{source}:nics.link_class", value, "one of " + ", ".join(NETWORK_CLASSES))


def _oversubscription(net: Mapping[str, Any], source: str) -> float:
    value = positive_number(f"{source}:network.oversubscription", net.get("oversubscription", 1))
    require(
        value >= 1, f"{source}:network.oversubscription", value, "a ratio >= 1 (1 = non-blocking)"
    )
    return value


def _bool(value: Any, field: str) -> bool:
    require(isinstance(value, bool), field, value, "true or false")
    return bool(value)


def _int_list(value: Any, field: str) -> tuple[int, ...]:
    values = value if isinstance(value, list) else [value]
    require(bool(values), field, value, "a positive integer or a list of them")
    return tuple(positive_int(field, v) for v in values)
