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
