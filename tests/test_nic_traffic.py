"""Bytes between emulated nodes: the kernel's counters as validation reads them, and the
simulated bytes on the nodes' links against gloo's algorithms worked by hand.

The hand derivation (torch 2.13's ProcessGroupGloo, docs/collectives.md section 1): an
all_gather is a ring over the group's ranks in order, each rank sending n-1 chunks of S/n to
the next; a reduce_scatter_tensor is an all_reduce of the whole input (a ring: 2(n-1) chunks of
S/n per rank). On 2 nodes x 2 ranks the ring 0-1-2-3 crosses between nodes at 1->2 and 3->0, so
every ring step puts 2 chunks on the node links, each counted once as sent and once as
received. For the seeds' MLP (P parameters, fp32 on CPU, every Linear its own FSDP unit):
- full: per micro-batch 2 gathers (forward, backward) and 1 reduce-scatter of the P x 4 bytes:
  (2 x 3 + 6) ring steps x 2 crossings x (4P / 4) bytes x 2 (sent + received) = 48 P;
- grad-op: 1 gather, 1 reduce-scatter: 36 P;
- hybrid (shard 2 within a node): the gathers and reduce-scatters stay inside the node; the
  fp32 gradient shard (4P / 2 bytes) of each rank is all-reduced with its peer on the other
  node, a 2-rank ring sending it once each way: 2 pairs x 2 x 2P x 2 = 16 P.
"""

from __future__ import annotations

import csv
import socket
from pathlib import Path

import pytest

from zsim.calibrate.profile import load_calibration
from zsim.inputs import presets
from zsim.inputs.scenario import parse_model
from zsim.simulation import simulate
from zsim.testbed import nic
from zsim.validate.committed import burst_bytes, case_of
from zsim.validate.compare import node_link_bytes
from zsim.workload.parallel import DpEngine, ParallelConfig, Precision, ZeroStage
from zsim.workload.sharding import FsdpSharding

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "calibration" / "cpu-2rank-fsdp.json"
COMMITTED = ROOT / "benchmarks" / "validation" / "cpu-2x2-fsdp-emulated"

PROC_NET_DEV = """\
Inter-|   Receive                                                |  Transmit
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed
    lo:    3193      29    0    0    0     0          0         0     3193      29    0    0    0     0       0          0
 veth0: 808683123  61234    0    0    0     0          0         0 402913 5012    0    0    0     0       0          0
"""  # noqa: E501


def test_the_counters_are_read_by_interface() -> None:
    assert nic.parse(PROC_NET_DEV, "veth0") == nic.NicBytes(rx=808683123, tx=402913)
    assert nic.parse(PROC_NET_DEV, "lo") == nic.NicBytes(rx=3193, tx=3193)
    assert nic.parse(PROC_NET_DEV, "eth9") is None
    assert nic.NicBytes(10, 7) - nic.NicBytes(4, 2) == nic.NicBytes(6, 5)


def test_bytes_sent_over_loopback_are_counted() -> None:
    """1 MB over a loopback TCP connection: the interface counts at least that, each way."""
    before = nic.read("lo")
    server = socket.create_server(("127.0.0.1", 0))
    with server, socket.create_connection(server.getsockname()) as client:
        peer, _ = server.accept()
        with peer:
            client.sendall(b"x" * 2**20)
            got = 0
            while got < 2**20:
                got += len(peer.recv(1 << 16))
    after = nic.read("lo")
    assert before is not None
    assert after is not None
    delta = after - before
    assert delta.tx >= 2**20
    assert delta.rx >= 2**20


MLP = "toy-mlp:hidden=1024"
BYTES_PER_P = {FsdpSharding.FULL: 48, FsdpSharding.GRAD_OP: 36, FsdpSharding.HYBRID: 16}


@pytest.mark.parametrize("sharding", list(FsdpSharding))
@pytest.mark.parametrize("accum", [1, 2])
def test_fsdp_bytes_between_nodes_are_gloos_rings(sharding: FsdpSharding, accum: int) -> None:
    model = parse_model(MLP)
    cfg = ParallelConfig(
        dp=4,
        zero_stage=ZeroStage.PARAMETERS,
        grad_accum=accum,
        precision=Precision.FP32,
        dp_engine=DpEngine.FSDP,
        fsdp_sharding=sharding,
        fsdp_shard_size=2 if sharding is FsdpSharding.HYBRID else 0,
    )
    topology = presets.topology("2x2-cpu-1gbit")
    report = simulate(model, cfg, topology, load_calibration(PROFILE).profile)  # rates only
    want = BYTES_PER_P[sharding] * model.total_params() * accum
    assert node_link_bytes(report.link_traffic_bytes, topology) == pytest.approx(want, rel=1e-3)


ACKS = nic.HEADER_BYTES / (2 * nic.FRAME_BYTES)  # RFC 5681: an ACK per 2 full segments


def _committed_rows() -> list[dict[str, str]]:
    with (COMMITTED / "predicted_vs_measured.csv").open() as f:
        return [r for r in csv.DictReader(f) if r["status"] == "ok"]


def test_the_real_runs_carried_what_gloos_rings_send() -> None:
    """The bytes the emulated nodes' veths counted in the committed FSDP2 runs against the
    hand derivation sent as the links frame it (`nic.frame_bytes`: the headers of each
    packet), plus at most the acknowledgements (one per two full segments)."""
    rows = _committed_rows()
    assert {r["case"] for r in rows} == {"fsdp-full", "fsdp-grad-op", "fsdp-hybrid"}
    burst = burst_bytes(COMMITTED)
    for row in rows:
        case = case_of(row)
        payload = BYTES_PER_P[case.parallel.fsdp_sharding] * case.model.total_params()
        want = nic.frame_bytes(payload * case.parallel.grad_accum, burst)
        counted = float(row["measured_nic_bytes_per_step"])
        assert want <= counted <= want * (1 + ACKS), row["case"]


def test_frames_carry_their_headers() -> None:
    """A full TCP segment on a 1,500-byte MTU carries 1,448 bytes of payload in a 1,514-byte
    Ethernet frame (IPv4 20 + TCP 20 + timestamps 12 + Ethernet 14); a GSO packet the link
    passes whole carries one set of headers per 64 KiB."""
    assert nic.frame_bytes(1448 * 1000, 16 * 1024) == pytest.approx(1514 * 1000)
    assert nic.frame_bytes(65470 * 10, 256 * 1024) == pytest.approx(65536 * 10)
    assert nic.frame_bytes(65470 * 10, None) == pytest.approx(65536 * 10)
