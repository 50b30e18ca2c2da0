"""PyTorch FSDP2's data parallelism (`torch.distributed.fsdp.fully_shard`, read in torch 2.13:
`_fully_shard/_fsdp_param_group.py`, `_fsdp_collectives.py`, `_fsdp_state.py`), as torchtitan
wraps a model: each block (or MLP layer) is a unit of its own, the root `fully_shard(model)`
holds the rest (embedding, final norm, LM head). Mixed precision as torchtitan's default
`MixedPrecisionPolicy(param_dtype=<training dtype>, reduce_dtype=float32)`.

- Forward: a unit's `pre_forward` all-gathers its parameters on the all-gather stream (the
  shard cast to param_dtype in the copy-in) and the compute stream copies the gathered buffer
  out into the unsharded parameters (`foreach_all_gather_copy_out`). The host runs ahead of
  the device, so each unit's all-gather is issued at once (implicit prefetch), but
  `wait_for_unshard` keeps the previous gather's result alive and makes the all-gather streams
  wait for the copy-out before it: unit u's gather waits for unit u-2's copy-out.
  `post_forward` frees a unit's parameters (FULL_SHARD, HYBRID_SHARD) except the root's,
  whose `reshard_after_forward` lazy init sets to False.
- Backward: `pre_backward` gathers a freed unit (before any recompute, which runs inside the
  hook's unit), copies it out and prefetches the next unit in backward order, whose gather
  waits for that copy-out (`_backward_prefetch`). `post_backward` first makes the compute
  stream wait for the previous unit's reduce-scatter (`reduce_scatter_max_input_buffers` = 1),
  copies the unit's gradients into the reduce-scatter input in fp32 (on the compute stream),
  reduce-scatters it on the reduce-scatter stream, with HYBRID_SHARD all-reduces the shard
  across replicas, and adds it into the fp32 sharded gradient. Every micro-batch reduces (no
  `set_requires_gradient_sync(False)`); the root's post-backward runs at the backward's end.
  `finalize_backward`: the compute stream waits for the last reduction.
- The optimizer updates the fp32 shard in place; the next forward's gathers cast it anew, so
  there is no post-step gather.

Every collective runs on the shard group (the data-parallel group unless hybrid). On gloo
(CPU) the calls block the host, so every one runs on the compute stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from zsim.network.collective import CollectiveOp
from zsim.step.job import StageJob
from zsim.step.program import Category, Comm, Group, ProgramWriter, Stream, Task
from zsim.workload.model import WORD_EMBEDDING, ComputeOp, Layer
from zsim.workload.parallel import ParallelConfig
from zsim.workload.sharding import UNIT_KINDS, FsdpSharding, is_unit

REDUCE_BYTES = 4  # reduce_dtype float32
SHARD_BYTES = 4  # the sharded parameters, gradients and Adam moments stay fp32


@dataclass(frozen=True)
class Unit:
    """One `fully_shard` group: the layers whose parameters it gathers and reduces together."""

    index: int  # forward order; 0 is the root
    layers: tuple[str, ...]
    numel: int  # parameters per TP rank

    @property
    def root(self) -> bool:
        return self.index == 0


def units(layers: Sequence[Layer], tp: int) -> list[Unit]:
    """The root (every layer that is not a block or an MLP layer; it may hold nothing), then
    one unit per block, each at its index."""
    root = [x for x in layers if x.kind not in UNIT_KINDS and x.tensors]
    out = [Unit(0, tuple(x.name for x in root), sum(x.params(tp) for x in root))]
    for x in filter(is_unit, layers):
        out.append(Unit(len(out), (x.name,), x.params(tp)))
    return out


def param_bytes(cfg: ParallelConfig) -> int:
    """Bytes of a gathered parameter: param_dtype, the training dtype."""
    return cfg.precision.bytes


def padded(numel: float, ranks: int) -> float:
    """FSDP pads every parameter's dim 0 to the shard group; zsim pads the unit's total."""
    return -(-numel // ranks) * ranks


def resharded_after_forward(cfg: ParallelConfig, unit: Unit) -> bool:
    return not unit.root and cfg.fsdp_sharding is not FsdpSharding.GRAD_OP


class _Units:
    """The rank's units and the group its collectives run on."""

    def __init__(self, job: StageJob, writer: ProgramWriter) -> None:
        self.job, self.writer = job, writer
        self.cfg = job.cfg
        layers = [x for chunk in job.chunks for x in chunk]
        self.units = units(layers, self.cfg.tp)
        self.of = {name: u for u in self.units for name in u.layers}
        hybrid = self.cfg.fsdp_sharding is FsdpSharding.HYBRID
        self.group = Group.SHARD if hybrid else Group.DP
        self.ranks = self.cfg.shard_ranks
        self.stream = Stream.COMPUTE if job.gloo else Stream.GATHER

    def copy_s(self, nbytes: float) -> float:
        return self.job.device.copy_time_s(nbytes, self.job.dtype)


