"""Collectives simulated flow by flow against closed forms, contention, and fabric limits.

Expected times are written out here from the alpha-beta forms (Thakur, Rabenseifner & Gropp
2005, "Optimization of collective communication operations in MPICH"; Patarasuk & Yuan 2009
for the ring all-reduce), NCCL's pipeline unit (512 KiB for broadcast/reduce, see
zsim.network), nccl-tests' bus-bandwidth factors (doc/PERFORMANCE.md) and the spec-sheet
bandwidths of the presets, never from the code under test. The tests marked `consistency` are
consistency checks: they compare the flow simulation with the closed form (both zsim's), or with
itself (step by step against coalesced, calls run together against alone).
"""

import pytest

from tests.helpers_network import two_leaves, uniform_star
from zsim.errors import InputError
from zsim.inputs import presets
from zsim.network.collective import (
    Algorithm,
    CollectiveCall,
    CollectiveOp,
    bandwidths,
    bus_bandwidth_factor,
)
from zsim.network.communicator import simulate_s
from zsim.network.gloo import gloo_allreduce_segments
from zsim.network.nccl import btree_parent, dtree_parents, nccl_rings
from zsim.network.plans import estimate_s, plan

Op = CollectiveOp
ALPHA = 2e-6  # one step: two links of 1 us
BW = 25e9  # bytes/s per rank and direction
CHUNK = 512 * 1024  # NCCL's broadcast/reduce pipeline unit


def expected_ring_s(op, n, size):
    """Textbook forms on a uniform network (per-rank bandwidth BW, step latency ALPHA)."""
    if op in (Op.ALL_GATHER, Op.REDUCE_SCATTER):
        return (n - 1) * (ALPHA + size / (n * BW))
    if op is Op.ALL_REDUCE:
        return 2 * (n - 1) * (ALPHA + size / (n * BW))
    if op in (Op.BROADCAST, Op.REDUCE):  # a pipelined chain: the first chunk crosses n-1 hops
        return (n - 1) * ALPHA + (n - 2) * min(CHUNK, size) / BW + size / BW
    if op is Op.ALL_TO_ALL:  # n-1 flows share each rank's link
        return ALPHA + (n - 1) * size / (n * BW)
    return ALPHA + size / BW  # send_recv


@pytest.mark.parametrize("n", range(2, 65))
@pytest.mark.parametrize("op", list(CollectiveOp))
def test_uniform_ring_equals_closed_form(op, n):
    topo = uniform_star(n, BW / 1e9, ALPHA * 1e6)
    group = (0, n - 1) if op is Op.SEND_RECV else tuple(range(n))
    m = len(group)
    for size in (64 * 1024, 256 * 1024 * 1024):
        [sim] = simulate_s(topo, [CollectiveCall(op, size, group, Algorithm.RING)])
        assert sim == pytest.approx(expected_ring_s(op, m, size), rel=0.01)


@pytest.mark.consistency
@pytest.mark.parametrize("n", [2, 5, 16])
@pytest.mark.parametrize("op", [Op.ALL_GATHER, Op.REDUCE_SCATTER, Op.ALL_REDUCE])
def test_step_by_step_equals_coalesced_on_a_uniform_ring(op, n):
    topo = uniform_star(n, BW / 1e9, ALPHA * 1e6)
    call = CollectiveCall(op, 32e6, tuple(range(n)))
    [exact] = simulate_s(topo, [call], exact_steps=True)
    [coalesced] = simulate_s(topo, [call])
    assert exact == pytest.approx(coalesced, rel=1e-9)
    assert exact == pytest.approx(expected_ring_s(op, n, 32e6), rel=0.01)


