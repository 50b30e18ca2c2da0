"""Half-duplex links (a CPU rank's loopback TCP stack): a rank's loopback TCP stack runs on its
one core, so what it sends and what it receives share one capacity B: a ring step, where every
rank sends to one neighbour while receiving from the other, moves at B/2 per flow; a lone flow
at B. Expected times are derived here, never from the code under test.
"""

import pytest

from tests.helpers_network import cluster, uniform_star
from zsim.cluster.fabric import LinkClass
from zsim.errors import InputError
from zsim.inputs import presets
from zsim.network.collective import CollectiveCall, CollectiveOp
from zsim.network.communicator import simulate_s
from zsim.network.plans import estimate_s

Op = CollectiveOp
B = 4e9  # one rank's stack, both directions together
ALPHA = 20e-6  # one step: two links of 10 us


def star(n):
    return uniform_star(n, B / 1e9, ALPHA * 1e6, duplex="half")


def both(topo, call):
    """(flow simulation, closed form) of one call."""
    [sim] = simulate_s(topo, [call])
    return sim, estimate_s(topo, call)


@pytest.mark.parametrize("n", [2, 3, 8])
def test_half_duplex_ring_all_reduce(n):
    # 2(n-1) steps of S/n; each rank's link carries its send and its receive: B/2 each
    size = 64e6
    expected = 2 * (n - 1) * (ALPHA + (size / n) / (B / 2))
    sim, closed = both(star(n), CollectiveCall(Op.ALL_REDUCE, size, tuple(range(n))))
    assert sim == pytest.approx(expected, rel=1e-6)
    assert closed == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("n", [2, 5])
def test_half_duplex_ring_all_gather(n):
    size = 64e6  # n-1 steps of S/n at B/2
    expected = (n - 1) * (ALPHA + (size / n) / (B / 2))
    sim, closed = both(star(n), CollectiveCall(Op.ALL_GATHER, size, tuple(range(n))))
    assert sim == pytest.approx(expected, rel=1e-6)
    assert closed == pytest.approx(expected, rel=1e-6)


def test_a_lone_flow_has_the_whole_stack_and_opposite_flows_share_it():
    topo, size = star(4), 1e8
    alone = CollectiveCall(Op.SEND_RECV, size, (0, 1))
    assert simulate_s(topo, [alone]) == pytest.approx([ALPHA + size / B], rel=1e-9)
    # 0 -> 1 and 1 -> 0 at once: both cross rank 0's and rank 1's stacks
    back = CollectiveCall(Op.SEND_RECV, size, (1, 0))
    assert simulate_s(topo, [alone, back]) == pytest.approx([ALPHA + size / (B / 2)] * 2)
    # 0 -> 1 and 2 -> 3: no stack in common
    other = CollectiveCall(Op.SEND_RECV, size, (2, 3))
    assert simulate_s(topo, [alone, other]) == pytest.approx([ALPHA + size / B] * 2)
    # the broadcast of two ranks is one message, one way (a chain of one hop)
    sim, closed = both(topo, CollectiveCall(Op.BROADCAST, size, (0, 1)))
    assert sim == pytest.approx(ALPHA + size / B, rel=1e-9)
    assert closed == pytest.approx(ALPHA + size / B, rel=1e-9)


def test_only_the_cpu_ranks_links_are_half_duplex():
    for name in ("1x8-dgx-h100", "2x4-ethernet", "2x4-ib", "2x8-roce"):
        assert not presets.topology(name).half_duplex.any(), name
    cpu = presets.topology("2x2-cpu")
    for (u, v), cls, half in zip(cpu.edges, cpu.link_class, cpu.half_duplex, strict=True):
        rank_link = "gpu" in u or "gpu" in v
        assert half == rank_link, (u, v)  # host <-> veth and the veth itself: full duplex
        assert cls is (LinkClass.LOOPBACK if rank_link or "host" in u + v else LinkClass.VETH)


def test_duplex_is_full_or_half():
    data = {
        "gpu": None,
        "gpus_per_node": [2],
        "backend": {"name": "gloo"},
        "loopback": {"bandwidth_GBps": 1, "duplex": "simplex"},
        "nics": {"per_node": 1, "rate_Gbps": 1, "link_class": "veth", "attach": "host"},
        "network": {"leaf_ports": 8},
    }
    with pytest.raises(InputError, match="full or half"):
        cluster(data, 1, 2)
