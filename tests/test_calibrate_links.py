"""The collective fit through zsim's own collective model: known gloo parameters recovered from
synthetic rows, the nccl-tests report, and the non-negative least squares it rests on."""

import numpy as np
import pytest

from tests.calibrate_synthetic import (
    CALL_S,
    INFO,
    LINK_BPS,
    LINK_LATENCY_S,
    MESSAGE_S,
    MIB,
    OWN_CALL_S,
    OWN_S_PER_BYTE,
    P2P_CALL_S,
    TOUCH_BPS,
    calibration,
    collective_rows,
    gloo_two_ranks_s,
    synthetic_rows,
)
from zsim.calibrate.fit import fit_profile
from zsim.calibrate.links import calls_of, row_time_s
from zsim.calibrate.measurement import Kind, Measurement
from zsim.calibrate.profile import (
    Calibration,
    load_profile,
    save_profile,
)
from zsim.cli import main
from zsim.inputs import presets
from zsim.network.communicator import simulate_s


def test_fit_recovers_link_parameters_exactly():
    pytest.importorskip("simpy")
    info = {**INFO, "topology": "1x2-cpu"}
    fit = fit_profile("synthetic", synthetic_rows() + collective_rows(), info)
    link = fit.profile.links["loopback"]
    assert fit.profile.call_latency_s == pytest.approx(CALL_S, rel=1e-6)
    assert link.latency_s == pytest.approx(LINK_LATENCY_S, rel=1e-6)
    assert link.bandwidth_bytes_per_s == pytest.approx(LINK_BPS, rel=1e-6)
    assert fit.profile.message_s == pytest.approx(MESSAGE_S, rel=1e-6)
    assert fit.profile.first_touch_bytes_per_s == pytest.approx(TOUCH_BPS, rel=1e-6)
    assert fit.profile.p2p_call_latency_s == pytest.approx(P2P_CALL_S, rel=1e-6)
    own = fit.profile.op_s_per_byte
    assert set(own) == set(OWN_S_PER_BYTE)
    for op, s_per_byte in OWN_S_PER_BYTE.items():
        assert own[op] == pytest.approx(s_per_byte, rel=1e-6, abs=1e-18), op
    assert fit.profile.op_call_s == pytest.approx(OWN_CALL_S, rel=1e-6)
    coll = [r for r in fit.residuals if r.kind == "collective"]
    assert len(coll) == 5
    assert all(r.worst_rel_err < 1e-6 for r in coll)


