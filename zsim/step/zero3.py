"""DeepSpeed ZeRO-3's parameter coordinator, replayed over one micro-step's module trace.

`PartitionedParameterCoordinator` (deepspeed/runtime/zero/partitioned_param_coordinator.py,
0.19) decides from the *order* of module uses alone, never from timing, which gathers to issue:

- `fetch_sub_module` (line ~310): gather the module's parameters that are not available (one
  blocking call), then prefetch: pop the recorded parameter trace while the newly issued numel
  is below min(stage3_prefetch_bucket_size, max_live_parameters - available numel), and gather
  the popped, unavailable parameters in one call (line ~452);
- `release_sub_module` / `__params_to_release` (line ~494, ~640): after a use, a parameter is
  freed unless it is persistent (fewer than stage3_param_persistence_threshold elements), or a
  later use was already prefetched, or it is used again within stage3_max_reuse_distance
  elements of trace (counting every module's parameters, from the next use on);
- after the backward, everything not persistent is freed (`release_and_reset_all`).

So replaying that logic over the trace gives exactly DeepSpeed's gathers (`replay`, also what
the memory ledger keeps gathered); `ParameterGathers` issues them into a rank's program at the
modules' first ops, and the engine times them. Keys name a module's (non-persistent)
parameters; numel is per TP rank.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

from zsim.network.collective import CollectiveOp
from zsim.step.job import StageJob
from zsim.step.program import Category, Comm, Group, ProgramWriter, Stream, Task
from zsim.step.zero3_host import HostChain
from zsim.workload.layout import layer_passes
from zsim.workload.mechanisms import Mechanism
from zsim.workload.model import ComputeOp, Layer, ModelSpec, module_of
from zsim.workload.parallel import ParallelConfig, ZeroKnobs, ZeroStage

Key = tuple[str, str]  # (layer, module)


@dataclass(frozen=True)
class Use:
    """One module invocation: the parameters it needs (all of the module's, numel)."""

    key: Key
    numel: int  # elements gathered (its non-persistent parameters)
    span: int  # all its elements: what DeepSpeed's reuse-distance walk counts
    persistent: bool
    forward: bool = True  # a use in the forward (else in the backward, with any replay)
    tensors: int = 1  # parameters gathered (its non-persistent ones)


@dataclass(frozen=True)
class Gather:
    """One all-gather call issued at trace position `at`."""

    at: int
    keys: tuple[Key, ...]
    numel: int
    blocking: bool  # the module's own fetch (the compute waits right away)
    tensors: int = 1  # parameters in the call

    @property
    def coalesced(self) -> bool:
        """More than one parameter: `all_gather_coalesced` gathers into one flat buffer, and
        the first `wait()` copies each parameter out of it (partition_parameters.py
        `AllGatherCoalescedHandle.wait`: `torch.cat` of its per-rank pieces); one parameter
        is gathered into its own buffer and viewed (`_all_gather_sequential`)."""
        return self.tensors > 1


@dataclass
class Replay:
    gathers: list[Gather] = field(default_factory=list)
    peak_available_numel: int = 0  # gathered parameters alive at once (for the ledger)


def replay(trace: Sequence[Use], knobs: ZeroKnobs) -> Replay:
    """Gathers DeepSpeed issues over `trace` (forward uses then backward uses)."""
    out = Replay()
    persistent_numel = sum({u.key: u.span - u.numel for u in trace}.values())
    available: dict[Key, int] = {}
    n_available = persistent_numel
    queue = [i for i, u in enumerate(trace) if not u.persistent]
    head = 0  # next queue entry to pop
    prefetched_for: dict[Key, int] = {}

    for j, use in enumerate(trace):
        if use.persistent:
            continue
        while head < len(queue) and queue[head] <= j:
            head += 1
        if use.key not in available:
            available[use.key] = use.numel
            n_available += use.numel
            out.gathers.append(Gather(j, (use.key,), use.numel, True, use.tensors))
        budget = min(knobs.prefetch_bucket_size, knobs.max_live_parameters - n_available)
        batch: dict[Key, int] = {}
        issued = tensors = 0
        while head < len(queue) and issued < budget:
            ahead = trace[queue[head]]
            head += 1
            prefetched_for[ahead.key] = max(prefetched_for.get(ahead.key, -1), queue[head - 1])
            if ahead.key not in available and ahead.key not in batch:
                batch[ahead.key] = ahead.numel
                issued += ahead.numel
                tensors += ahead.tensors
        if batch:
            available.update(batch)
            n_available += issued
            out.gathers.append(Gather(j, tuple(batch), issued, False, tensors))
        out.peak_available_numel = max(out.peak_available_numel, n_available)
        if _released(trace, j, use.key, knobs.max_reuse_distance, prefetched_for):
            n_available -= available.pop(use.key)
    return out


def _released(
    trace: Sequence[Use], j: int, key: Key, max_reuse: int, prefetched_for: dict[Key, int]
) -> bool:
    if prefetched_for.get(key, -1) > j:
        return False  # a later use was already prefetched: DeepSpeed keeps it
    traversed = 0
    for later in trace[j + 1 :]:
        if traversed >= max_reuse:
            break
        if later.key == key:
            return False
        traversed += later.span
    return True


def module_numels(layer: Layer, module: str, cfg: ParallelConfig) -> tuple[int, int, int]:
    """(elements to gather, all elements, parameters to gather) of a submodule's parameters
    on one TP rank; parameters of at most stage3_param_persistence_threshold elements stay
    gathered."""
    threshold = cfg.knobs.param_persistence_threshold
    sizes = [t.per_rank(cfg.tp) for t in layer.tensors if module_of(t) == module]
    gathered = [n for n in sizes if n > threshold]
    return sum(gathered), sum(sizes), len(gathered)


def module_trace(model: ModelSpec, cfg: ParallelConfig, layers: Sequence[Layer]) -> list[Use]:
    """The module uses of one micro-step (forward, then backward with any recompute), in the
    order DeepSpeed's hooks fire: one use per run of kernels reading the same submodule."""
    found: dict[tuple[object, ...], tuple[list[_Run], list[_Run]]] = {}
    trace: list[Use] = []
    for forward, order in ((True, layers), (False, tuple(reversed(layers)))):
        for layer in order:
            shape = (layer.kind, *((t.name, t.per_rank(cfg.tp)) for t in layer.tensors))
            if shape not in found:  # alike layers (a model's blocks) use their modules alike
                found[shape] = _module_runs(model, cfg, layer)
            for module, gathered, total, tensors in found[shape][0 if forward else 1]:
                key = (layer.name, module)
                trace.append(Use(key, gathered, total, not gathered, forward, tensors))
    return trace


_Run = tuple[str, int, int, int]  # (module, elements to gather, all elements, tensors)


def _module_runs(
    model: ModelSpec, cfg: ParallelConfig, layer: Layer
) -> tuple[list[_Run], list[_Run]]:
    """A layer's module uses in its forward and in its backward (replay first)."""
    p = layer_passes(model, cfg, layer)
    sides: list[list[_Run]] = []
    for ops in (p.forward, p.replay + p.backward):
        runs: list[_Run] = []
        previous: str | None = None
        for op in ops:
            for module in op.modules:
                gathered, total, tensors = module_numels(layer, module, cfg)
                if total and module != previous:
                    runs.append((module, gathered, total, tensors))
                    previous = module
        sides.append(runs)
    return sides[0], sides[1]


class ParameterGathers:
    """ZeRO-3's gathers in one rank's program: those DeepSpeed issues at each trace position
    of the current micro-step, and those in flight, which a module's first op waits for."""

    def __init__(self, job: StageJob, writer: ProgramWriter) -> None:
        self.job = job
        self.writer = writer
        self._at: dict[int, list[Gather]] = {}  # trace position -> gathers issued there
        self._inflight: dict[Key, Task] = {}
        self._blocking: list[Task] = []  # the module's own fetch, which a prefetch follows
        self._position = 0
        self._current: Key | None = None
        self._trace: list[Use] = []
        self._micro_steps = 0
        self._quantized: dict[int, float] = {}  # a quantized gather -> elements it gathers
        # a coalesced gather -> (elements it copies out, its parameters, its group's ranks)
        self._coalesced: dict[int, tuple[int, int, int]] = {}
        self._waited: dict[int, Task] = {}  # a gather -> what its first wait() ends with
        self._copies: list[Task] = []  # the allgather stream's last copy-out
        self.host = HostChain(job, writer)  # the rank walks (zsim.step.zero3_host)

    def start(self, layers: Sequence[Layer]) -> None:
        """Replay DeepSpeed's coordinator over this micro-step (forward + backward)."""
        cfg = self.job.cfg
        self._at = {}
        self._trace = module_trace(self.job.model, cfg, layers)
        for g in replay(self._trace, cfg.knobs).gathers:
            self._at.setdefault(g.at, []).append(g)
        self._position = 0
        self._current = None
        self._micro_steps += 1

    def enter(self, layer: Layer, forward: bool, last: list[Task], tag: str) -> list[Task]:  # noqa: ARG002
        return []  # the coordinator acts per submodule (`use`), not per layer

    def use(self, layer: Layer, op: ComputeOp, last: list[Task], tag: str) -> list[Task]:
        """At a module's first op, as `fetch_sub_module` does: issue its blocking fetch, wait
        for its parameters (the handle's first wait copies a coalesced gather out), then
        issue one prefetch bucket."""
        cfg = self.job.cfg
        if cfg.zero_stage is not ZeroStage.PARAMETERS or not op.modules:
            return []
        waits: list[Task] = []
        for module in op.modules:
            key = (layer.name, module)
            if key == self._current or not module_numels(layer, module, cfg)[1]:
                continue
            self._current = key
            issued = self._at.pop(self._position, [])
            for g in (g for g in issued if g.blocking):
                self._blocking = [self._issue_into_flight(g, last, tag)]
            if key in self._inflight:
                waits.append(self._ready(self._inflight.pop(key), tag))
            for g in (g for g in issued if not g.blocking):
                self._issue_into_flight(g, [*last, *self._blocking], tag)
            self._blocking = []
            self._position += 1
        return [*waits, *self.host.issued()]  # its kernels: launched after the host's work

    def _issue_into_flight(self, g: Gather, deps: list[Task], tag: str) -> Task:
        """Issue `g` from the allgather stream: its NCCL stream first waits for the work
        enqueued there before (ProcessGroupNCCL syncs with the current stream)."""
        group, ranks = self._group(g)
        if g.coalesced and not self.job.cfg.knobs.quantized_weights:
            views = self.host.charge("gather_issue", ranks, 1, [])
            deps = [*deps, *([views] if views else [])]
        task = self._issue(g, group, ranks, [*deps, *self._copies], tag)
        for k in g.keys:
            self._inflight[k] = task
        if g.coalesced:
            self._coalesced[id(task)] = (g.numel, g.tensors, ranks)
        return task

    def _ready(self, gather: Task, tag: str) -> Task:
        """What a module waits for: the gather's handle once its first `wait()` is done
        (later waits on the handle return at once), which dequantizes a quantized gather and
        copies a coalesced one out into its parameters."""
        done = self._waited.get(id(gather))
        if done is None:
            done = self._copied_out(gather, self._dequantized(gather, tag), tag)
            self._waited[id(gather)] = done
        return done

    def _copied_out(self, gather: Task, done: Task, tag: str) -> Task:
        """`AllGatherCoalescedHandle.wait` builds each parameter with `torch.cat` of its
        pieces from the flat buffer: a copy of every gathered element, on the allgather
        stream where the coordinator waits (partitioned_param_coordinator.py:400-406), which
        NCCL's own stream (the gathers) does not wait for, but the next gather issued does;
        on gloo the host's own copy, which blocks it."""
        coalesced = self._coalesced.pop(id(gather), None)
        if coalesced is None:
            return done
        elements, tensors, ranks = coalesced
        cat, deps = Category.PARAM_GATHER, [done]
        if not self.job.cfg.knobs.quantized_weights:  # the host's views and cats, throttled
            views = self.host.charge("gather_wait", ranks, tensors, self._copies)
            deps += [views] if views else []
        stream = Stream.COMPUTE if self.job.gloo else Stream.ALLGATHER
        if not self.job.cfg.models(Mechanism.GATHER_COPY_OUT):
            return (
                self.writer.compute(f"{tag}.waited", 0.0, cat, deps, stream) if deps[1:] else done
            )
        seconds = self.job.device.copy_time_s(elements * self.job.element_bytes, self.job.dtype)
        copy = self.writer.compute(f"{tag}.gather_copy_out", seconds, cat, deps, stream)
        self._copies = [copy]  # the NCCL stream of a later gather waits for it (issued after)
        return copy

    def _group(self, g: Gather) -> tuple[Group, int]:
        """The group a gather runs on and its ranks: the data-parallel group, or with ZeRO++'s
        hpZ the rank's secondary group once the parameters have their secondary partition
        (all but the first forward after an optimizer step, which frees them: stage3.py
        `invalidate_secondary_tensor`; partition_parameters.py picks the group by it)."""
        job, knobs = self.job, self.job.cfg.knobs
        first_forward = self._micro_steps == 1 and self._trace[g.at].forward
        if knobs.hpz_partition_size > 1 and not first_forward:
            return Group.HPZ, knobs.hpz_partition_size
        return Group.DP, job.cfg.dp

    def _issue(self, g: Gather, group: Group, ranks: int, deps: list[Task], tag: str) -> Task:
        """One all-gather call on its group (`_group`: `ranks` of them); with qwZ as int8
        values and fp32 scales, two calls, the shard quantized first."""
        job, knobs = self.job, self.job.cfg.knobs
        padded = job.padded(g.numel)  # padded to dp even for hpZ's secondary (PP:1693)
        name, cat = f"{tag}.gather", Category.PARAM_GATHER
        if not knobs.quantized_weights:
            comm = Comm(CollectiveOp.ALL_GATHER, padded * job.element_bytes, group)
            return self.writer.comm(name, comm, cat, deps, Stream.GATHER)
        shard = padded / ranks
        seconds = job.device.copy_time_s(1.5 * shard, job.dtype)  # read 2 B, write 1 B each
        quantize = self.writer.compute(f"{name}.quantize", seconds, cat, deps, Stream.GATHER)
        values = Comm(CollectiveOp.ALL_GATHER, padded, group)  # int8
        scales = Comm(CollectiveOp.ALL_GATHER, ranks * 4 * quantizer_groups(shard), group)
        task = self.writer.comm(name, values, cat, [quantize], Stream.GATHER)
        task = self.writer.comm(f"{name}.scales", scales, cat, [task], Stream.GATHER)
        self._quantized[id(task)] = padded
        return task

    def _dequantized(self, gather: Task, tag: str) -> Task:
        """What a module waits for: its gather, or, quantized, the gather's dequantize to
        fp16, run once on the consuming stream when first waited for (`handle.wait()`)."""
        elements = self._quantized.pop(id(gather), None)
        if elements is None:
            return gather
        seconds = self.job.device.copy_time_s(1.5 * elements, self.job.dtype)  # 1 B in, 2 out
        return self.writer.compute(
            f"{tag}.dequantize", seconds, Category.PARAM_GATHER, [gather], Stream.COMPUTE
        )


@functools.cache
def quantizer_groups(shard: float) -> int:
    """qwZ's quantization groups for a rank's shard of `shard` elements (partition_parameters
    .py `_get_quantization_groups`): the fewest, of at most 8,000 elements each, that split it
    into whole groups of a multiple of 8 elements, i.e. the least divisor of shard / 8 not
    below shard / 8,000. DeepSpeed asserts the shard is a multiple of 8; for one that is not
    (zsim pads a gather to dp only) the 8,000-element bound alone."""
    n = int(shard)
    least = max(1, -(-n // 8000))
    if n % 8 or n < 8:
        return least
    m, best, d = n // 8, n // 8, 1
    while d * d <= m:
        if m % d == 0:
            best = min([best, *(c for c in (d, m // d) if c >= least)])
        d += 1
    return best