@pytest.mark.parametrize("n", [2, 3, 8])
def test_gloo_allreduce_on_a_uniform_ring(n):
    # gloo/allreduce.cc: k segments of S/(n k) per ring step, two in flight, so a step of k
    # segments exposes one latency: the textbook ring 2(n-1)(alpha + S/(n B)) (no local work
    # on this star)
    topo = uniform_star(n, BW / 1e9, ALPHA * 1e6, backend="gloo")
    size = 100e6
    [sim] = simulate_s(topo, [CollectiveCall(Op.ALL_REDUCE, size, tuple(range(n)))])
    assert sim == pytest.approx(2 * (n - 1) * (ALPHA + size / (n * BW)), rel=0.01)
    # ProcessGroupGloo's reduce_scatter_tensor is an all_reduce of the whole input
    [rs] = simulate_s(topo, [CollectiveCall(Op.REDUCE_SCATTER, size, tuple(range(n)))])
    assert rs == pytest.approx(sim, rel=1e-9)


def test_gloo_segments_example():
    # S = 100 MB, n = 8: numSegments = 96, k = 12 (gloo's ring, worked by hand)
    assert gloo_allreduce_segments(100e6, 8) == 12
    assert gloo_allreduce_segments(1e3, 8) == 2


def test_gloo_broadcast_is_a_binomial_tree_of_whole_messages():
    # n = 4: root -> 1 and root -> 2 start together (sharing the root's link), 1 -> 3 after
    topo = uniform_star(4, BW / 1e9, ALPHA * 1e6, backend="gloo")
    size = 1e8
    [sim] = simulate_s(topo, [CollectiveCall(Op.BROADCAST, size, (0, 1, 2, 3))])
    first_two = ALPHA + 2 * size / BW  # both at BW/2
    assert sim == pytest.approx(first_two + ALPHA + size / BW, rel=1e-6)


# ---- contention -----------------------------------------------------------------------------


def test_two_collectives_sharing_a_nic():
    # 2x4-ethernet, tp=4: DP groups (0, 4) and (1, 5) both cross the single 100 GbE NIC of
    # each node. Alone, each GPU sends S/2 to its peer at 12.5 GB/s; together, the two
    # flows in each direction share the NIC at 6.25 GB/s: the slowdown is (S/2) / 12.5 GB/s.
    topo = presets.topology("2x4-ethernet")
    size = 1e9
    a = CollectiveCall(Op.ALL_GATHER, size, (0, 4))
    b = CollectiveCall(Op.ALL_GATHER, size, (1, 5))
    [alone] = simulate_s(topo, [a])
    together = simulate_s(topo, [a, b])
    nic = 100e9 / 8
    assert together[0] == pytest.approx(together[1], rel=1e-9)
    assert together[0] - alone == pytest.approx((size / 2) / nic, rel=1e-6)
    assert alone == pytest.approx((size / 2) / nic, rel=0.001)


@pytest.mark.consistency
def test_tp_traffic_inside_nodes_does_not_slow_dp_across_them():
    # 2x8-dgx-h100: TP all-reduces ride NVLink, the DP all-gather across nodes rides the NICs
    # and PCIe; they share no link, so neither slows down.
    topo = presets.topology("2x8-dgx-h100")
    dp = CollectiveCall(Op.ALL_GATHER, 1e9, (0, 8))
    tp = CollectiveCall(Op.ALL_REDUCE, 1e9, tuple(range(1, 8)))
    [dp_alone] = simulate_s(topo, [dp])
    [tp_alone] = simulate_s(topo, [tp])
    both = simulate_s(topo, [dp, tp])
    assert both == pytest.approx([dp_alone, tp_alone], rel=1e-9)


def test_oversubscription_slows_inter_node_collectives():
    # ring 0 -> 1 -> 2 -> 3 -> 0 over two leaves: hops 1 -> 2 and 3 -> 0 cross the spine.
    # 1:1: the leaf uplink (2 x 12.5 GB/s) never limits; 1:4 it is 6.25 GB/s, half a NIC,
    # so the data term of the all-gather doubles: (n-1) S / (n B) more.
    size, n, nic = 1e9, 4, 12.5e9
    call = CollectiveCall(Op.ALL_GATHER, size, (0, 1, 2, 3))
    [full] = simulate_s(two_leaves(1.0), [call])
    [over] = simulate_s(two_leaves(4.0), [call])
    assert full == pytest.approx((n - 1) * size / (n * nic), rel=1e-6)
    assert over - full == pytest.approx((n - 1) * size / (n * nic), rel=1e-6)


