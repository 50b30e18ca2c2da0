"""NCCL's protocols and latencies against its tuner (src/graph/tuning.cc, v2.30.7): every
expected value below is worked by hand from the tuner's tables and formulas, quoted inline."""

import dataclasses

import numpy as np
import pytest

from zsim.inputs import presets
from zsim.network.collective import CollectiveCall, CollectiveOp
from zsim.network.nccl_tuner import Hw, NcclComm, Protocol, choose, latency_us
from zsim.network.plans import plan

AG, AR = CollectiveOp.ALL_GATHER, CollectiveOp.ALL_REDUCE


def test_ring_latency_at_scale_is_the_simple_steps():
    # 192 DGX A100 nodes (AMD hosts: net overhead 2 us, x3 for Simple), all_gather:
    # base 8.4 + (1535 - 191) intra steps at max(3.4, 6.0) + 191 network steps at 14.0
    comm = NcclComm(ranks=1536, nodes=192, intra=Hw.NVLINK, channels=8, cpu="amd")
    assert latency_us(AG, "ring", Protocol.SIMPLE, comm, 1e9) == pytest.approx(
        8.4 + 1344 * 6.0 + 191 * 14.0
    )
    # LL: base 6.6, intra max(0.6, 2.0), network 2.7
    assert latency_us(AG, "ring", Protocol.LL, comm, 1e3) == pytest.approx(
        6.6 + 1344 * 2.0 + 191 * 2.7
    )


def test_ring_all_reduce_plateau_and_tree_latency():
    # 2 nodes x 8 (Intel: Simple floor 3.0 < 3.4): 30 steps, 2 (nodes - 1) = 2 of them over
    # the network; a multi-node Simple ring all_reduce of >= 64 B per rank per channel x 1.4
    comm = NcclComm(ranks=16, nodes=2, intra=Hw.NVLINK, channels=8)
    plain = 8.4 + 28 * 3.4 + 2 * 14.0
    assert latency_us(AR, "ring", Protocol.SIMPLE, comm, 1e9) == pytest.approx(1.4 * plain)
    assert latency_us(AR, "ring", Protocol.SIMPLE, comm, 16 * 8 * 32) == pytest.approx(plain)
    # tree, 4 nodes x 8, LL: 6.8 + 2 ((8 - 1) 0.6 + log2(4) 5.0)
    tree = NcclComm(ranks=32, nodes=4, intra=Hw.NVLINK, channels=8)
    assert latency_us(AR, "tree", Protocol.LL, tree, 1e3) == pytest.approx(6.8 + 2 * (4.2 + 10))
    # one rank per node: the ring pays the tree's network latency (Simple 14, LL 5.0)
    ppn1 = NcclComm(ranks=8, nodes=8, intra=Hw.PCI, channels=1)
    assert latency_us(AG, "ring", Protocol.LL, ppn1, 1e3) == pytest.approx(6.6 + 7 * 5.0)


def test_protocol_by_size():
    # 8 NVLink GPUs, bus 240 GB/s: LL (algbw min(87.7, 120) x 8/14 GB/s, latency 15.0 us)
    # wins small calls; Simple (137 GB/s, 56.0 us) large ones; LL128 in between (20 GB/s per
    # channel cap: 8 channels, 160 x 8/14 GB/s, 40.6 us), and never where it is disabled
    comm = NcclComm(ranks=8, nodes=1, intra=Hw.NVLINK, channels=8)
    bus = {"ring": 240e9}
    assert choose(AR, comm, 8e3, bus) == ("ring", Protocol.LL)
    assert choose(AR, comm, 64e6, bus) == ("ring", Protocol.SIMPLE)
    # 3.5 MB: LL 15.0 + 69.8, LL128 40.6 + 38.3, Simple 56.0 + 25.5 us
    assert choose(AR, comm, 3.5e6, bus) == ("ring", Protocol.LL128)
    no_ll128 = dataclasses.replace(comm, ll128=False)
    assert choose(AR, no_ll128, 3.5e6, bus) == ("ring", Protocol.SIMPLE)


def test_preset_hops_sum_to_the_tuners_ll_steps():
    # why zsim adds only the protocol's excess over LL: a DGX preset's routes already cost
    # NCCL's LL step latencies (NVLink 0.6 us, network 2.7 us)
    topo = presets.topology("2x8-dgx-a100")
    routes = topo.routes_of(np.array([0, 0]), np.array([1, 8]))
    assert routes.latency_s * 1e6 == pytest.approx([0.6, 2.7])


def test_a_small_gather_at_scale_pays_the_tuners_latency():
    # zsim's time for a 1 KiB all_gather on 192 x 8 DGX A100 is the tuner's LL latency
    # (6.6 + 1344 x 2.0 + 191 x 2.7 = 3,210 us); only the routes' mean hop differs from
    # NCCL's step count, and the call latency is Simple's base (8.4, not LL's 6.6)
    topo = presets.topology("192x8-dgx-a100")
    call = CollectiveCall(AG, 1024.0, tuple(range(1536)))
    expected = 6.6 + 1344 * 2.0 + 191 * 2.7
    assert plan(topo, call).closed_form_s * 1e6 == pytest.approx(expected, rel=0.01)


def test_ll_carries_twice_the_bytes():
    # a small all_gather on one NVLink node goes LL: each 8-byte line holds 4 bytes of data
    topo = presets.topology("1x8-dgx-a100")
    chosen = plan(topo, CollectiveCall(AG, 8e3, tuple(range(8))))
    assert chosen.phases[0].nbytes == pytest.approx(8e3 / 8 / 0.5)
    ideal = dataclasses.replace(topo, fabric=dataclasses.replace(topo.fabric, protocol="ideal"))
    assert plan(ideal, chosen.call).phases[0].nbytes == pytest.approx(8e3 / 8)
