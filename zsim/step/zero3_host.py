"""DeepSpeed ZeRO-3's host bookkeeping per data-parallel rank, as the host thread issues it.

DeepSpeed 0.19 walks every rank of the group in Python (`docs/deepspeed-0.19-semantics.md`,
"ZeRO-3's host walks"): `_all_gather_dtype` makes a view per rank of a coalesced gather's
flat buffer before the all-gather ("gather_issue"); `AllGatherCoalescedHandle.wait`, at the
first wait, makes per parameter a view of each rank's piece, `torch.cat`s them and records
its stream on each ("gather_wait", per parameter); `reduce_scatter_coalesced` slices each
gradient per rank and interleaves the pieces ("reduce", per parameter). A one-parameter
gather (`_all_gather_sequential`) and qwZ's quantized gathers walk no ranks here. The seconds
per rank are the device profile's (`calibrate.zero3_host`: DeepSpeed's own code timed on a
CPU).

The host does this work in the order the coordinator and the gradient hooks run, one piece
after the other (`HostChain`); a gather is issued, a module's kernels launched and a bucket
reduce-scattered only after the host got there. The coordinator throttles on its fetches
(partitioned_param_coordinator.py:400-406: with more than two fetch events in flight, the
host waits for the oldest, recorded after a module's wait work on the allgather stream): a
module's wait work starts once the previous module's copy-out is done; the gradient hooks
throttle on their reductions (`zero_reduce`, `max_param_reduce_events`), holding the host
too, not the device, which runs what was launched before. GPU ranks only: a CPU rank's
measured engine host time (`StageJob.engine_host_s`) holds its own.
"""

from __future__ import annotations

from collections.abc import Sequence

from zsim.cluster.device import DeviceProfile
from zsim.step.job import StageJob
from zsim.step.program import Category, ProgramWriter, Stream, Task
from zsim.workload.mechanisms import Mechanism
from zsim.workload.parallel import DpEngine, ParallelConfig, ZeroStage


def host_thread_modelled(cfg: ParallelConfig, gloo: bool) -> bool:
    """Whether the rank's host thread is a stream of its own: DeepSpeed ZeRO-3 on GPU ranks,
    where the host runs ahead of the device until a throttle holds it."""
    zero3 = cfg.zero_stage is ZeroStage.PARAMETERS and cfg.dp_engine is DpEngine.DEEPSPEED
    return zero3 and not gloo


def rank_host_costs(cfg: ParallelConfig, device: DeviceProfile, gloo: bool) -> dict[str, float]:
    """Seconds per rank of each piece of bookkeeping, where it applies (else none)."""
    applies = host_thread_modelled(cfg, gloo) and cfg.dp > 1 and cfg.models(Mechanism.ZERO3_HOST)
    return dict(device.zero3_rank_host_s) if applies else {}


class HostChain:
    """One rank's host thread: each piece of bookkeeping after the previous one."""

    def __init__(self, job: StageJob, writer: ProgramWriter) -> None:
        self.writer = writer
        self.active = host_thread_modelled(job.cfg, job.gloo)
        self.costs = rank_host_costs(job.cfg, job.device, job.gloo)
        self.last: Task | None = None

    def charge(self, cost: str, ranks: int, tensors: int, deps: Sequence[Task]) -> Task | None:
        """Walk `ranks` ranks for each of `tensors` parameters (none: no work here)."""
        seconds = self.costs.get(cost, 0.0) * ranks * tensors
        if seconds <= 0.0 or ranks <= 1:
            return None
        after = [*deps, *([self.last] if self.last else [])]
        self.last = self.writer.compute(f"host_{cost}", seconds, Category.HOST, after, Stream.HOST)
        return self.last

    def wait(self, name: str, deps: Sequence[Task]) -> Task | None:
        """The host blocks until `deps` are done (an event's `synchronize()`); its later work,
        and the kernels it launches after, start no earlier."""
        if not self.active or not deps:
            return None
        after = [*deps, *self.issued()]
        self.last = self.writer.compute(name, 0.0, Category.HOST, after, Stream.HOST)
        return self.last

    def sync(self, deps: Sequence[Task]) -> None:
        """The host waited for the device (a micro-step starts after the last backward
        returned): its later work starts no earlier."""
        self.wait("host_sync", deps)

    def issued(self) -> list[Task]:
        """What a kernel the host launches now waits for: the host's work before it."""
        return [self.last] if self.last else []