# ---- fabrics bound what they should -------------------------------------------------------------


def test_ethernet_bounds_dp_all_gather_and_nvlink_does_not():
    # busbw is the bottleneck link: 100 GbE = 12.5 GB/s across 2x4 nodes; on one NVSwitch
    # node there are no NICs in the way: its 12 NVLink3 at NCCL's 20 GB/s each (topo.h; the
    # line rate is 300 GB/s each way). The ratio of the times follows the two: 240 / 12.5.
    # 4 GiB, so that NCCL's Simple latencies (tens of us) stay under 1 % of the NVLink time.
    size = 2**32
    eth = presets.topology("2x4-ethernet")
    nvl = presets.topology("1x8-nvlink")
    call = CollectiveCall(Op.ALL_GATHER, size, tuple(range(8)))
    [t_eth] = simulate_s(eth, [call])
    [t_nvl] = simulate_s(nvl, [call])
    assert bandwidths(Op.ALL_GATHER, 8, size, t_eth)[1] == pytest.approx(12.5e9, rel=0.01)
    assert bandwidths(Op.ALL_GATHER, 8, size, t_nvl)[1] == pytest.approx(240e9, rel=0.01)
    assert t_eth / t_nvl == pytest.approx(240 / 12.5, rel=0.01)
    ethernet = [e for e, c in enumerate(nvl.link_class) if c == "ethernet"]
    flows = plan(nvl, call).phases[0].flows
    links = {int(x) for f in flows for x in nvl.route(f.src, f.dst).links}
    assert flows
    assert links.isdisjoint(ethernet)  # no flow touches an Ethernet link


def test_multi_node_ring_uses_every_rail():
    # DGX H100: 8 x 400 Gb/s NICs per node; a 16-GPU all-gather's ring channels each cross
    # the node boundary on their own rail, so busbw reaches 8 x 50 GB/s (NVLink, 450 GB/s,
    # is not the limit)
    topo = presets.topology("2x8-dgx-h100")
    rings = nccl_rings(topo, range(16))
    assert len(rings) == 8
    for ring in rings.tolist():
        hops = [(a, b) for a, b in zip(ring, ring[1:] + ring[:1], strict=True)]
        crossing = [(a, b) for a, b in hops if topo.node_of(a) != topo.node_of(b)]
        assert len(crossing) == 2
        assert all(topo.local_of(a) == topo.local_of(b) for a, b in crossing)  # same rail
    [t] = simulate_s(topo, [CollectiveCall(Op.ALL_GATHER, 2**32, tuple(range(16)))])
    assert bandwidths(Op.ALL_GATHER, 16, 2**32, t)[1] == pytest.approx(400e9, rel=0.02)


# ---- trees, choices, conventions ------------------------------------------------------------


def test_btree_matches_nccl_illustration():
    # src/graph/trees.cc, 14 ranks: 0 - 8; 8 - 4, 12; 4 - 2, 6; 12 - 10, 13; 2 - 1, 3; ...
    parents = {8: 0, 4: 8, 12: 8, 2: 4, 6: 4, 10: 12, 13: 12, 1: 2, 3: 2, 5: 6, 7: 6, 9: 10, 11: 10}
    assert btree_parent(14, 0) == -1
    assert {r: btree_parent(14, r) for r in range(1, 14)} == parents


def test_dtree_mirror_and_shift_match_nccl_illustration():
    # 12 ranks (even): the second tree is the mirror, rooted at 11 with child 3
    _, mirror = dtree_parents(12)
    expected = {3: 11, 1: 3, 7: 3, 0: 1, 2: 1, 5: 7, 9: 7, 4: 5, 6: 5, 8: 9, 10: 9, 11: -1}
    assert {r: mirror[r] for r in range(12)} == expected
    # 13 ranks (odd): the second tree is the first shifted by one (root 1, child 9)
    first, shifted = dtree_parents(13)
    assert shifted[1] == -1
    assert shifted[9] == 1
    assert all(shifted[(r + 1) % 13] == (first[r] + 1) % 13 for r in range(13) if first[r] >= 0)


