"""The flow network: max-min fair sharing, flows that come and go, latency, accounting.

Expected rates are worked out by hand from max-min fairness (Bertsekas & Gallager, Data
Networks, section 6.5.2) and the link bandwidths of the topologies used.
"""

import numpy as np
import pytest
import simpy

from tests.helpers_network import uniform_star
from zsim.inputs import presets
from zsim.network.flows import Flow, FlowNetwork, max_min_rates

B = 10e9  # bytes/s of every link of the star used below


def test_max_min_textbook_example():
    # links: 0 (cap 1), 1 (cap 2). Flow 0 crosses both, flow 1 link 0, flow 2 link 1.
    # Link 0 fills first at 1/2 each; flow 2 then takes what flow 0 leaves on link 1: 1.5.
    rates = max_min_rates(np.array([0, 0, 1, 2]), np.array([0, 1, 0, 1]), np.array([1.0, 2.0]), 3)
    assert rates == pytest.approx([0.5, 0.5, 1.5])


def test_max_min_three_levels():
    # caps 3, 5, 10; flows a: {0, 1}, b: {0}, c: {1, 2}, d: {2}, e: {1}
    # link 0: a, b -> 1.5 each; link 1 left 5 - 1.5 = 3.5 for c, e -> 1.75; link 2: d = 10 - 1.75
    pairs = [(0, 0), (0, 1), (1, 0), (2, 1), (2, 2), (3, 2), (4, 1)]
    flow, link = (np.array(x) for x in zip(*pairs, strict=True))
    rates = max_min_rates(flow, link, np.array([3.0, 5.0, 10.0]), 5)
    assert rates == pytest.approx([1.5, 1.5, 1.75, 8.25, 1.75])


def _run(topo, starts):
    """starts: list of (start time, Flow); returns each flow's end time."""
    env = simpy.Environment()
    net = FlowNetwork(env, topo)
    ends = [0.0] * len(starts)

    def one(i, at, flow):
        yield env.timeout(at)
        yield net.transfer(flow.src, flow.dst, flow.nbytes)
        ends[i] = env.now

    for i, (at, flow) in enumerate(starts):
        env.process(one(i, at, flow))
    env.run()
    return ends, net


def test_one_flow_pays_latency_then_streams():
    # 2x4-ethernet: GPU 0 -> GPU 4 crosses the 100 GbE NICs (12.5 GB/s); route latency is
    # 6 PCIe hops of 0.5 us and 2 NIC hops of 5 us (the preset's values)
    topo = presets.topology("2x4-ethernet")
    (end,), _ = _run(topo, [(0.0, Flow(0, 4, 1e9))])
    assert end == pytest.approx(13e-6 + 1e9 / 12.5e9, rel=1e-9)


def test_a_flow_speeds_up_when_its_neighbour_ends():
    # both leave GPU 0 over one link of B: B/2 each until the small one ends at 2 S1 / B,
    # then the big one has B alone: it ends at (S1 + S2) / B
    topo = uniform_star(4, B / 1e9, 0.0)
    s1, s2 = 1e8, 3e8
    ends, _ = _run(topo, [(0.0, Flow(0, 1, s1)), (0.0, Flow(0, 2, s2))])
    assert ends == pytest.approx([2 * s1 / B, (s1 + s2) / B], rel=1e-9)


def test_a_late_flow_slows_the_first():
    # flow 1 alone for t0 (moves B t0), then both at B/2
    topo = uniform_star(4, B / 1e9, 0.0)
    s, t0 = 1e9, 0.02
    ends, _ = _run(topo, [(0.0, Flow(0, 1, s)), (t0, Flow(0, 2, s))])
    first = t0 + 2 * (s - B * t0) / B
    second = first + (s - (first - t0) * B / 2) / B
    assert ends == pytest.approx([first, second], rel=1e-9)


def test_disjoint_flows_do_not_interfere():
    topo = uniform_star(4, B / 1e9, 0.0)
    ends, _ = _run(topo, [(0.0, Flow(0, 1, 1e9)), (0.0, Flow(2, 3, 1e9))])
    assert ends == pytest.approx([1e9 / B, 1e9 / B], rel=1e-9)


def test_flows_started_together_are_settled_once():
    topo = presets.topology("16x8-dgx-a100")
    env = simpy.Environment()
    net = FlowNetwork(env, topo)
    flows = [Flow(i, (i + 8) % 128, 1e6) for i in range(128)]
    done = net.start(flows)
    env.run(done)
    # one settle when they start, one when they all end together
    assert net.recomputations == 1
    assert net.flows_finished == 128


def test_traffic_is_booked_per_gpu_and_link_class():
    topo = presets.topology("2x4-ethernet")
    _, net = _run(topo, [(0.0, Flow(0, 4, 1e6)), (0.0, Flow(0, 1, 2e6)), (0.0, Flow(3, 3, 5e6))])
    assert net.booked.per_gpu(source=True)[0] == pytest.approx(3e6)
    assert net.booked.per_gpu(source=False)[4] == pytest.approx(1e6)
    assert net.booked.per_gpu(source=False)[3] == 0  # a local copy is not network traffic
    by_class = net.bytes_by_link_class()
    assert by_class["ethernet"] == pytest.approx(2 * 1e6)  # NIC -> leaf -> NIC
    assert by_class["pcie"] == pytest.approx(6 * 1e6 + 2 * 2e6)


def test_repeat_coalesces_identical_steps():
    topo = uniform_star(3, B / 1e9, 2.0)
    env = simpy.Environment()
    net = FlowNetwork(env, topo)
    env.run(net.start([Flow(0, 1, 1e6), Flow(1, 2, 1e6)], repeat=5))
    assert env.now == pytest.approx(5 * (2e-6 + 1e6 / B))
    assert net.booked.per_gpu(source=True)[0] == pytest.approx(5e6)


@pytest.mark.consistency
@pytest.mark.parametrize(
    "name", ["2x8-dgx-h100", "4x8-roce", "2x4-ethernet", "2x2-cpu", "tests/data/rails-4x4.yaml"]
)
def test_two_gpu_calls_draw_on_the_links_their_planned_flows_cross(name):
    # links_of answers two-GPU calls without planning them; the planned flows are the truth
    from zsim.network.collective import CollectiveCall, CollectiveOp
    from zsim.network.communicator import Communicator

    topo = presets.topology(name)
    comms = Communicator(simpy.Environment(), topo)
    n = topo.world_size
    for pair in [(0, 1), (1, 0), (0, n - 1), (n - 1, n // 2)]:
        for op in CollectiveOp:
            for root in (0, 1) if op in (CollectiveOp.BROADCAST, CollectiveOp.REDUCE) else (0,):
                call = CollectiveCall(op, 1e6, pair, root=root)
                phases = [p for p in comms.plan(call).phases if p.nbytes > 0]
                src = np.concatenate([p.src for p in phases])
                dst = np.concatenate([p.dst for p in phases])
                routes = topo.routes_of(src, dst)
                planned = set(np.unique(topo.resource[routes.pair_link]).tolist())
                assert comms.links_of(call) == planned, (name, pair, op, root)