class FsdpUnshard(_Units):
    """FSDP's all-gathers in one rank's program, at each unit's pre-forward and pre-backward
    hook (the `ParameterGathers` interface: `start` per micro-step, `enter` per layer)."""

    def __init__(self, job: StageJob, writer: ProgramWriter) -> None:
        super().__init__(job, writer)
        self._ready: dict[int, Task] = {}  # unit -> its copy-out, while it is unsharded
        self._prefetched: dict[int, Task] = {}  # unit -> its gather issued ahead
        self._copies: list[Task] = []  # this forward's copy-outs, in order

    def start(self, layers: Sequence[Layer]) -> None:  # noqa: ARG002 (the interface's)
        """A micro-step's forward begins: the last backward (or step) resharded every unit."""
        self._ready, self._prefetched, self._copies = {}, {}, []

    def use(self, layer: Layer, op: ComputeOp, last: list[Task], tag: str) -> list[Task]:  # noqa: ARG002
        return []  # FSDP's hooks act per unit (`enter`), not per submodule

    def enter(self, layer: Layer, forward: bool, last: list[Task], tag: str) -> list[Task]:
        """What `layer`'s pass waits for: its unit's parameters, gathered at the unit's
        pre-forward or pre-backward hook (the root's before the first layer's forward)."""
        unit = self.of.get(layer.name)
        if unit is None or self.ranks == 1:
            return []
        root = self.units[0]
        if forward and root.numel and root.index not in self._ready:
            self._gather_forward(root, last, tag)  # the root's pre_forward runs first
        if forward:
            ready = self._ready.get(unit.index)
            return [ready or self._gather_forward(unit, last, tag)]
        if not self._resharded(unit):
            return []  # unsharded since its forward
        return [self._gather_backward(unit, last, tag)]

    def _resharded(self, unit: Unit) -> bool:
        return resharded_after_forward(self.cfg, unit)

    def _gather_forward(self, unit: Unit, last: list[Task], tag: str) -> Task:
        waits = last if self.job.gloo else self._copies[-2:-1]
        copy = self._copy_out(unit, self._all_gather(unit, waits, tag), last, tag)
        self._copies.append(copy)
        return copy

    def _gather_backward(self, unit: Unit, last: list[Task], tag: str) -> Task:
        gather = self._prefetched.pop(unit.index, None)
        if gather is None:
            gather = self._all_gather(unit, last, tag)
        copy = self._copy_out(unit, gather, last, tag)
        earlier = reversed(self.units[1 : unit.index])
        ahead = next((u for u in earlier if u.numel and self._resharded(u)), None)
        if ahead is not None and ahead.index not in self._prefetched:
            deps = [copy, *last] if self.job.gloo else [copy]
            self._prefetched[ahead.index] = self._all_gather(ahead, deps, tag)
        return copy

    def _all_gather(self, unit: Unit, deps: list[Task], tag: str) -> Task:
        """The copy-in (the fp32 shard cast into the gather's input) and the gather."""
        numel = padded(unit.numel, self.ranks)
        b = param_bytes(self.cfg)
        cast = self.copy_s(numel / self.ranks * (SHARD_BYTES + b) / 2)
        cat = Category.PARAM_GATHER
        copy_in = self.writer.compute(f"{tag}.gather_copy_in", cast, cat, deps, self.stream)
        comm = Comm(CollectiveOp.ALL_GATHER, numel * b, self.group)
        return self.writer.comm(f"{tag}.gather", comm, cat, [copy_in], self.stream)

    def _copy_out(self, unit: Unit, gather: Task, last: list[Task], tag: str) -> Task:
        seconds = self.copy_s(padded(unit.numel, self.ranks) * param_bytes(self.cfg))
        deps = [gather, *last]
        copy = self.writer.compute(f"{tag}.gather_copy_out", seconds, Category.PARAM_GATHER, deps)
        self._ready[unit.index] = copy
        return copy