def test_fit_recovers_link_parameters_through_noise(tmp_path):
    info = {**INFO, "topology": "1x2-cpu"}
    rows = synthetic_rows() + collective_rows(noise=0.05, seed=3)
    fit = fit_profile("synthetic", rows, info)
    link = fit.profile.links["loopback"]
    assert fit.profile.call_latency_s == pytest.approx(CALL_S, rel=0.1)
    assert link.latency_s == pytest.approx(LINK_LATENCY_S, rel=0.2)
    assert link.bandwidth_bytes_per_s == pytest.approx(LINK_BPS, rel=0.05)
    assert fit.profile.message_s == pytest.approx(MESSAGE_S, rel=0.2)
    assert fit.profile.p2p_call_latency_s == pytest.approx(P2P_CALL_S, rel=0.2)
    assert fit.profile.op_s_per_byte["all_gather"] == pytest.approx(0.3e-9, rel=0.1)
    assert fit.profile.op_call_s["all_gather"] == pytest.approx(60e-6, rel=0.3)
    cal = Calibration("synthetic", fit.profile, rows, fit.residuals, provenance=info)
    save_profile(cal, tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json") == fit.profile  # links and call latency kept


def test_collectives_are_reported_in_nccl_tests_terms(tmp_path, capsys):
    # nccl-tests doc/PERFORMANCE.md: algbw = S / t; busbw = algbw x 2(n-1)/n for all_reduce,
    # x (n-1)/n for all_gather and reduce_scatter, x 1 for broadcast. 1 MiB in 1 ms on 4 ranks:
    t, size = 1e-3, float(MIB)
    expected = {
        "all_reduce": 1.048576 * 1.5,
        "all_gather_into_tensor": 1.048576 * 0.75,
        "broadcast": 1.048576,
    }
    rows = list(synthetic_rows())
    for op in expected:
        rows.append(
            Measurement(
                Kind.COLLECTIVE, op, "fp32", (t, t, t), size_bytes=size, group="intra", ranks=4
            )
        )
    cal = Calibration("bw", calibration().profile, tuple(rows), provenance=INFO)
    save_profile(cal, tmp_path / "bw.json")
    lines = (tmp_path / "bw.csv").read_text().splitlines()
    head = lines[0].split(",")
    for line in lines[1:]:
        cells = dict(zip(head, line.split(","), strict=True))
        if cells["kind"] != "collective":
            assert cells["busbw_GBps"] == ""
            continue
        assert float(cells["algbw_GBps"]) == pytest.approx(1.048576, rel=1e-5)  # 6 digits
        assert float(cells["busbw_GBps"]) == pytest.approx(expected[cells["op"]], rel=1e-5)
    # the view: one table per op and group, in the same terms
    rows2 = synthetic_rows() + collective_rows()
    info = {**INFO, "topology": "1x2-cpu"}
    fit = fit_profile("two", rows2, info)
    two = Calibration("two", fit.profile, rows2, fit.residuals, provenance=info)
    save_profile(two, tmp_path / "t.json")
    capsys.readouterr()
    assert main(["profile", str(tmp_path / "t.json"), "--collectives"]) == 0
    out = capsys.readouterr().out
    assert "busbw GB/s" in out
    assert out.count("(intra, n=2, loopback") == 5  # one table per op
    big = gloo_two_ranks_s("broadcast", 256 * MIB)
    assert f"{256 * MIB / big / 1e9:.3f}" in out  # broadcast's busbw is its algbw


@pytest.mark.parametrize("group", ["intra", "inter", "full"])
def test_a_row_replays_every_group_the_worker_measured_at_once(group):
    """The worker calls each microbenchmark on every rank at once, each rank in its own group
    of the kind (`calibrate.worker.groups`): the replay runs all of them, rank 0's first."""
    pytest.importorskip("torch")
    from zsim.calibrate.worker import groups

    topo = presets.topology("2x2-cpu-1gbit")
    measured = dict(groups(topo.world_size, topo.gpus_per_node))[group]
    row = _row("all_reduce", group, len(measured[0]), MIB)
    assert [list(c.group) for c in calls_of(topo, row)] == measured


def test_inter_groups_of_a_node_share_its_link_as_measured():
    """On 2 nodes x 2 ranks the two one-rank-per-node groups all-gather at once: each node's
    veth carries the other group's half of the buffer too, (S / 2) / line rate more than one
    group alone (the rest of the call, latencies and local copies, is the same)."""
    topo = presets.topology("2x2-cpu-1gbit")
    size = 64 * MIB
    row = _row("all_gather_into_tensor", "inter", 2, size)
    calls = calls_of(topo, row)
    assert len(calls) == 2
    alone = max(simulate_s(topo, calls[:1]))
    line_rate = 1e9 / 8  # the preset's 1 Gbit/s veth
    assert row_time_s(topo, row) - alone == pytest.approx(size / 2 / line_rate, rel=1e-6)


def _row(op: str, group: str, ranks: int, size: int) -> Measurement:
    return Measurement(
        Kind.COLLECTIVE, op, "fp32", (1.0,), size_bytes=float(size), group=group, ranks=ranks
    )


def _nnls_by_enumeration(a, y):
    """The non-negative least-squares optimum by definition: the best unconstrained solution
    over every set of free variables whose values are all non-negative."""
    import itertools

    best, best_err = np.zeros(a.shape[1]), float(y @ y)
    for k in range(1, a.shape[1] + 1):
        for free in itertools.combinations(range(a.shape[1]), k):
            x, *_ = np.linalg.lstsq(a[:, free], y, rcond=None)
            err = float(np.sum((a[:, free] @ x - y) ** 2))
            if np.all(x >= 0) and err < best_err:
                best, best_err = np.zeros(a.shape[1]), err
                best[list(free)] = x
    return best


@pytest.mark.parametrize("seed", range(20))
def test_nonnegative_least_squares_finds_the_optimum(seed):
    from zsim.calibrate.links import nonnegative_lstsq

    rng = np.random.default_rng(seed)
    a = rng.random((12, 6)) * np.array([1, 1e-9, 1e3, 1, 1e6, 1])  # unknowns of unlike units
    y = a @ rng.normal(size=6) + 0.1 * rng.normal(size=12)  # some of them negative
    x = nonnegative_lstsq(a, y)
    expected = _nnls_by_enumeration(a, y)
    assert np.all(x >= 0)
    assert np.sum((a @ x - y) ** 2) == pytest.approx(np.sum((a @ expected - y) ** 2), rel=1e-9)
