"""A link's latency, measured on its own: a one-byte TCP ping-pong between two ranks of a
group (osu_latency's method: half the round trip), on the interface gloo uses, without gloo.

The link fit keeps each class's latency at least this one-way time (`zsim.calibrate.bounds`):
a message crosses the kernel's stack and the wire whatever the collective library does above
them, so no fitted latency may be smaller. The time includes Python's two socket calls per
side (about a microsecond each), so the floor is a little above the bare link's.
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
import time
from typing import Any

import torch.distributed as dist

from zsim.calibrate.measurement import Kind, Measurement

TRIPS = 400  # round trips timed (each one a sample)
WARMUP_TRIPS = 50
SIOCGIFADDR = 0x8915  # linux/sockios.h


def interface_address(name: str) -> str:
    """The IPv4 address of interface `name` (the one GLOO_SOCKET_IFNAME names)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
    return socket.inet_ntoa(packed[20:24])


def own_address() -> str:
    name = os.environ.get("GLOO_SOCKET_IFNAME")
    return interface_address(name) if name else socket.gethostbyname(socket.gethostname())


def pingpong(name: str, ranks: list[int], link_class: str, dtype: str) -> list[Measurement]:
    """Every rank calls this (the address exchange is a collective); the group's first two
    ranks play; the first returns the row, the others nothing."""
    me = dist.get_rank()
    a, b = ranks[0], ranks[1]
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM) if me == b else None
    address: tuple[str, int] | None = None
    if server is not None:
        server.bind((own_address(), 0))
        server.listen(1)
        address = server.getsockname()
    addresses: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(addresses, address)
    samples: list[float] = []
    if me == a:
        samples = _play_client(tuple(addresses[b]))
    elif server is not None:
        _play_server(server)
    dist.barrier()
    if me != a:
        return []
    return [
        Measurement(
            Kind.PINGPONG,
            "tcp",
            dtype,
            tuple(samples),
            size_bytes=1.0,
            group=name,
            ranks=2,
            link_class=link_class,
        )
    ]


def _play_client(address: tuple[Any, ...]) -> list[float]:
    with socket.create_connection((str(address[0]), int(address[1]))) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        out = []
        for trip in range(WARMUP_TRIPS + TRIPS):
            start = time.perf_counter()
            s.sendall(b"x")
            _recv_one(s)
            if trip >= WARMUP_TRIPS:
                out.append(0.5 * (time.perf_counter() - start))
        return out


def _play_server(server: socket.socket) -> None:
    with server, server.accept()[0] as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(WARMUP_TRIPS + TRIPS):
            _recv_one(s)
            s.sendall(b"x")


def _recv_one(s: socket.socket) -> None:
    if not s.recv(1):
        raise ConnectionError("the ping-pong peer closed its socket")