class FsdpReduce(_Units):
    """FSDP's gradient reductions on one rank, at each unit's post-backward hook (the
    `Reducer` interface)."""

    def __init__(self, job: StageJob, writer: ProgramWriter) -> None:
        super().__init__(job, writer)
        self._waiting: dict[int, int] = {}
        self._latest: list[Task] = []  # the backward's last layer
        self._last: Task | None = None  # the previous unit's reduce-scatter
        self._issued: list[Task] = []

    def start_backward(self, boundary: bool) -> bool:  # noqa: ARG002 (every micro-batch)
        self._waiting = {u.index: len(u.layers) for u in self.units}
        return self.cfg.dp > 1

    def pending(self) -> list[Task]:
        return list(self._issued)

    def grads_ready(self, layer: Layer, done: Task) -> Task | None:
        unit = self.of.get(layer.name)
        self._latest = [done]
        if unit is None:
            return None
        self._waiting[unit.index] -= 1
        if self._waiting[unit.index] or unit.root:
            return None  # the root's post-backward runs at the backward's end (`flush`)
        return self._reduce(unit, [done])

    def flush(self, deps: Sequence[Task] = ()) -> None:
        """The root's post-backward, once autograd reaches the model's input."""
        root = self.units[0]
        if root.numel:
            self._reduce(root, [*deps, *self._latest])

    def boundary_reduce(self, deps: list[Task]) -> list[Task]:
        """`finalize_backward`: the compute stream waits for every reduction before the
        optimizer (each micro-batch reduced its own)."""
        return [*deps, *self._issued]

    def _reduce(self, unit: Unit, deps: list[Task]) -> Task:
        """The copy-in (after the previous unit's reduce-scatter: max_input_buffers = 1),
        the reduce-scatter, with a hybrid mesh the all-reduce of the shard across replicas,
        and the shard added into the fp32 sharded gradient."""
        cfg, writer = self.cfg, self.writer
        if self._last is not None:
            deps = [*deps, self._last]
        numel = padded(unit.numel, self.ranks)
        cast = (param_bytes(cfg) + REDUCE_BYTES) / 2 * numel  # unsharded grads -> fp32 input
        copy_in = writer.memory_pass("fsdp_grad_copy_in", cast, deps)
        gloo = self.job.gloo
        comm = Comm(CollectiveOp.REDUCE_SCATTER, numel * REDUCE_BYTES, self.group)
        stream = Stream.COMPUTE if gloo else Stream.REDUCE
        task = writer.comm("grad_reduce", comm, Category.GRAD_REDUCE, [copy_in], stream)
        self._last = task
        shard = numel / self.ranks
        if cfg.fsdp_sharding is FsdpSharding.HYBRID:
            across = Comm(CollectiveOp.ALL_REDUCE, shard * REDUCE_BYTES, Group.REPLICA)
            stream = Stream.COMPUTE if gloo else Stream.ALLREDUCE
            task = writer.comm("grad_allreduce", across, Category.GRAD_REDUCE, [task], stream)
        added = 1.5 * SHARD_BYTES * shard  # read both, write one
        self._issued.append(writer.memory_pass("fsdp_grad_accumulate", added, [task], stream))
        return copy_in


# ---- the memory ledger's FSDP terms ------------------------------------------------------


