"""Sends timed alone (zsim.network.alone): a transfer nothing shares a capacity with moves at its
lone rate; the moment another flow comes onto one of its capacities it moves as a flow with the
bytes it has left. Expected times are max-min fairness worked out by hand (as in
test_network.py), on a star of links of B bytes/s with no latency unless said."""

import pytest
import simpy

from tests.helpers_network import uniform_star
from zsim.network.flows import FlowNetwork

B = 10e9


def _ends(topo, lone, flows, delay_s=0.0, copies=()):
    """End times: `lone` (src, dst, bytes) timed alone after `delay_s` with its `copies`
    (pairs) beside it, and `flows` (start, src, dst, bytes) started as flows."""
    env = simpy.Environment()
    net = FlowNetwork(env, topo)
    ends = {}

    def first():
        yield net.transfer_alone(*lone, delay_s, alongside=copies)
        ends["lone"] = env.now

    def later(i, at, src, dst, nbytes):
        yield env.timeout(at)
        yield net.transfer(src, dst, nbytes)
        ends[i] = env.now

    env.process(first())
    for i, f in enumerate(flows):
        env.process(later(i, *f))
    env.run()
    return ends, net


def test_a_lone_send_pays_the_call_and_route_latency_then_moves_at_the_link_rate():
    topo = uniform_star(4, B / 1e9, 4.0)  # a rank-to-rank step: two links of 2 us
    ends, net = _ends(topo, (0, 1, 1e9), [], delay_s=5e-6)
    assert ends["lone"] == pytest.approx(5e-6 + 4e-6 + 1e9 / B, rel=1e-12)
    assert net.booked.per_gpu(source=True)[0] == 1e9  # booked as any flow
    assert net.recomputations == 0  # it never needed the network's solver


def test_a_flow_that_comes_onto_its_link_slows_it_from_then_on():
    # alone at B for t0 (moves B t0), then both share the link at B/2 (test_network's case)
    topo = uniform_star(4, B / 1e9, 0.0)
    s, t0 = 1e9, 0.02
    ends, _ = _ends(topo, (0, 1, s), [(t0, 0, 2, s)])
    first = t0 + 2 * (s - B * t0) / B
    second = first + (s - (first - t0) * B / 2) / B
    assert ends["lone"] == pytest.approx(first, rel=1e-9)
    assert ends[0] == pytest.approx(second, rel=1e-9)


def test_a_flow_arriving_before_its_data_starts_shares_the_link_from_the_start():
    # the send's data starts at 10 ms; a flow on its link from 1 ms to 10 + 2 x 20 ms: they
    # share from 10 ms, each at B/2, until the send's 1e8 bytes are through
    topo = uniform_star(4, B / 1e9, 0.0)
    ends, _ = _ends(topo, (0, 1, 1e8), [(1e-3, 0, 2, 1e9)], delay_s=10e-3)
    moved_alone = B * (10e-3 - 1e-3)  # the flow's bytes before the send's data starts
    assert ends["lone"] == pytest.approx(10e-3 + 2 * 1e8 / B, rel=1e-9)
    assert ends[0] == pytest.approx(ends["lone"] + (1e9 - moved_alone - 1e8) / B, rel=1e-9)


def test_two_sends_on_one_link_are_both_flows():
    topo = uniform_star(4, B / 1e9, 0.0)
    env = simpy.Environment()
    net = FlowNetwork(env, topo)
    a = net.transfer_alone(0, 1, 1e8, 0.0)
    b = net.transfer_alone(0, 2, 3e8, 0.0)
    env.run()
    assert a.triggered
    assert b.triggered
    assert env.now == pytest.approx((1e8 + 3e8) / B, rel=1e-9)  # B/2 each, then B alone


def test_disjoint_sends_stay_alone():
    topo = uniform_star(4, B / 1e9, 0.0)
    env = simpy.Environment()
    net = FlowNetwork(env, topo)
    net.transfer_alone(0, 1, 1e9, 0.0)
    net.transfer_alone(2, 3, 1e9, 0.0)
    env.run()
    assert env.now == pytest.approx(1e9 / B, rel=1e-12)
    assert net.recomputations == 0


def test_a_send_whose_copies_share_its_link_moves_with_them_at_the_shared_rate():
    # 0 -> 1 and its copy 2 -> 1 share the link into 1: B/2 each, the same for both
    topo = uniform_star(4, B / 1e9, 0.0)
    ends, net = _ends(topo, (0, 1, 1e9), [], copies=((2, 1),))
    assert ends["lone"] == pytest.approx(2 * 1e9 / B, rel=1e-12)
    assert net.recomputations == 0  # timed alone, copies and all
    assert net.booked.per_gpu(source=True)[2] == 1e9  # the copy's bytes are booked too
    assert net.flows_finished == 2


def test_copies_at_another_rate_are_flows():
    # out of 0: the send, copies 0 -> 2 and 0 -> 3 (B/3 each); 4 -> 3 takes the rest of the
    # link into 3 (2B/3): not one rate, so they run as flows; the send ends at 3 s/B
    topo = uniform_star(5, B / 1e9, 0.0)
    ends, net = _ends(topo, (0, 1, 1e9), [], copies=((0, 2), (0, 3), (4, 3)))
    assert ends["lone"] == pytest.approx(3 * 1e9 / B, rel=1e-9)
    assert net.recomputations > 0


def test_a_flow_onto_a_copys_link_makes_flows_of_the_send_and_its_copies():
    # the send 0 -> 1 and its copy 2 -> 3 move alone at B; at t0 a flow 2 -> 4 shares the
    # copy's link out of 2: the copy and the flow go at B/2 (the send's links stay its own)
    topo = uniform_star(5, B / 1e9, 0.0)
    s, t0 = 1e9, 0.02
    ends, net = _ends(topo, (0, 1, s), [(t0, 2, 4, s)], copies=((2, 3),))
    copy_ends = t0 + 2 * (s - B * t0) / B
    assert ends["lone"] == pytest.approx(s / B, rel=1e-9)
    assert ends[0] == pytest.approx(copy_ends + (s - (copy_ends - t0) * B / 2) / B, rel=1e-9)
    assert net.flows_finished == 3
