"""The accuracy benchmark's cluster files against what was measured on those clusters."""

from pathlib import Path

import pytest

from zsim.cluster.fabric import fabric_from_mapping
from zsim.cluster.topology import build_topology
from zsim.inputs.files import load_mapping
from zsim.inputs.presets import gpu_names
from zsim.network.collective import CollectiveCall, CollectiveOp
from zsim.network.communicator import simulate_s
from zsim.network.nccl import nccl_rings, tree_channels

JEAN_ZAY = (
    Path(__file__).resolve().parent.parent / "benchmarks" / "reference" / "jean-zay-a100.yaml"
)


def test_jean_zay_reproduces_bigsciences_all_reduce_bench():
    """bigscience-workshop/bigscience experiments/bandwidth/all_reduce_bench-a100-n4.txt:
    all_reduce_bench.py (a 500,000 x 2,000 fp32 tensor, 4e9 bytes) over 4 nodes x 8 A100 in
    the tr11 environment, a median of 1.5292 s over its 160 timings."""
    data = load_mapping(JEAN_ZAY, "topology")
    data.pop("nodes")
    topo = build_topology("jz", fabric_from_mapping(data, "jz", gpu_names()), 4, 8)
    call = CollectiveCall(CollectiveOp.ALL_REDUCE, 4e9, tuple(range(32)))
    assert simulate_s(topo, [call])[0] == pytest.approx(1.5292, rel=0.03)


def test_jean_zay_rings_are_the_ones_nccls_log_shows():
    """The same log: 'Channel 00/02' and 'Channel 01/02' both run 0 1 2 ... 31, each node entered
    at its local GPU 0 and left at its GPU 7 (every inter-node hop 8k+7 -> 8k+8)."""
    data = load_mapping(JEAN_ZAY, "topology")
    data.pop("nodes")
    topo = build_topology("jz", fabric_from_mapping(data, "jz", gpu_names()), 4, 8)
    rings = nccl_rings(topo, tuple(range(32)))
    assert rings.tolist() == [list(range(32))] * 2


def test_jean_zay_trees_are_headed_by_each_nodes_first_gpu():
    """The same log's trees ('Trees [0] 1/8/-1->0->-1 ...'): each node's GPU 0 talks to the
    other nodes; 2 channels of two trees each."""
    data = load_mapping(JEAN_ZAY, "topology")
    data.pop("nodes")
    topo = build_topology("jz", fabric_from_mapping(data, "jz", gpu_names()), 4, 8)
    channels = tree_channels(topo, tuple(range(32)))
    assert len(channels) == 2 * 2
    for chains, _ in channels:
        assert chains[:, 0].tolist() == [0, 8, 16, 24]