def test_auto_picks_tree_for_small_multi_node_all_reduce_and_ring_for_large():
    topo = presets.topology("16x8-dgx-a100")
    small = plan(topo, CollectiveCall(Op.ALL_REDUCE, 64 * 1024, tuple(range(128))))
    large = plan(topo, CollectiveCall(Op.ALL_REDUCE, 2**30, tuple(range(128))))
    assert small.algorithm == "nccl-tree"
    assert large.algorithm == "nccl-ring"


@pytest.mark.consistency
@pytest.mark.parametrize(
    ("op", "algorithm"),
    [
        (Op.ALL_REDUCE, Algorithm.TREE),
        (Op.ALL_REDUCE, Algorithm.HIERARCHICAL),
        (Op.ALL_GATHER, Algorithm.HIERARCHICAL),
        (Op.REDUCE_SCATTER, Algorithm.HIERARCHICAL),
        (Op.BROADCAST, Algorithm.HIERARCHICAL),
        (Op.REDUCE, Algorithm.HIERARCHICAL),
    ],
)
def test_every_algorithm_runs_and_its_closed_form_is_close(op, algorithm):
    """Consistency check: the flow simulation is within 5% of the closed form."""
    topo = presets.topology("4x8-roce")
    call = CollectiveCall(op, 2**28, tuple(range(32)), algorithm)
    [sim] = simulate_s(topo, [call])
    assert sim == pytest.approx(estimate_s(topo, call), rel=0.05)


def test_hierarchical_all_reduce_stages():
    # 2x4-ethernet: reduce-scatter inside each node over PCIe Gen4 (31.5 GB/s, 3 steps of
    # S/4), all-reduce of S/4 on each of the 4 rails across nodes (2 steps of S/8, the 4 rails
    # sharing one 12.5 GB/s NIC), all-gather inside the nodes again. The flat ring is NIC-bound
    # at 2 (7/8) S / 12.5 GB/s.
    topo = presets.topology("2x4-ethernet")
    size, pcie, nic = 2**30, 31.5e9, 12.5e9
    ring = CollectiveCall(Op.ALL_REDUCE, size, tuple(range(8)), Algorithm.RING)
    hier = CollectiveCall(Op.ALL_REDUCE, size, tuple(range(8)), Algorithm.HIERARCHICAL)
    [t_ring], [t_hier] = simulate_s(topo, [ring]), simulate_s(topo, [hier])
    assert t_ring == pytest.approx(2 * 7 / 8 * size / nic, rel=0.01)
    intra = 3 * (size / 4) / pcie
    across = 2 * (size / 8) / (nic / 4)
    assert t_hier == pytest.approx(intra + across + intra, rel=0.01)


def test_bus_bandwidth_factors_are_nccl_tests():
    assert bus_bandwidth_factor(Op.ALL_REDUCE, 8) == 2 * 7 / 8
    assert bus_bandwidth_factor(Op.ALL_GATHER, 8) == 7 / 8
    assert bus_bandwidth_factor(Op.REDUCE_SCATTER, 4) == 3 / 4
    for op in (Op.BROADCAST, Op.REDUCE, Op.SEND_RECV):
        assert bus_bandwidth_factor(op, 8) == 1
    assert bandwidths(Op.ALL_REDUCE, 4, 1e9, 0.5) == (2e9, 2e9 * 1.5)


def test_unsupported_algorithms_are_refused():
    cpu = presets.topology("2x2-cpu")
    with pytest.raises(InputError, match="gloo"):
        plan(cpu, CollectiveCall(Op.ALL_REDUCE, 1e6, (0, 1, 2, 3), Algorithm.TREE))
    gpu = presets.topology("2x4-ib")
    with pytest.raises(InputError, match="all_reduce only"):
        plan(gpu, CollectiveCall(Op.ALL_GATHER, 1e6, tuple(range(8)), Algorithm.TREE))
    with pytest.raises(InputError, match="at most 8 GPUs"):
        plan(gpu, CollectiveCall(Op.ALL_GATHER, 1e6, tuple(range(9))))
