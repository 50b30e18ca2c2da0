"""A multi-node cluster emulated on one machine: network namespaces, veth pairs, a bridge, tc.

Each emulated node is a network namespace with one veth interface; the other end of every veth
sits in a bridge namespace, joined by a Linux bridge (a non-blocking switch). Ranks on the same
node talk over that node's loopback (unshaped); traffic between nodes crosses two shaped queues,
the sender's veth egress and the bridge port's egress towards the receiver, each a token bucket
(`tc qdisc ... tbf`) at the emulated rate, so every node gets that rate in each direction, as a
full-duplex NIC would. Latency is emulated with netem only where the kernel has it; what was
applied is recorded in `LinkEmulation`, never assumed.

Nothing is created in the root namespace: the veths are created inside their namespaces, so
deleting the namespaces removes everything. Teardown runs on normal exit, on an exception in the
with-block, on SIGINT and on SIGTERM (turned into an exception while the cluster is up), and
namespaces left by a process that was killed outright (SIGKILL) are removed by the next cluster.

Rates here are in bytes per second (`_bps`, as everywhere in zsim); tc is given bits.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from types import TracebackType
from typing import Any

from zsim.errors import InputError, positive_int, positive_number, require
from zsim.testbed import procs

PREFIX = "zsim-"  # procs.new_tag: zsim-<pid>-<seq>-emu
SUBNET = "10.213.0"  # node i has 10.213.0.(i + 1)/24; only inside this cluster's namespaces
NODE_DEV = "veth0"
TEST_PORT = 29400


def is_root() -> bool:
    return os.geteuid() == 0


def check_can_emulate() -> None:
    """Refuse, with one line, where namespaces and tc cannot be used."""
    require(
        is_root(),
        "emulate",
        True,
        "root (network namespaces and tc need it): run as root, or drop --emulate",
    )
    for tool in ("ip", "tc"):
        require(
            shutil.which(tool) is not None,
            "emulate",
            True,
            f"the `{tool}` command (iproute2) on PATH",
        )


@dataclass(frozen=True)
class LinkEmulation:
    """What was applied to every node's link, exactly."""

    rate_bps: float  # bytes/s per direction per node, as applied
    tc_rate_bit: int  # what tc was given (bits/s)
    burst_bytes: int
    queue_limit_s: float  # tbf's `latency`: the longest a packet may wait in the queue
    latency_s: float  # one-way delay added by netem; 0 when none was added
    latency_emulation: str  # "netem delay ..." or "none (...)"
    scale: float  # rate_bps / the topology's inter-node rate
    nodes: int
    ranks_per_node: int
    namespaces: tuple[str, ...]
    addresses: tuple[str, ...]
    measured_rate_bps: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class EmulatedCluster:
    """`nodes` namespaces joined by a shaped bridge; a context manager that always cleans up.

    `rate_bps` is the topology's inter-node rate (bytes/s); what is applied is `rate_bps *
    scale`. `latency_s` is added with netem when the kernel has it (recorded either way).
    """

    nodes: int
    ranks_per_node: int
    rate_bps: float
    scale: float = 1.0
    # tbf's bucket: a transfer's first `burst` bytes pass unshaped, which no real link does;
    # 16 KiB still sustains the rate (2026-12-05, 20 MB over 2 nodes at 1 Gbit/s: 119.5
    # MB/s at 16, 32, 64 and 256 KiB alike; 256 KiB made 64-256 KiB calls up to 1.7x fast)
    burst_bytes: int = 16 * 1024
    queue_limit_s: float = 0.1
    latency_s: float = 0.0
    emulation: LinkEmulation | None = field(default=None, init=False)
    tag: str = field(default="", init=False)  # namespace prefix and process tag
    _namespaces: list[str] = field(default_factory=list, init=False)
    _procs: list[subprocess.Popen[bytes]] = field(default_factory=list, init=False)
    _tags: set[str] = field(default_factory=set, init=False)
    _signals: ExitStack = field(default_factory=ExitStack, init=False)

    def __post_init__(self) -> None:
        positive_int("nodes", self.nodes)
        require(self.nodes <= 250, "nodes", self.nodes, "at most 250 emulated nodes")
        positive_int("ranks_per_node", self.ranks_per_node)
        positive_number("rate_bps", self.rate_bps)
        positive_number("scale", self.scale)
        positive_int("burst_bytes", self.burst_bytes)
        positive_number("queue_limit_s", self.queue_limit_s)
        require(self.latency_s >= 0, "latency_s", self.latency_s, "a delay >= 0 seconds")
        self.tag = procs.new_tag("emu")

    # ---- names ------------------------------------------------------------------------------

    def node_ns(self, node: int) -> str:
        return f"{self.tag}-n{node}"

    @property
    def bridge_ns(self) -> str:
        return f"{self.tag}-br"

    def address(self, node: int) -> str:
        return f"{SUBNET}.{node + 1}"

    @property
    def applied_rate_bps(self) -> float:
        return self.rate_bps * self.scale

    # ---- lifecycle --------------------------------------------------------------------------

    def __enter__(self) -> EmulatedCluster:
        check_can_emulate()
        self._signals.enter_context(procs.terminate_raises())
        try:
            remove_stale()
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Kill what runs inside, delete the namespaces; idempotent, not interruptible."""
        with procs.uninterrupted():
            procs.stop(self._procs, None)
            for tag in self._tags:
                procs.kill_tagged(tag)
            self._procs.clear()
            for ns in reversed(self._namespaces):
                _delete_ns(ns)
            self._namespaces.clear()
            self._signals.close()

    def _build(self) -> None:
        self._add_ns(self.bridge_ns)
        _ip(self.bridge_ns, "link", "set", "lo", "up")
        _ip(self.bridge_ns, "link", "add", "br0", "type", "bridge")
        _ip(self.bridge_ns, "link", "set", "br0", "up")
        netem = netem_available(self.bridge_ns)
        for node in range(self.nodes):
            ns, port = self.node_ns(node), f"n{node}"
            self._add_ns(ns)
            veth = ["link", "add", "name", NODE_DEV, "netns", ns, "type", "veth"]
            _run(["ip", *veth, "peer", "name", port, "netns", self.bridge_ns])
            _ip(self.bridge_ns, "link", "set", port, "master", "br0")
            _ip(ns, "addr", "add", f"{self.address(node)}/24", "dev", NODE_DEV)
            for where, dev in ((ns, NODE_DEV), (self.bridge_ns, port)):
                self._shape(where, dev, netem)
                _ip(where, "link", "set", dev, "up")
            _ip(ns, "link", "set", "lo", "up")
        self.emulation = LinkEmulation(
            rate_bps=self.applied_rate_bps,
            tc_rate_bit=self._tc_rate_bit,
            burst_bytes=self.burst_bytes,
            queue_limit_s=self.queue_limit_s,
            latency_s=self.latency_s if netem else 0.0,
            latency_emulation=self._latency_text(netem),
            scale=self.scale,
            nodes=self.nodes,
            ranks_per_node=self.ranks_per_node,
            namespaces=tuple(self.node_ns(n) for n in range(self.nodes)),
            addresses=tuple(self.address(n) for n in range(self.nodes)),
        )

    @property
    def _tc_rate_bit(self) -> int:
        return max(8, round(self.applied_rate_bps * 8))

    def _latency_text(self, netem: bool) -> str:
        if not netem:
            return "none (netem unavailable in this kernel)"
        if self.latency_s == 0:
            return "none (no latency requested)"
        return f"netem delay {self.latency_s * 1e6:.0f}us per shaped queue"

    def _shape(self, ns: str, dev: str, netem: bool) -> None:
        tbf = [
            "tbf",
            "rate",
            f"{self._tc_rate_bit}bit",
            "burst",
            f"{self.burst_bytes}b",
            "latency",
            f"{self.queue_limit_s * 1e3:.0f}ms",
        ]
        if netem and self.latency_s > 0:
            # two shaped queues per path (sender's veth, bridge port): half the delay on each
            delay = f"{self.latency_s * 1e6 / 2:.0f}us"
            _tc(ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay", delay)
            _tc(ns, "qdisc", "add", "dev", dev, "parent", "1:", "handle", "2:", *tbf)
        else:
            _tc(ns, "qdisc", "add", "dev", dev, "root", *tbf)

    def _add_ns(self, ns: str) -> None:
        self._namespaces.append(ns)  # first: deleting one that was never made is harmless
        _run(["ip", "netns", "add", ns])

    # ---- running things inside --------------------------------------------------------------

    def popen(
        self,
        node: int,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        tag: str | None = None,
        **kwargs: Any,
    ) -> subprocess.Popen[bytes]:
        """Start `argv` inside a node, in its own process group, tagged (default: with the
        cluster's tag); whatever still runs is killed when the cluster closes."""
        tag = tag or self.tag
        self._tags.add(tag)
        proc = procs.spawn(netns_argv(self.node_ns(node), argv), tag, env, **kwargs)
        self._procs.append(proc)
        return proc

    def measure_rate_bps(self, src: int = 0, dst: int = 1, nbytes: int = 4_000_000) -> float:
        """Achieved TCP rate from node `src` to node `dst` (bytes/s), timed at the receiver
        after the first quarter, so the token bucket's initial burst does not count."""
        require(src != dst, "dst", dst, f"a node other than src={src}")
        argv = [self.address(dst), str(TEST_PORT), str(nbytes)]
        started: list[subprocess.Popen[bytes]] = []
        try:
            started.append(
                self.popen(dst, [sys.executable, "-c", _RECEIVER, *argv], stdout=subprocess.PIPE)
            )
            started.append(self.popen(src, [sys.executable, "-c", _SENDER, *argv]))
            out, _ = started[0].communicate(timeout=60 + 10 * nbytes / self.applied_rate_bps)
        finally:
            procs.stop(started, tag=None)
        require(started[0].returncode == 0, "emulate", "link test", "a TCP transfer that ends")
        result = json.loads(out)
        rate = float(result["bytes"]) / float(result["seconds"])
        if self.emulation is not None and (src, dst) == (0, 1):
            self.emulation = _with_measured(self.emulation, rate)
        return rate


def _with_measured(emulation: LinkEmulation, rate: float) -> LinkEmulation:
    values = emulation.as_dict() | {"measured_rate_bps": rate}
    values["namespaces"] = tuple(values["namespaces"])
    values["addresses"] = tuple(values["addresses"])
    return LinkEmulation(**values)


_RECEIVER = """
import json, socket, sys, time
host, port, total = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((host, port)); srv.listen(1); srv.settimeout(30); print("", end="", flush=True)
conn, _ = srv.accept(); got, skip, t0 = 0, total // 4, None
while got < total:
    chunk = conn.recv(1 << 20)
    if not chunk: break
    got += len(chunk)
    if t0 is None and got >= skip: t0, base = time.perf_counter(), got
print(json.dumps({"bytes": got - base, "seconds": time.perf_counter() - t0}))
"""

_SENDER = """
import socket, sys, time
host, port, total = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for _ in range(200):
    try: s = socket.create_connection((host, port), timeout=5); break
    except OSError: time.sleep(0.05)
block = b"z" * (1 << 16); sent = 0
while sent < total: s.sendall(block[: min(len(block), total - sent)]); sent += len(block)
s.close()
"""


# ---- commands -----------------------------------------------------------------------------


def netns_argv(ns: str, argv: Sequence[str]) -> list[str]:
    """`argv` as run inside namespace `ns` (`ip netns exec` execs it: the pid is the same)."""
    return ["ip", "netns", "exec", ns, *argv]


def run_in_ns(ns: str, argv: Sequence[str], timeout_s: float = 60.0) -> str:
    """Run a short command inside `ns`; its stdout."""
    return _run(netns_argv(ns, argv), timeout_s)


def _run(argv: Sequence[str], timeout_s: float = 30.0) -> str:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise EmulationError(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")
    return done.stdout


def _ip(ns: str, *args: str) -> str:
    return _run(["ip", "-n", ns, *args])


def _tc(ns: str, *args: str) -> str:
    return _run(["tc", "-n", ns, *args])


class EmulationError(RuntimeError):
    """A namespace, link or qdisc could not be set up (not bad input: the host refused)."""


def netem_available(ns: str) -> bool:
    """Whether the kernel has netem: try it on a throwaway veth pair inside `ns`."""
    _ip(ns, "link", "add", "znetem0", "type", "veth", "peer", "name", "znetem1")
    try:
        done = subprocess.run(
            ["tc", "-n", ns, "qdisc", "add", "dev", "znetem0", "root", "netem", "delay", "1ms"],
            capture_output=True,
            timeout=10,
        )
        return done.returncode == 0
    finally:
        _ip(ns, "link", "del", "znetem0")


def _delete_ns(ns: str) -> None:
    subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def our_namespaces() -> list[str]:
    """Namespaces this module created (any process), by their prefix."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    names = [line.split()[0] for line in out.stdout.splitlines() if line.strip()]
    return [n for n in names if re.match(rf"{PREFIX}\d+-\d+-", n)]


def remove_stale() -> list[str]:
    """Remove what a zsim process killed outright (SIGKILL) left: its processes, then its
    namespaces. Namespaces of live processes are not touched."""
    procs.kill_orphans()
    removed = []
    for ns in our_namespaces():
        owner = procs.owner_pid(ns)
        if owner is not None and not procs.alive(owner):
            _delete_ns(ns)
            removed.append(ns)
    return removed


def _main(argv: Sequence[str]) -> int:
    """`python -m zsim.testbed.emulate NODES RATE_BPS [HOLD_S]`: build a cluster, start a
    process inside, hold, remove everything (the tests signal it to check the teardown)."""
    nodes, rate = int(argv[0]), float(argv[1])
    hold_s = float(argv[2]) if len(argv) > 2 else 0.0
    try:
        with EmulatedCluster(nodes=nodes, ranks_per_node=1, rate_bps=rate) as c:
            sleeper = c.popen(0, ["sleep", "600"])
            held = {"namespaces": [*c.emulation.namespaces, c.bridge_ns] if c.emulation else []}
            print(json.dumps(held | {"sleeper": sleeper.pid}), flush=True)
            time.sleep(hold_s)
    except InputError as exc:
        print(f"zsim: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
