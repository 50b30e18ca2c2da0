"""The emulated cluster: namespaces, shaped links, and a teardown that always happens.

What is checked against what: the rate against a TCP transfer timed between two namespaces
(the kernel's tbf, not our arithmetic); cleanup against `ip netns list`, `ip link` and /proc.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers_signals import popen_taking_ctrl_c
from zsim.errors import InputError
from zsim.testbed import emulate, procs
from zsim.testbed.emulate import EmulatedCluster

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or not emulate.shutil.which("tc"), reason="needs root and iproute2"
)


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


def _links() -> str:
    return subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout


def _gone(pid: int, wait_s: float = 10.0) -> bool:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        status = Path(f"/proc/{pid}/status")
        if not status.exists() or "State:\tZ" in status.read_text():
            return True
        time.sleep(0.05)
    return False


def test_refuses_without_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(emulate, "is_root", lambda: False)
    with pytest.raises(InputError, match="root"), EmulatedCluster(2, 1, 12.5e6):
        pass


def test_cli_refuses_without_root(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from zsim.cli import main

    monkeypatch.setattr(emulate, "is_root", lambda: False)
    assert main(["validate", "--topology", "2x2-cpu-1gbit", "--emulate"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "root" in err[0]


def test_refuses_bad_shapes() -> None:
    with pytest.raises(InputError, match="nodes"):
        EmulatedCluster(0, 1, 1e6)
    with pytest.raises(InputError, match="rate_bps"):
        EmulatedCluster(2, 1, -1.0)


@needs_root
def test_creates_and_removes_everything() -> None:
    before_links = _links()
    with EmulatedCluster(nodes=3, ranks_per_node=2, rate_bps=12.5e6) as c:
        assert c.emulation is not None
        made = {*c.emulation.namespaces, c.bridge_ns}
        assert made <= _namespaces()
        assert c.emulation.addresses == ("10.213.0.1", "10.213.0.2", "10.213.0.3")
        qdisc = emulate.run_in_ns(c.node_ns(1), ["tc", "qdisc", "show", "dev", "veth0"])
        assert "tbf" in qdisc
        assert "100Mbit" in qdisc
        bridge_side = emulate.run_in_ns(c.bridge_ns, ["tc", "qdisc", "show", "dev", "n2"])
        assert "tbf" in bridge_side
        assert c.measure_rate_bps(0, 2, nbytes=400_000) > 0  # through the bridge
        assert c.tag not in _links()  # nothing in the root namespace
    assert not made & _namespaces()
    assert _links() == before_links


@needs_root
def test_removes_everything_when_the_block_raises() -> None:
    seen: dict[str, object] = {}

    def inside() -> None:
        with EmulatedCluster(2, 1, 12.5e6) as c:
            assert c.emulation is not None
            seen["made"] = {*c.emulation.namespaces, c.bridge_ns}
            seen["sleeper"] = c.popen(1, ["sleep", "600"]).pid
            raise RuntimeError("inside")

    with pytest.raises(RuntimeError, match="inside"):
        inside()
    made = seen["made"]
    assert isinstance(made, set)
    assert made
    assert not made & _namespaces()
    assert _gone(int(str(seen["sleeper"])))


@needs_root
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_removes_everything_on_a_signal(sig: signal.Signals) -> None:
    proc = popen_taking_ctrl_c(
        [sys.executable, "-m", "zsim.testbed.emulate", "2", "12.5e6", "120"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        held = json.loads(proc.stdout.readline())
        assert set(held["namespaces"]) <= _namespaces()
        proc.send_signal(sig)
        assert proc.wait(timeout=60) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not set(held["namespaces"]) & _namespaces()
    assert _gone(held["sleeper"])


@needs_root
def test_a_killed_owner_is_cleaned_up_by_the_next_cluster() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "zsim.testbed.emulate", "2", "12.5e6", "120"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    held = json.loads(proc.stdout.readline())
    proc.kill()  # SIGKILL: no teardown runs
    proc.wait(timeout=30)
    assert set(held["namespaces"]) <= _namespaces()
    removed = emulate.remove_stale()
    assert set(held["namespaces"]) <= set(removed)
    assert not set(held["namespaces"]) & _namespaces()
    assert _gone(held["sleeper"])


@needs_root
def test_the_applied_rate_is_what_a_transfer_gets() -> None:
    """100 Mbit/s set; an 8 MB TCP transfer between two namespaces within 15%. (TCP payload
    is about 1448/1514 of the frame bytes tbf counts, so expect ~4-5% below the rate.) tc caps
    the rate and a loaded host can only lower what Python feeds it (CI saw 80 % once on one
    try), so the best of three meets the cap in each direction; an unapplied cap is far above."""
    rate = 12.5e6
    with EmulatedCluster(nodes=2, ranks_per_node=1, rate_bps=rate) as c:
        there = [c.measure_rate_bps(0, 1, nbytes=8_000_000) for _ in range(3)]
        back = [c.measure_rate_bps(1, 0, nbytes=4_000_000) for _ in range(3)]
        assert c.emulation is not None
        assert c.emulation.measured_rate_bps == there[-1]
    assert max(there) == pytest.approx(rate, rel=0.15)
    assert max(back) == pytest.approx(rate, rel=0.15)


@needs_root
def test_the_scale_is_applied_and_recorded() -> None:
    with EmulatedCluster(nodes=2, ranks_per_node=1, rate_bps=12.5e9, scale=0.002) as c:
        assert c.emulation is not None
        assert c.emulation.rate_bps == pytest.approx(25e6)
        assert c.emulation.tc_rate_bit == 200_000_000
        assert c.emulation.scale == 0.002
        # tc caps the rate; a loaded 2-core host may not feed 200 Mbit/s from Python on one
        # try (20.5 MB/s seen once under `make test`): the best of three meets the cap
        best = max(c.measure_rate_bps(0, 1, nbytes=8_000_000) for _ in range(3))
    assert best == pytest.approx(25e6, rel=0.15)


@needs_root
def test_latency_emulation_is_recorded_as_applied() -> None:
    with EmulatedCluster(nodes=2, ranks_per_node=1, rate_bps=12.5e6, latency_s=5e-3) as c:
        assert c.emulation is not None
        netem = emulate.netem_available(c.bridge_ns)
        if netem:
            assert c.emulation.latency_s == 5e-3
            assert c.emulation.latency_emulation.startswith("netem")
        else:
            assert c.emulation.latency_s == 0.0
            assert "netem unavailable" in c.emulation.latency_emulation


def test_tags_name_their_owner() -> None:
    tag = procs.new_tag("run")
    assert procs.owner_pid(tag) == os.getpid()
    assert procs.owner_pid("something-else") is None