def model_state_bytes(params: float, cfg: ParallelConfig) -> tuple[float, float, float]:
    """(parameters, gradients, optimizer) bytes of `params` parameters on one rank: the fp32
    sharded parameters (the module's own, cast to param_dtype only in the gathers), fp32
    sharded gradients and Adam's two fp32 moments, each over the shard group."""
    shard = params / cfg.shard_ranks
    return SHARD_BYTES * shard, SHARD_BYTES * shard, 2 * SHARD_BYTES * shard


def buffer_bytes(cfg: ParallelConfig, layers: Sequence[Layer], tied: bool = False) -> float:
    """Unsharded tensors beside the shards at their peak, walked through the backward as
    torch 2.13's FSDP2 holds them (`_fsdp_param_group`; measured on the real engine,
    `validate.held.fsdp_in_flight`). The root's parameters stay unsharded from the forward's
    start to the backward's end. At each unit's post-backward: the root's gradients autograd
    has made by then (`early_root_numel`), the units gathered (with SHARD_GRAD_OP every unit
    not yet through its backward, kept from its forward; else the unit and the next one,
    prefetched), its unsharded gradients and the previous unit's fp32 reduce-scatter input
    (`reduce_scatter_max_input_buffers` 1), which is released only after this unit is
    resharded, before its own is made; with a hybrid mesh also the all-reduced shards of the
    units already reduced. Then the root's post-backward, after the embeddings' backward:
    every root gradient, and the first block's reduce-scatter input still held; and the
    root's copy into its own reduce-scatter input."""
    if cfg.dp == 1:
        return 0.0
    found = units(layers, cfg.tp)
    n, b = cfg.shard_ranks, param_bytes(cfg)
    root, blocks = padded(found[0].numel, n), [padded(u.numel, n) for u in found[1:]]
    keep_all = cfg.fsdp_sharding is FsdpSharding.GRAD_OP
    hybrid = cfg.fsdp_sharding is FsdpSharding.HYBRID
    peak = 0.0
    for i, block in enumerate(blocks):  # forward order; the backward runs from the last
        gathered = sum(blocks[: i + 1]) if keep_all else block + (blocks[i - 1] if i else 0.0)
        kept = blocks[i + 1] if i + 1 < len(blocks) else 0.0
        # a hybrid mesh: each reduced unit's fp32 shard, all-reduced across the replicas, is
        # held by its group until `finalize_backward`
        shards = REDUCE_BYTES * sum(blocks[i + 1 :]) / n if hybrid else 0.0
        at_post_backward = b * (gathered + block) + REDUCE_BYTES * kept + shards
        at_reduce = b * gathered + REDUCE_BYTES * block + shards  # its grads copied in
        peak = max(peak, at_post_backward, at_reduce)
    in_blocks = b * (root + padded(early_root_numel(layers, cfg.tp, tied), n)) + peak
    if not root:
        return in_blocks
    every_shard = REDUCE_BYTES * sum(blocks) / n if hybrid else 0.0  # all units reduced
    at_root = 2 * b * root + REDUCE_BYTES * (blocks[0] if blocks else 0.0) + every_shard
    at_root_reduce = (b + REDUCE_BYTES) * root + every_shard  # resharded; its grads copied in
    return max(in_blocks, at_root, at_root_reduce)


def early_root_numel(layers: Sequence[Layer], tp: int, tied: bool) -> int:
    """The root's parameters (per TP rank) whose gradients exist from the backward's start:
    those of the layers after the last unit (final norm, LM head) and a word embedding tied
    to the head, whose gradient waits in autograd's `AccumulateGrad` for the lookup's
    (`benchmarks/validation/diagnosis/tied_gradient.py`). The embeddings' own gradients come
    at the backward's end."""
    last = max((i for i, x in enumerate(layers) if is_unit(x)), default=-1)
    head = sum(x.params(tp) for x in layers[last + 1 :] if x.kind not in UNIT_KINDS)
    word = (t for x in layers[: last + 1] for t in x.tensors if t.name == WORD_EMBEDDING)
    return head + (sum(t.per_rank(tp) for t in word) if tied else 0)
