"""gloo on the CPU fabric: the ranks' local work and gloo's message counts, each checked against
a form derived here from docs/collectives.md section 1 and from gloo's own
loops (gloo/allreduce.cc `ring`, written out again below), never from the code under test. The
ranks' links are half duplex (tests/test_half_duplex.py): a ring step, every rank sending to one
neighbour while receiving from the other, moves at B/2 per flow; a lone flow at B. The test marked
`consistency` compares the flow simulation with the closed form (both zsim's): a consistency check.
"""

import math

import pytest

from tests.helpers_network import cluster, uniform_star
from zsim.cluster.calibrated import with_call_latency, with_local_work
from zsim.errors import InputError
from zsim.inputs import presets
from zsim.network.collective import CollectiveCall, CollectiveOp
from zsim.network.communicator import simulate_s
from zsim.network.gloo import gloo_allreduce_messages
from zsim.network.plans import estimate_s, plan

Op = CollectiveOp
MIB = 2**20
B = 4e9  # one rank's stack, both directions together
ALPHA = 20e-6  # one step: two links of 10 us
MESSAGE_S, COPY_BPS, SUM_BPS, TOUCH_BPS = 30e-6, 8e9, 5e9, 2e9
LOCAL = {
    "message_us": MESSAGE_S * 1e6,
    "copy_GBps": COPY_BPS / 1e9,
    "reduce_GBps": SUM_BPS / 1e9,
    "first_touch_GBps": TOUCH_BPS / 1e9,
    "fresh_above_bytes": 32 * MIB,
}


def star(n, local=None):
    return uniform_star(n, B / 1e9, ALPHA * 1e6, backend="gloo", duplex="half", local_work=local)


def both(topo, call):
    """(flow simulation, closed form) of one call."""
    [sim] = simulate_s(topo, [call])
    return sim, estimate_s(topo, call)


def test_local_work_needs_every_rate():
    data = {
        "gpu": None,
        "gpus_per_node": [2],
        "backend": {"name": "gloo"},
        "loopback": {"bandwidth_GBps": 1},
        "local_work": {"message_us": 1},
        "nics": {"per_node": 1, "rate_Gbps": 1, "link_class": "veth", "attach": "host"},
        "network": {"leaf_ports": 8},
    }
    with pytest.raises(InputError, match="required"):
        cluster(data, 1, 2)


# ---- gloo's messages --------------------------------------------------------------------------


