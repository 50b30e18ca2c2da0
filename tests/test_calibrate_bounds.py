"""The link fit inside physics: latency floors from a ping-pong, bandwidth ceilings from the line
rate or the memcpy rate, every committed profile inside its own bounds, and every fit scored on
rows it did not see (k-fold over sizes)."""

import json
from pathlib import Path

import pytest

from tests.calibrate_synthetic import (
    COPY_RATE,
    INFO,
    LINK_BPS,
    LINK_LATENCY_S,
    collective_rows,
    synthetic_rows,
)
from zsim.calibrate import holdout
from zsim.calibrate.bounds import link_bounds
from zsim.calibrate.fit import fit_profile
from zsim.calibrate.measurement import Kind, Measurement
from zsim.calibrate.profile import load_calibration
from zsim.cluster.fabric import LinkClass
from zsim.inputs import presets

ROOT = Path(__file__).resolve().parents[1]
PROFILES = sorted((ROOT / "calibration").glob("cpu-*.json"))


def pingpong(group: str, *one_way_s: float) -> Measurement:
    return Measurement(Kind.PINGPONG, "tcp", "fp32", one_way_s, 1.0, group=group, ranks=2)


def test_floor_is_the_fastest_trip_shared_by_the_route_links():
    # topologies' cpu.yaml: a message between two ranks of one host crosses two loopback
    # links (rank -> host stack -> rank); between two namespaces, two at each end (the rank's
    # and its host's stack to the NIC) and the two veth hops (node -> bridge -> node)
    topo = presets.topology("2x2-cpu-1gbit")
    rows = [pingpong("intra", 40e-6, 30e-6, 35e-6), pingpong("inter", 150e-6, 130e-6)]
    bounds = link_bounds(topo, rows)
    assert bounds.latency_floor(LinkClass.LOOPBACK) == pytest.approx(15e-6)
    assert bounds.latency_floor(LinkClass.VETH) == pytest.approx((130e-6 - 4 * 15e-6) / 2)


def test_ceilings_are_the_line_rate_and_the_memcpy_rate():
    topo = presets.topology("2x2-cpu-100mbit")
    bounds = link_bounds(topo, [])
    assert bounds.bandwidth_ceiling(LinkClass.VETH) == pytest.approx(100e6 / 8)
    assert bounds.bandwidth_ceiling(LinkClass.LOOPBACK) == topo.local_work.copy_bytes_per_s
    assert bounds.latency_floor(LinkClass.VETH) == 0.0  # nothing measured it


def test_a_binding_floor_and_ceiling_hold_and_the_rest_is_refitted():
    """Rows made by the true parameters, a ping-pong above the true latency: the fitted
    latency sits on the floor. Without it, the truth is recovered (test_calibrate_links)."""
    info = {**INFO, "topology": "1x2-cpu"}
    floor = 2 * LINK_LATENCY_S
    rows = synthetic_rows() + collective_rows() + (pingpong("intra", 2 * floor),)
    link = fit_profile("synthetic", rows, info).profile.links["loopback"]
    assert link.latency_s == pytest.approx(floor, rel=1e-9)
    assert link.bandwidth_bytes_per_s <= COPY_RATE
    assert link.bandwidth_bytes_per_s == pytest.approx(LINK_BPS, rel=0.2)


def test_a_binding_ceiling_holds():
    """Host copies measured 6x slower: the ranks' memcpy rate (1.17 GB/s) is now below the
    links' true 1.5 GB/s, and the fitted loopback bandwidth stops at it."""
    info = {**INFO, "topology": "1x2-cpu"}
    slow = [
        Measurement(Kind.HOST_COPY, r.op, r.dtype, tuple(6 * s for s in r.samples_s), r.size_bytes)
        if r.kind is Kind.HOST_COPY
        else r
        for r in synthetic_rows()
    ]
    ceiling = COPY_RATE / 6
    assert ceiling < LINK_BPS
    fit = fit_profile("synthetic", tuple(slow) + collective_rows(), info)
    assert fit.profile.links["loopback"].bandwidth_bytes_per_s == pytest.approx(ceiling)


