"""How many SMs an NCCL collective holds while it runs: one CTA per channel it runs on.

NCCL runs a collective as one kernel with a CTA per channel (a plan's `channelMask`; the
kernel spins in each CTA until its peers' data has moved, so the CTA holds its SM from launch
to end). Compute kernels launched beside it on another stream get the SMs left
(`step.engine`; the issue's "NCCL kernels taking SMs from compute").

The channels, read in NVIDIA/nccl at 5067397c (src/graph/search.cc, connect.cc, enqueue.cc):

- the ring search (`ncclTopoCompute`) tries the generation's speeds from the fastest a path
  carries, down while the next is more than .49 of the best found, keeping the solution with
  the most channels x speed; it stops once that reaches the GPU's total bandwidth. On one
  NVSwitch node a channel takes its speed on each GPU's NVLinks: n = total // speed; across
  nodes one channel per NIC rail (zsim's rings, `nccl.nccl_rings`) at the NIC's speed;
- `ncclTopoDupChannels` doubles them unless the speed is under 25 GB/s, or the GPU is newer
  than Ampere with a speed under 50 and more than 4 channels;
- `ncclTopoPostset` doubles again ("execution channels are typically 2x the search
  channels", NCCL's maintainer in NVIDIA/nccl#1041), at most MAXCHANNELS (64); on Hopper and
  later across nodes, a speed over 45 and fewer than 16 channels doubles once more;
- a call runs on fewer while its bytes are under channels x 512 threads x 64 (Simple's
  threshold; `enqueue.cc`): the large data-parallel calls this matters for use all.

This gives 24 on one node of 8 A100 or H100, 16 on an H800 node (8 NVLinks) and 16 across
DGX H100 nodes: the counts NCCL's logs and a profile print (`tests/test_nccl_ctas.py`). A
fabric that states its channels (`backend.ring_channels`, read in a log) has that many.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from zsim.cluster.fabric import GB
from zsim.cluster.nvlink import compute_capability, nccl_nvlink_GBps
from zsim.cluster.topology import Topology

SPEEDS_INTRA = {
    80: (40.0, 30.0, 20.0, 18.0, 15.0, 12.0, 10.0, 9.0, 7.0, 6.0, 5.0, 4.0, 3.0),
    90: (60.0, 50.0, 40.0, 30.0, 24.0, 20.0, 15.0, 12.0, 11.0, 6.0, 3.0),
    100: (90.0, 80.0, 70.0, 60.0, 50.0, 45.0, 40.0, 30.0, 24.0, 20.0, 19.0, 18.0),
}
"""search.cc's `speedArrayIntra` by compute capability x10 (sm90, sm100 arrays)."""

SPEEDS_INTER = {
    80: (48.0, 30.0, 28.0, 24.0, 20.0, 18.0, 15.0, 12.0, 10.0, 9.0, 7.0, 6.0, 5.0, 4.0, 3.0),
    90: (48.0, 45.0, 42.0, 40.0, 30.0, 24.0, 22.0, 20.0, 17.5, 15.0, 12.0, 6.0, 3.0),
    100: (96.0, 86.0, 80.0, 48.0, 45.1, 42.0, 40.0, 30.0, 24.0, 22.0, 20.0, 17.5, 15.0, 12.0),
}
"""search.cc's `speedArrayInter` (its slowest entries, under 3 GB/s, left out)."""

MAX_SEARCH_CHANNELS = 32  # init.cc: ringGraph->maxChannels = MAXCHANNELS / 2
MAX_CHANNELS = 64  # device.h MAXCHANNELS
SIMPLE_THREADS, SIMPLE_THREAD_THRESHOLD = 512, 64  # device.h, comm.h


def _speeds(table: dict[int, tuple[float, ...]], sm: int) -> tuple[float, ...]:
    return table[max((g for g in table if g <= sm), default=min(table))]


def search(
    total_GBps: float, channels_at: Sequence[int], speeds: Sequence[float]
) -> tuple[int, float]:
    """(channels, speed) of the ring search: `channels_at[i]` channels fit at `speeds[i]`."""
    best_n, best_bw = 0, 0.0
    i = next((j for j, s in enumerate(speeds) if channels_at[j] > 0), len(speeds) - 1)
    while True:
        n, bw = channels_at[i], speeds[i]
        if n * bw > best_n * best_bw:
            best_n, best_bw = n, bw
        if best_n * best_bw >= total_GBps or i + 1 >= len(speeds):
            return best_n, best_bw
        if best_n and speeds[i + 1] / best_bw <= 0.49:
            return best_n, best_bw
        i += 1


def execution_channels(search_n: int, bw: float, sm: int, nodes: int) -> int:
    """The communicator's channels from the search's: DupChannels, then Postset."""
    n = search_n
    if bw >= 25.0 and not (sm > 80 and bw < 50.0 and n > 4):
        n = min(2 * n, MAX_SEARCH_CHANNELS)
    n = min(MAX_CHANNELS, 2 * n)
    if sm >= 90 and nodes > 1 and bw > 45.0 and n < 16:
        n = 2 * n
    return n


def comm_channels(topo: Topology, group: Sequence[int]) -> int:
    """The channels NCCL builds for a communicator over `group` (GPUs of `topo`)."""
    fabric = topo.fabric
    sm = compute_capability(fabric.gpu)
    nodes = len({topo.node_of(g) for g in group})
    if nodes > 1 and fabric.ring_channels:
        return fabric.ring_channels  # as the fabric's log printed them
    if nodes == 1:
        if fabric.nvswitch is not None and fabric.nvlinks_per_gpu:
            total = nccl_nvlink_GBps(fabric.gpu, fabric.nvlinks_per_gpu)
        else:
            total = (fabric.pcie.bandwidth_bytes_per_s if fabric.pcie else 0.0) / GB
        speeds = _speeds(SPEEDS_INTRA, sm)
        fits = [min(int(total / s + 1e-9), MAX_SEARCH_CHANNELS) for s in speeds]
        n, bw = search(total, fits, speeds)
        return execution_channels(max(n, 1), bw, sm, nodes)
    members = Counter(topo.node_of(g) for g in group)
    nic = fabric.nic.bandwidth_bytes_per_s / GB
    bw = next((s for s in _speeds(SPEEDS_INTER, sm) if s <= nic), 3.0)
    return execution_channels(min(members.values()), bw, sm, nodes)  # a ring per rail


def call_ctas(channels: int, nbytes: float) -> int:
    """The channels (CTAs) one call of `nbytes` (nccl-tests' size) runs on."""
    nc = channels
    while nc >= 2 and nbytes < nc * SIMPLE_THREADS * SIMPLE_THREAD_THRESHOLD:
        nc -= 1
    return nc