def brute_force_messages(nbytes, n, element=4):
    """gloo/allreduce.cc `ring`, iteration by iteration: the messages (sent + received) of the
    busiest rank in the reduce-scatter loop and in the all-gather loop."""
    max_segment = element * max(1, MIB // element)
    segments = math.ceil(max(math.ceil(nbytes / max_segment), 2 * n) / n) * n
    per_rank = segments // n
    segment = math.ceil(math.ceil(nbytes / segments) / element) * element
    span = segments * segment

    def length(offset):
        return min(segment, nbytes - offset)

    def busiest(send_base, recv_base):
        counts = []
        for rank in range(n):
            count = 0
            for i in range(segments - per_rank):
                send = (((rank + send_base) * per_rank) + i) * segment % span
                recv = (((rank + recv_base) * per_rank) + i) * segment % span
                count += (length(send) > 0) + (length(recv) > 0)
            counts.append(count)
        return max(counts)

    return busiest(1, 2), busiest(0, 1)


@pytest.mark.parametrize("n", [2, 3, 5, 8])
@pytest.mark.parametrize("size", [4, 8, 12, 16, 20, 100, 1024, 3 * MIB + 4, 10 * MIB])
def test_allreduce_messages_follow_gloo_loops(size, n):
    assert gloo_allreduce_messages(size, n) == brute_force_messages(size, n)


def test_eight_bytes_run_one_way_per_loop():
    # 2 fp32 elements, 4 segments of one element: segments 2 and 3 are empty, so in each loop
    # one rank sends segments 0 and 1 and the other receives them (2 messages, not 4)
    assert gloo_allreduce_messages(8, 2) == (2, 2)
    assert gloo_allreduce_messages(1024, 2) == (4, 4)


# ---- the ranks' local work ----------------------------------------------------------------


def ring_s(n, size, steps):
    return steps * (ALPHA + (size / n) / (B / 2))


def fresh_s(size):
    return size / TOUCH_BPS if size > 32 * MIB else 0.0


def expected_s(op, n, size):
    """notes section 1.1-1.3 and 1.6 with the ranks' CPU work: every message a rank sends or
    receives costs it MESSAGE_S; torch copies at COPY_BPS; gloo sums (n-1)/n S at SUM_BPS;
    all_gather's flat output, allocated on gloo's worker thread, is faulted in at TOUCH_BPS
    above 32 MiB (this test's fresh_above_bytes); reduce_scatter's clone, made on the calling
    thread, reuses its heap."""
    scatter, gather = brute_force_messages(size, n)
    all_reduce = ring_s(n, size, 2 * (n - 1)) + (scatter + gather) * MESSAGE_S
    all_reduce += (n - 1) / n * size / SUM_BPS
    if op is Op.ALL_REDUCE:
        return all_reduce
    if op is Op.REDUCE_SCATTER:  # clone, all_reduce, copy the own chunk
        return size / COPY_BPS + all_reduce + size / n / COPY_BPS
    if op is Op.ALL_GATHER:  # fresh output, prime own slot, half blocks both ways, copy out
        local = fresh_s(size) + size / n / COPY_BPS + 4 * (n - 1) * MESSAGE_S + size / COPY_BPS
        return ring_s(n, size, n - 1) + local
    return ALPHA + size / B + MESSAGE_S  # broadcast of two ranks, send_recv: one message


@pytest.mark.parametrize("size", [8, 1 * MIB, 64 * MIB])
@pytest.mark.parametrize(
    ("op", "n"),
    [
        (Op.ALL_REDUCE, 2),
        (Op.ALL_REDUCE, 4),
        (Op.REDUCE_SCATTER, 2),
        (Op.REDUCE_SCATTER, 3),
        (Op.ALL_GATHER, 2),
        (Op.ALL_GATHER, 4),
        (Op.BROADCAST, 2),
        (Op.SEND_RECV, 2),
    ],
)
def test_local_work_of_each_gloo_op(op, n, size):
    sim, closed = both(star(n, LOCAL), CollectiveCall(op, size, tuple(range(n))))
    assert sim == pytest.approx(expected_s(op, n, size), rel=1e-6)
    assert closed == pytest.approx(sim, rel=1e-6)


def test_only_blocks_above_the_allocator_threshold_fault():
    topo = star(2, LOCAL)
    at, above = 32 * MIB, 32 * MIB + 4
    [t_at] = simulate_s(topo, [CollectiveCall(Op.ALL_GATHER, at, (0, 1))])
    [t_above] = simulate_s(topo, [CollectiveCall(Op.ALL_GATHER, above, (0, 1))])
    streaming = (above - at) * (1 / (B / 2) / 2 + 1.5 / COPY_BPS)
    assert t_above - t_at == pytest.approx(above / TOUCH_BPS + streaming, rel=1e-6)


# ---- each op's own CPU per byte, send/recv's own call latency --------------------------------

OWN_S_PER_BYTE = 0.5e-9


def moved_bytes(op, n, size):
    """What the busiest rank sends plus receives (notes section 1): the ring all_reduce (and
    reduce_scatter_tensor, an all_reduce of the input) 2 x 2(n-1)/n S, all_gather and
    all_to_all 2(n-1)/n S, a binomial broadcast's root one S per round (ceil(log2 n)),
    send_recv S at each end."""
    if op in (Op.ALL_REDUCE, Op.REDUCE_SCATTER):
        return 4 * (n - 1) / n * size
    if op in (Op.ALL_GATHER, Op.ALL_TO_ALL):
        return 2 * (n - 1) / n * size
    if op is Op.BROADCAST:
        return math.ceil(math.log2(n)) * size
    return size


@pytest.mark.parametrize(
    ("op", "n"),
    [
        (Op.ALL_REDUCE, 2),
        (Op.ALL_REDUCE, 4),
        (Op.REDUCE_SCATTER, 3),
        (Op.ALL_GATHER, 2),
        (Op.ALL_GATHER, 4),
        (Op.BROADCAST, 2),
        (Op.BROADCAST, 4),
        (Op.SEND_RECV, 2),
        (Op.ALL_TO_ALL, 4),
    ],
)
def test_each_op_pays_its_own_cost_per_byte_moved(op, n):
    size = 4 * MIB
    call = CollectiveCall(op, size, tuple(range(n)))
    base = star(n, LOCAL)
    own = with_local_work(base, {op: OWN_S_PER_BYTE})
    others = with_local_work(base, {o: OWN_S_PER_BYTE for o in Op if o is not op})
    t_base, t_own = both(base, call), both(own, call)
    for got, ref in zip(t_own, t_base, strict=True):
        assert got - ref == pytest.approx(OWN_S_PER_BYTE * moved_bytes(op, n, size), rel=1e-6)
    assert both(others, call) == pytest.approx(t_base, rel=1e-12)
    # the traffic is the same: only the ranks' CPU work grows
    assert [p.flows for p in plan(own, call).phases] == [p.flows for p in plan(base, call).phases]


def test_send_recv_pays_its_own_call_latency():
    common = with_call_latency(star(2, LOCAL), 100e-6)
    own = with_call_latency(star(2, LOCAL), 100e-6, p2p_call_latency_s=40e-6)
    send = CollectiveCall(Op.SEND_RECV, 4096, (0, 1))
    reduce = CollectiveCall(Op.ALL_REDUCE, 4096, (0, 1))
    assert both(own, send)[0] - both(common, send)[0] == pytest.approx(-60e-6, rel=1e-9)
    assert both(own, reduce) == both(common, reduce)


def test_an_ops_own_call_cost_is_paid_once_per_call_by_that_op_alone():
    base = star(2, LOCAL)
    own = with_local_work(base, None, {Op.ALL_GATHER: 40e-6})
    gather = CollectiveCall(Op.ALL_GATHER, 4096, (0, 1))
    reduce = CollectiveCall(Op.ALL_REDUCE, 4096, (0, 1))
    for size in (8, 64 * MIB):  # a fixed cost: the same at every size
        call = CollectiveCall(Op.ALL_GATHER, size, (0, 1))
        for got, ref in zip(both(own, call), both(base, call), strict=True):
            assert got - ref == pytest.approx(40e-6, rel=1e-9)
    assert both(own, reduce) == both(base, reduce)
    flows = [[p.flows for p in plan(topo, gather).phases] for topo in (own, base)]
    assert flows[0] == flows[1]  # the traffic is the same: only the call's CPU grows


def test_nccl_ignores_the_ranks_local_work():
    topo = presets.topology("1x8-dgx-h100")
    costly = with_local_work(topo, dict.fromkeys(Op, 1.0), message_s=1.0)
    for op in (Op.ALL_REDUCE, Op.ALL_GATHER, Op.BROADCAST):
        call = CollectiveCall(op, 64 * MIB, tuple(range(8)))
        assert both(costly, call) == both(topo, call)


# ---- the preset: every plan's simulation against its closed form ----------------------------


@pytest.mark.consistency
@pytest.mark.parametrize("size", [8, 4096, 3 * MIB, 96 * MIB])
@pytest.mark.parametrize("op", [o for o in Op if o is not Op.BROADCAST])
@pytest.mark.parametrize("name", ["1x2-cpu", "1x4-cpu", "2x2-cpu-1gbit"])
def test_cpu_preset_simulation_equals_closed_form(name, op, size):
    """Consistency check: the flow simulation is within 1% of the closed form."""
    topo = presets.topology(name)
    group = (0, topo.world_size - 1) if op is Op.SEND_RECV else tuple(range(topo.world_size))
    call = CollectiveCall(op, size, group)
    sim, closed = both(topo, call)
    assert sim == pytest.approx(closed, rel=0.01)
    assert sim > topo.call_latency_s + math.ceil(math.log2(len(group))) * topo.local_work.message_s