# what each committed profile's cluster is physically, written here from how it was built:
# a loopback route crosses two loopback links, a route between namespaces four loopback links
# and two veth hops (topologies' cpu.yaml); tc shapes each veth to 1 Gbit/s
LINE_RATE_BPS = {"veth": 1e9 / 8}
ROUTE_LINKS = {"intra": {"loopback": 2}, "inter": {"loopback": 4, "veth": 2}}


@pytest.mark.parametrize("path", PROFILES, ids=[p.stem for p in PROFILES])
def test_committed_profiles_are_inside_their_physical_bounds(path):
    """Each fitted link against the facts measured by its own calibration, computed here from
    the raw rows: no latency below the fastest ping-pong's share of its route, no veth above
    the tc rate, no loopback above the ranks' memcpy rate (the fastest host-copy row)."""
    cal = load_calibration(path)
    links = cal.profile.links
    trips = {r.group: min(r.samples_s) for r in cal.measurements if r.kind is Kind.PINGPONG}
    assert "intra" in trips, "the calibration measured no ping-pong: the latency floor is unknown"
    loopback_floor = trips["intra"] / ROUTE_LINKS["intra"]["loopback"]
    assert links["loopback"].latency_s >= loopback_floor * (1 - 1e-9)
    memcpy = max(r.size_bytes / r.time_s for r in cal.measurements if r.kind is Kind.HOST_COPY)
    assert links["loopback"].bandwidth_bytes_per_s <= memcpy * (1 + 1e-9)
    if "veth" in links:
        assert links["veth"].bandwidth_bytes_per_s <= LINE_RATE_BPS["veth"] * (1 + 1e-9)
        veth_floor = (trips["inter"] - 4 * loopback_floor) / ROUTE_LINKS["inter"]["veth"]
        # on this host the inter-namespace trip (10.1 us one way) is shorter than the four
        # loopback floors its route crosses (4 x 4.0 us): the floor is 0, not a measured latency
        assert links["veth"].latency_s >= veth_floor * (1 - 1e-9)


def test_folds_hold_out_each_size_once_and_keep_single_sizes():
    rows = synthetic_rows() + collective_rows()
    folds = holdout.folds(rows)
    held = [i for f in folds for i in f]
    assert len(held) == len(set(held))
    for kind in (Kind.GEMM, Kind.COLLECTIVE, Kind.MEMORY):
        sizes = {holdout.size_of(r) for r in rows if r.kind is kind}
        assert len(sizes) >= 2
        for f in folds:
            in_fold = {holdout.size_of(rows[i]) for i in f if rows[i].kind is kind}
            assert in_fold < sizes  # never every size of a kind
    layer_rows = {i for i, r in enumerate(rows) if r.kind is Kind.LAYER_FORWARD}
    assert layer_rows.isdisjoint(held)


def test_a_model_of_the_truth_predicts_rows_it_did_not_see():
    """GEMM and kernel rows made by t = overhead + work / rate: a fit without a fold predicts
    the fold exactly, inside and outside its range."""
    rows = synthetic_rows()
    held = holdout.held_out_predictions("synthetic", rows, INFO)
    checked = [i for i in held if rows[i].kind in (Kind.GEMM, Kind.MEMORY, Kind.OPTIMIZER)]
    assert len(checked) >= 8
    for i in checked:
        assert held[i] == pytest.approx(rows[i].time_s, rel=1e-6), rows[i].label


def test_committed_profiles_report_held_out_residuals():
    for path in PROFILES:
        data = json.loads(path.read_text())
        res = data["fit"]["residuals"]
        fitted_groups = {
            (r["kind"], r["op"]) for r in res if r["fitted"] and r["kind"] in ("gemm", "collective")
        }
        held = {(r["kind"], r["op"]) for r in res if r.get("held_out")}
        assert fitted_groups <= held, path.name
