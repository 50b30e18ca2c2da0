"""Bytes an interface carried, as the kernel counts them (`/proc/net/dev`).

`/proc/net` shows the reading process's network namespace, so a rank on an emulated node reads
its own node's veth: what the node sent to and received from the others, frames whole (the
Ethernet, IP and TCP headers and the receivers' acknowledgements included). Ranks on one node
share the interface; one of them reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

PROC_NET_DEV = Path("/proc/net/dev")
HEADER_BYTES = 66  # a TCP/IPv4 packet on Ethernet: 14 + IPv4 20 + TCP 20 + timestamps 12
MTU_BYTES = 1500  # a veth's default
FRAME_BYTES = MTU_BYTES + 14  # a full segment's Ethernet frame (the 14-byte Ethernet header)
GSO_MAX_BYTES = 65536  # the largest packet TCP hands the device when it segments offloaded


def frame_bytes(payload_bytes: float, burst_bytes: int | None) -> float:
    """The bytes the interfaces count for `payload_bytes` of TCP payload: every packet with its
    headers (RFC 791, 793, 7323), the receivers' acknowledgements left out (at most one per
    two full segments, RFC 5681: under 2.3 % more). A tbf bucket smaller than a GSO packet
    splits it into MTU-sized segments before the device counts them (1,448 payload bytes a
    1,514-byte frame); a larger one, or no emulated link (None), passes it whole."""
    whole = burst_bytes is None or burst_bytes >= GSO_MAX_BYTES
    segment = GSO_MAX_BYTES if whole else FRAME_BYTES
    payload = segment - HEADER_BYTES
    return payload_bytes * segment / payload


@dataclass(frozen=True)
class NicBytes:
    rx: int
    tx: int

    def __sub__(self, other: NicBytes) -> NicBytes:
        return NicBytes(self.rx - other.rx, self.tx - other.tx)


def parse(text: str, interface: str) -> NicBytes | None:
    """The counters of `interface` in the text of /proc/net/dev (None when it is not listed):
    `name: rx_bytes rx_packets ... (8 fields) tx_bytes ...`."""
    for line in text.splitlines():
        name, sep, fields = line.partition(":")
        if sep and name.strip() == interface:
            values = fields.split()
            return NicBytes(rx=int(values[0]), tx=int(values[8]))
    return None


def read(interface: str) -> NicBytes | None:
    try:
        return parse(PROC_NET_DEV.read_text(), interface)
    except OSError:
        return None
