"""NVLink at the rate NCCL drives it (src/graph/topo.h, v2.30.7), against NCCL's measured ring
plateaus in `calibration/reference/collectives_bandwidth.csv` (rows 118 and 140) and the
per-link constants of topo.h, not against zsim itself."""

import csv
import dataclasses

import pytest

from zsim.cluster.fabric import GB, LinkSpec, fabric_from_mapping
from zsim.cluster.nvlink import nccl_link, nccl_nvlink_GBps
from zsim.cluster.topology import build_topology
from zsim.errors import InputError
from zsim.inputs import presets
from zsim.inputs.files import data_dir, load_mapping
from zsim.network.collective import CollectiveCall, CollectiveOp, bandwidths
from zsim.network.communicator import simulate_s

AR, AG = CollectiveOp.ALL_REDUCE, CollectiveOp.ALL_GATHER


def _measured(row: str) -> float:
    path = data_dir("calibration") / "reference" / "collectives_bandwidth.csv"
    with open(path, newline="") as f:
        [hit] = [r for r in csv.DictReader(f) if r["row_id"].endswith(f"-{row}")]
    return float(hit["busbw_GBps"].lstrip("~"))


def _busbw(name: str, op: CollectiveOp, size: int = 8 * 2**30) -> float:
    topo = presets.topology(name)
    n = topo.world_size
    [t] = simulate_s(topo, [CollectiveCall(op, size, tuple(range(n)))])
    return bandwidths(op, n, size, t)[1] / GB


def test_per_link_rates_are_topo_h():
    # SM80_NVLINK_BW 20.0 x 12 NVLink3; SM90_NVLINK_BW 20.6 x 18 NVLink4; SM70 20.0 x 6
    assert nccl_nvlink_GBps("a100-80gb", 12) == pytest.approx(240.0)
    assert nccl_nvlink_GBps("h100-sxm", 18) == pytest.approx(370.8)
    assert nccl_nvlink_GBps("v100-32gb", 6) == pytest.approx(120.0)
    # never above the line rate; the line rate when the count is unknown
    line = LinkSpec(100 * GB, 0.3e-6)
    assert nccl_link(line, "a100-80gb", 12).bandwidth_bytes_per_s == pytest.approx(100 * GB)
    assert nccl_link(line, "a100-80gb", None) is line


def test_a100_ring_plateau_matches_nccl_tests():
    # row 118: 8 A100, NVLink3, NCCL's default algorithm (a ring: no NVLS on Ampere): 232 GB/s
    measured = _measured("118")
    assert measured == pytest.approx(232)
    assert _busbw("1x8-dgx-a100", AR) == pytest.approx(measured, rel=0.05)


def test_h100_non_all_reduce_plateau_matches_the_maintainer():
    # row 140: "NCCL effective NVLink bandwidth of 370 GB/s" with NCCL_ALGO=RING or any op
    # other than all_reduce (nccl-tests#212)
    measured = _measured("140")
    for op in (AR, AG):
        assert _busbw("1x8-dgx-h100", op) == pytest.approx(measured, rel=0.02)


def test_without_the_link_count_the_line_rate():
    fabric = dataclasses.replace(presets.fabric("dgx-a100"), nvlinks_per_gpu=None)
    line = build_topology("line", fabric, 1, 8)
    [t] = simulate_s(line, [CollectiveCall(AR, 8 * 2**30, tuple(range(8)))])
    assert bandwidths(AR, 8, 8 * 2**30, t)[1] / GB == pytest.approx(300, rel=0.01)


def test_a_bad_link_count_is_refused():
    spec = dict(load_mapping(data_dir("topologies") / "dgx-a100.yaml", "topology"))
    spec["nvswitch"] = {**spec["nvswitch"], "links": 0}
    with pytest.raises(InputError, match=r"nvswitch\.links"):
        fabric_from_mapping(spec, "mine.yaml", presets.gpu_names())
