"""`zsim topologies`, `zsim topology`, `zsim collective` end to end, and bad input (exit 2)."""

import json

import pytest

from zsim.cli import main
from zsim.cli.network import parse_sizes


def run_json(capsys, *argv):
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_topologies_lists_presets_and_grammar(capsys):
    out = run_json(capsys, "topologies")
    names = {row["fabric"] for row in out["fabrics"]}
    assert {"ethernet", "nvlink", "ib", "roce", "dgx-a100", "dgx-h100", "cpu"} <= names
    assert "NxG" in out["grammar"]


def test_topology_summary_and_plot(capsys, tmp_path):
    out = run_json(capsys, "topology", "2x8-dgx-h100", "--plot", str(tmp_path / "t.png"))
    assert out["gpus"] == 16
    assert (tmp_path / "t.png").stat().st_size > 0
    nvlink = [link for link in out["links"] if link["class"] == "nvlink"]
    # NCCL's rate: 18 NVLink4 x 20.6 GB/s (topo.h); the line rate 900 GB/s bidirectional
    assert nvlink[0]["bandwidth_GBps"] == pytest.approx(18 * 20.6)
    assert out["nvlink_line_GBps"] == pytest.approx(450)
    assert main(["topology", "2x2-cpu-1gbit"]) == 0
    assert "veth" in capsys.readouterr().out


def test_collective_table_in_nccl_tests_layout(capsys):
    assert (
        main(
            [
                "collective",
                "--topology",
                "2x4-ethernet",
                "--op",
                "all_gather",
                "--group",
                "dp",
                "--sizes",
                "1M..4M",
            ]
        )
        == 0
    )
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].split()[1:7] == ["size", "count", "type", "time", "algbw", "busbw"]
    rows = [line.split() for line in lines if not line.startswith("#")]
    assert [int(r[0]) for r in rows] == [2**20, 2**21, 2**22]
    assert [int(r[1]) for r in rows] == [2**18, 2**19, 2**20]  # float elements


def test_collective_json_busbw_follows_the_factor(capsys):
    out = run_json(
        capsys, "collective", "--topology", "1x8-nvlink", "--op", "all_reduce", "--sizes", "1G"
    )
    [row] = out["rows"]
    assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"] * 2 * 7 / 8)
    # A100 NVLink at NCCL's rate, 12 links x 20 GB/s (topo.h); measured 232 (reference row 118)
    assert row["busbw_GBps"] == pytest.approx(240, rel=0.01)


@pytest.mark.consistency
def test_collective_groups_and_all_groups(capsys):
    # tp=4 on 2x4-ethernet: DP groups (0, 4), (1, 5), ... all cross the one NIC per node
    one = run_json(
        capsys,
        "collective",
        "--topology",
        "2x4-ethernet",
        "--op",
        "all_gather",
        "--group",
        "dp",
        "--tp",
        "4",
        "--sizes",
        "1G",
    )
    four = run_json(
        capsys,
        "collective",
        "--topology",
        "2x4-ethernet",
        "--op",
        "all_gather",
        "--group",
        "dp",
        "--tp",
        "4",
        "--sizes",
        "1G",
        "--all-groups",
    )
    assert one["gpus"] == [0, 4]
    assert four["rows"][0]["time_us"] == pytest.approx(4 * one["rows"][0]["time_us"], rel=0.01)


def test_sizes_grammar():
    assert parse_sizes("1K..8K") == [1024, 2048, 4096, 8192]
    assert parse_sizes("8,1M") == [8, 2**20]


def _cluster_file(tmp_path, text):
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    return str(path)


GOOD = """
gpu: a100-80gb
nodes: 2
gpus_per_node: 4
backend: {name: nccl}
pcie: {bandwidth_GBps: 31.5, latency_us: 0.5}
nics: {per_node: 1, rate_Gbps: 100, link_class: ethernet, attach: host}
network: {leaf_ports: 32}
"""


def test_a_users_cluster_file(capsys, tmp_path):
    out = run_json(
        capsys,
        "collective",
        "--topology",
        _cluster_file(tmp_path, GOOD),
        "--op",
        "all_gather",
        "--sizes",
        "1G",
    )
    assert out["rows"][0]["busbw_GBps"] == pytest.approx(12.5, rel=0.01)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["topology", "3x4-foo"], "topology='3x4-foo'"),
        (["topology", "2x4-dgx-a100"], "gpus_per_node=4"),
        (
            ["collective", "--topology", "2x4-ethernet", "--op", "all_reduce", "--dp", "16"],
            "at most 8 GPUs",
        ),
        (["collective", "--topology", "2x4-ethernet", "--op", "allreduce"], "op='allreduce'"),
        (
            ["collective", "--topology", "2x4-ethernet", "--op", "all_reduce", "--sizes", "1Q"],
            "sizes='1Q'",
        ),
        (
            ["collective", "--topology", "2x2-cpu", "--op", "all_reduce", "--algorithm", "tree"],
            "gloo",
        ),
    ],
)
def test_bad_input_one_line_exit_2(capsys, argv, needle):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert needle in err


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("nodes: [2, 4\ngpus_per_node: 4\n", "valid YAML"),
        (GOOD.replace("rate_Gbps: 100", "rate_Gbps: 0"), "nics.rate_Gbps=0"),
        (
            GOOD.replace("bandwidth_GBps: 31.5", "bandwidth_GBps: -31.5"),
            "pcie.bandwidth_GBps=-31.5",
        ),
        (GOOD.replace("nodes: 2\n", ""), "nodes"),
    ],
)
def test_bad_cluster_files_one_line_exit_2(capsys, tmp_path, text, needle):
    path = _cluster_file(tmp_path, text)
    assert main(["collective", "--topology", path, "--op", "all_gather"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert needle in err
