"""What NCCL makes of a GPU's NVLinks: the GPU generation, and the rate NCCL drives a link at.

NCCL's topology search gives each NVLink a bandwidth by GPU generation (src/graph/topo.h,
v2.30.7: `SM70_NVLINK_BW` 20.0, `SM80_NVLINK_BW` 20.0, `SM90_NVLINK_BW` 20.6,
`SM100_NVLINK_BW` 40.1 GB/s), below the 25 GB/s per direction an NVLink2-4 carries; its
channels, and so every ring, tree and send on NVLink, move at most that per link. Measured,
this is the ring all-reduce plateau: 232 GB/s busbw on 8 A100 (12 links: NCCL's 240, line
300) and 370 GB/s on 8 H100 with NCCL_ALGO=RING or for any op but all_reduce (18 links:
370.8, line 450; NVIDIA's maintainer in nccl-tests#212), rows 118 and 139-140 of
`collectives_bandwidth.csv`. A fabric that names its GPU's NVLink count (`nvswitch.links`)
gets this rate on its GPU <-> NVSwitch edges; without the count, the spec's line rate.

Not modelled: NVLS (NVLink SHARP, Hopper and later), with which NCCL's single-node
all_reduce reaches ~480 GB/s busbw on 8 H100: zsim's all_reduce there runs as a ring at 370.
"""

from __future__ import annotations

from dataclasses import replace

from zsim.cluster.fabric import GB, LinkSpec

SM_BY_GPU = {"v100": 70, "a100": 80, "h100": 90, "h200": 90, "b200": 100}
"""GPU name prefix -> compute capability x10, NCCL's `minCompCap` (CUDA's table)."""

NCCL_NVLINK_GBPS = {70: 20.0, 80: 20.0, 90: 20.6, 100: 40.1}
"""NCCL's bandwidth of one NVLink by compute capability x10 (topo.h `ncclTopoNVLinkBw`)."""


def compute_capability(gpu: str | None) -> int:
    """NCCL's GPU generation for a GPU preset name; Ampere when unknown."""
    for prefix, sm in SM_BY_GPU.items():
        if gpu is not None and gpu.lower().startswith(prefix):
            return sm
    return 80


def nccl_nvlink_GBps(gpu: str | None, links: int) -> float:
    """What NCCL moves per direction over a GPU's `links` NVLinks (topo.h's per-link rate:
    the newest generation not newer than the GPU's)."""
    sm = compute_capability(gpu)
    generation = max((g for g in NCCL_NVLINK_GBPS if g <= sm), default=min(NCCL_NVLINK_GBPS))
    return links * NCCL_NVLINK_GBPS[generation]


def nccl_link(link: LinkSpec, gpu: str | None, links: int | None) -> LinkSpec:
    """A GPU <-> NVSwitch link at NCCL's rate for its `links` NVLinks (never above the line
    rate); the line rate itself when the count is not given."""
    if links is None:
        return link
    rate = min(link.bandwidth_bytes_per_s, nccl_nvlink_GBps(gpu, links) * GB)
    return replace(link, bandwidth_bytes_per_s=rate)
