"""Built-in presets found in the data folders: GPU profiles (spec sheet + reference fit) and
topologies (fabric presets under `topologies/`, named by the NxG-fabric grammar)."""

from __future__ import annotations

import re
from dataclasses import replace
from functools import cache
from pathlib import Path
from typing import Any

from zsim.cluster.device import DeviceProfile
from zsim.cluster.fabric import FabricSpec, fabric_from_mapping
from zsim.cluster.gpu_spec import profile_from_spec
from zsim.cluster.names import parse_cluster_name
from zsim.cluster.topology import Topology, build_topology
from zsim.errors import choose, positive_int, require
from zsim.inputs.files import data_dir, load_csv, load_mapping, read_text


def _gpu_dir() -> Path:
    return data_dir("calibration") / "presets"


def gpu_names() -> list[str]:
    return sorted(p.stem for p in _gpu_dir().glob("*.yaml"))


@cache
def gpu(name: str) -> DeviceProfile:
    """A built-in GPU profile by name (e.g. `a100-80gb`), or a GPU spec file written as the
    built-ins are (`zsim/data/calibration/presets/*.yaml`), its `efficiency_from` a built-in."""
    if Path(name).suffix in (".yaml", ".yml", ".json"):
        spec = _gpu_file(Path(name))
    else:
        spec = load_mapping(_gpu_dir() / f"{choose('gpu', name, gpu_names())}.yaml", "gpu")
    measured_on = None
    if "efficiency_from" in spec:
        source = choose("efficiency_from", str(spec["efficiency_from"]), gpu_names())
        measured_on = load_mapping(_gpu_dir() / f"{source}.yaml", "gpu")
    reference = load_csv(data_dir("calibration") / "reference" / "microbenchmarks_gemm_hbm.csv")
    profile = profile_from_spec(spec, reference, measured_on)
    return replace(profile, zero3_rank_host_s=zero3_host_costs())


ZERO3_HOST_FILE = "zero3-host.json"


@cache
def zero3_host_costs() -> dict[str, float]:
    """DeepSpeed ZeRO-3's host seconds per rank (`calibrate.zero3_host`), as measured on the
    CPU its file names: what a GPU preset's host pays until a GPU host is measured (without
    CUDA's `record_stream` calls, so a lower bound)."""
    path = data_dir("calibration") / ZERO3_HOST_FILE
    fitted = load_mapping(path, "zero3_host").get("fit", {})
    require(isinstance(fitted, dict), "zero3_host.fit", fitted, "a mapping of costs")
    return {cost: float(value["per_rank_s"]) for cost, value in fitted.items()}


GPU_FILE_KEYS = ("name", "memory_GiB", "peak_TFLOPS", "hbm_GBps")


def _gpu_file(path: Path) -> dict[str, Any]:
    """A GPU spec file with the keys a profile is built from."""
    spec = load_mapping(path, "gpu")
    for key in GPU_FILE_KEYS:
        require(key in spec, f"gpu.{key}", None, f"a value in {path} (as the built-in presets)")
    allowed = "a built-in preset whose measured rows it borrows: " + ", ".join(gpu_names())
    require("efficiency_from" in spec or "match" in spec, "gpu.efficiency_from", None, allowed)
    return spec


# ---- topologies: fabric presets and the NxG-fabric names ---------------------------------


def _topology_dir() -> Path:
    return data_dir("topologies")


def fabric_names() -> list[str]:
    return sorted(p.stem for p in _topology_dir().glob("*.yaml"))


@cache
def fabric(name: str) -> FabricSpec:
    """A fabric preset by name (e.g. `dgx-a100`): one node type and its network."""
    name = choose("fabric", name, fabric_names())
    data = load_mapping(_topology_dir() / f"{name}.yaml", "topology")
    data.pop("nodes", None)
    return fabric_from_mapping(data, name, gpu_names())


def topology(name_or_path: str) -> Topology:
    """A cluster from `NxG-fabric[-rate]` (see `zsim topologies`) or a user's YAML file.

    A user's file is a fabric mapping plus `nodes` and `gpus_per_node` (one number).
    """
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml", ".json") or path.exists():
        return _topology_file(path)
    parsed = parse_cluster_name(name_or_path, fabric_names())
    spec = fabric(parsed.fabric)
    if parsed.nic_rate_bytes_per_s is not None:
        nic = replace(spec.nic, bandwidth_bytes_per_s=parsed.nic_rate_bytes_per_s)
        spec = replace(spec, nic=nic)
    return build_topology(name_or_path, spec, parsed.nodes, parsed.gpus_per_node)


def cluster_file_text(name: str) -> str:
    """An editable cluster file for a `NxG-fabric[-RATE]` name: the fabric preset's YAML
    (its comments and sources kept) with `nodes`, one `gpus_per_node` and the NIC rate set."""
    parsed = parse_cluster_name(name, fabric_names())
    text = read_text(_topology_dir() / f"{parsed.fabric}.yaml", "topology")
    head = f"# {name}: written by `zsim topology {name} --emit`; edit freely.\n"
    lines = f"nodes: {parsed.nodes}\ngpus_per_node: {parsed.gpus_per_node}"
    text = re.sub(r"^gpus_per_node:.*$", lines, text, count=1, flags=re.MULTILINE)
    if parsed.nic_rate_bytes_per_s is not None:
        rate = f"rate_Gbps: {parsed.nic_rate_bytes_per_s * 8 / 1e9:g}"
        text = re.sub(r"rate_Gbps:\s*[0-9.e+]+", rate, text, count=1)
    return head + text


def _topology_file(path: Path) -> Topology:
    data = load_mapping(path, "topology")
    nodes = data.pop("nodes", None)
    spec = fabric_from_mapping(data, path.name, gpu_names())
    require(
        nodes is not None and len(spec.gpus_per_node) == 1,
        f"{path.name}:nodes/gpus_per_node",
        f"nodes={nodes}, gpus_per_node={list(spec.gpus_per_node)}",
        "a cluster file gives `nodes: N` and one `gpus_per_node` (a fabric preset copied "
        "as it is has neither: `zsim topology 2x8-FABRIC --emit FILE` writes one to edit)",
    )
    return build_topology(
        path.stem, spec, positive_int(f"{path.name}:nodes", nodes), spec.gpus_per_node[0]
    )
