"""NCCL's channels (one CTA, one SM, each) against the counts its logs and a profile print.

Sources, each a run of NCCL on the hardware named:
- one node of 8 H100 SXM: a profile of FSDP's prefetched all-gather shows `ncclAllGather` with
  24 blocks on the 132-SM GPU (NVIDIA developer forum, topic 337991);
- one node of 8 H800 (8 NVLinks a GPU): "16 coll channels" (NVIDIA/nccl#892's log);
- 3 nodes of 8 H100 with a NIC a GPU: "Channel 00/16" to "15/16" (NVIDIA/nccl#1453's log);
- Jean Zay's A100 nodes, NCCL 2.10.3: "Channel 00/02" and "01/02" (the bigscience all-reduce
  benchmark's log, `benchmarks/reference/jean-zay-a100.yaml` [6]);
- one node of 8 A100 (p4d): channels numbered up to 20 and beyond (NVIDIA/Megatron-LM#516's
  log, an excerpt: at least 21).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from zsim.cluster.fabric import fabric_from_mapping
from zsim.cluster.topology import build_topology
from zsim.inputs import presets
from zsim.inputs.files import load_mapping
from zsim.network.nccl_ctas import call_ctas, comm_channels

JEAN_ZAY = Path(__file__).parent.parent / "benchmarks" / "reference" / "jean-zay-a100.yaml"


def everyone(topo) -> list[int]:
    return list(range(topo.world_size))


def test_one_h100_node_runs_24_channels():
    assert comm_channels(presets.topology("1x8-dgx-h100"), list(range(8))) == 24


def test_an_h800_node_with_8_nvlinks_runs_16():
    h100 = presets.fabric("dgx-h100")
    h800 = replace(h100, nvlinks_per_gpu=8)
    topo = build_topology("1x8-h800", h800, 1, 8)
    assert comm_channels(topo, everyone(topo)) == 16


def test_three_h100_nodes_run_16():
    topo = presets.topology("3x8-dgx-h100")
    assert comm_channels(topo, everyone(topo)) == 16


def test_jean_zay_runs_the_two_its_log_printed():
    spec = fabric_from_mapping(
        load_mapping(JEAN_ZAY, "topology"), JEAN_ZAY.name, presets.gpu_names()
    )
    topo = build_topology("4x8-jean-zay", spec, 4, 8)
    assert comm_channels(topo, everyone(topo)) == 2


def test_one_a100_node_runs_more_than_20():
    assert comm_channels(presets.topology("1x8-dgx-a100"), list(range(8))) > 20


@pytest.mark.parametrize(
    ("nbytes", "ctas"),
    [(1 << 30, 24), (24 * 512 * 64, 24), (24 * 512 * 64 - 1, 23), (100 * 1024, 3), (8, 1)],
)
def test_a_small_call_runs_on_fewer(nbytes, ctas):
    # enqueue.cc: one channel fewer while bytes < channels x 512 threads x 64 (Simple)
    assert call_ctas(24, nbytes) == ctas
