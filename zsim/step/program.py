"""The program of one rank: the tasks it issues, in issue order, each on a stream.

Tasks of one stream run one after another, as on a CUDA stream, once their dependencies are
done. A task is either compute (a duration from the device profile) or communication (a
collective over a process group, or a pipeline send/recv), which the engine runs on the flow
network. A `ProgramWriter` is how the step's parts add tasks; a `PartTimer` times work of fixed
durations as streams would run it, for passes fused into one task.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import NamedTuple, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from zsim.cluster.build import FloatArray, IntArray
from zsim.cluster.device import DeviceProfile
from zsim.network.collective import CollectiveOp


class Stream(StrEnum):
    COMPUTE = "compute"
    REDUCE = "reduce"  # DeepSpeed's reduction stream (overlap_comm)
    GATHER = "gather"  # ZeRO-3 parameter all-gathers (prefetch): their NCCL stream
    ALLGATHER = "allgather"  # DeepSpeed's allgather stream: ZeRO-3's wait() work (copy-out)
    TP = "tp"  # Megatron's async input-gradient all-reduce, overlapped with wgrad
    P2P = "p2p"  # pipeline sends
    PCIE = "pcie"  # offload copies
    HOST = "host"  # the optimizer step on the CPU (offload)
    ALLREDUCE = "allreduce"  # FSDP's all-reduce stream (a hybrid mesh's replicas)
    CP = "cp"  # TE's context-parallel key/value exchanges, beside the attention steps


class Category(StrEnum):
    FORWARD = "forward"
    BACKWARD = "backward"
    RECOMPUTE = "recompute"
    OPTIMIZER = "optimizer"
    TP_COMM = "tp_comm"
    CP_COMM = "cp_comm"
    FP8_AMAX = "fp8_amax"  # TransformerEngine's amax reductions (delayed scaling)
    GRAD_REDUCE = "grad_reduce"
    PARAM_GATHER = "param_gather"
    PP_COMM = "pp_comm"
    OFFLOAD = "offload"
    HOST = "host"  # the host thread's own work that kernels wait for (ZeRO-3's rank walks)


class Group(StrEnum):
    """Which process group of the rank a collective runs in."""

    TP = "tp"
    DP = "dp"
    PP = "pp"  # send/recv to the neighbouring stage
    EMBEDDING = "embedding"  # first and last pipeline stage (tied embedding gradients)
    HPZ = "hpz"  # ZeRO++'s secondary partition: consecutive data-parallel ranks (hpZ)
    SHARD = "shard"  # FSDP's hybrid mesh: the consecutive data-parallel ranks that shard
    REPLICA = "replica"  # ... and the ranks across them that hold the same shard
    NODE = "node"  # ZeRO++'s qgZ: the GPUs of one node (DeepSpeed's `local_<node>` group)
    ACROSS = "across"  # ... and the same GPU of every node (its `global_<gpu>` group)
    CP = "cp"  # context parallelism's ring: consecutive data-parallel ranks (`cp` of them)
    STAGE = "stage"  # every rank of the pipeline stage (TP x DP x CP: FP8's amax reductions)


class Comm(NamedTuple):
    """A communication call. `nbytes` follows nccl-tests: the full buffer for all-reduce,
    the output of all-gather, the input of reduce-scatter, the message of a send. (A
    NamedTuple: a pipeline step makes one per send and receive.)"""

    op: CollectiveOp
    nbytes: float
    group: Group
    peer: int = 0  # send/recv: +1 to the next virtual stage, -1 to the previous
    tag: str = ""  # matches a send with its receive
    root: int = 0  # reduce: the owner (index in the group)


class Part(NamedTuple):
    """A piece of a fused task: what ran, on which stream, from `start_s` after it began.
    (A NamedTuple: a 175B step has hundreds of thousands of them.)"""

    name: str
    category: Category
    stream: Stream
    start_s: float
    duration_s: float
    comm: Comm | None = None
    sm_share: float = 0.0  # of its time, what runs on the SMs (GEMMs, attention: `Task`)


@dataclass(eq=False, slots=True)
class Task:
    name: str
    stream: Stream
    category: Category
    duration_s: float = 0.0
    comm: Comm | None = None
    deps: list[Task] = field(default_factory=list)
    receives: bool = False  # a recv: completes when the matching send's data has arrived
    index: int = 0
    parts: tuple[Part, ...] = ()  # set when consecutive fixed-time tasks were fused
    micro_batch: int = -1  # the micro-batch whose pipeline work issued it (-1: the step's)
    # of a compute task's time, the share its SM-bound kernels take (GEMMs, attention): the
    # part that slows while an NCCL kernel holds SMs (`step.sm_hold`); bandwidth-bound ones not
    sm_share: float = 0.0

    def __repr__(self) -> str:
        return f"Task({self.index}:{self.name})"


class TaskColumns(NamedTuple):
    """A program's tasks as columns, by task index: what the hand-over from the prefix reads
    of tens of thousands of tasks at once (`zsim.step.handover`)."""

    category: IntArray  # index into `categories`
    categories: tuple[str, ...]
    host: npt.NDArray[np.bool_]  # on the host stream
    kind: IntArray  # a fused pass's index into `kinds`, -1 for other tasks
    kinds: tuple[tuple[Part, ...], ...]  # the distinct parts tuples of the fused passes
    send_kind: IntArray  # a send's index into `send_kinds`, -1 for other tasks
    send_kinds: tuple[Task, ...]  # a send of each (bytes, peer, category)
    duration: FloatArray

    @property
    def sends(self) -> npt.NDArray[np.bool_]:
        """The point-to-point sends (not their receives)."""
        return self.send_kind >= 0


@dataclass
class Program:
    """The tasks of one rank of one pipeline stage, in issue order."""

    stage: int
    tasks: list[Task] = field(default_factory=list)
    micro_batch: int = -1  # stamped on the tasks added (`ProgramWriter.micro_batch`)
    _streams: dict[Stream, list[Task]] | None = field(default=None, repr=False, compare=False)
    _columns: TaskColumns | None = field(default=None, repr=False, compare=False)

    def add(self, task: Task) -> Task:
        task.index = len(self.tasks)
        task.micro_batch = self.micro_batch
        self.tasks.append(task)
        self._streams = self._columns = None
        return task

    def columns(self) -> TaskColumns:
        """The tasks as columns (kept, as every simulated rank of the stage asks)."""
        if self._columns is None:
            self._columns = _columns(self.tasks)
        return self._columns

    def streams(self) -> dict[Stream, list[Task]]:
        """The tasks of each stream in issue order (receives run on none: they wait for their
        data); kept, as every simulated rank of the stage asks."""
        if self._streams is None:
            self._streams = {}
            for task in self.tasks:
                if not task.receives:
                    self._streams.setdefault(task.stream, []).append(task)
        return self._streams


def _columns(tasks: Sequence[Task]) -> TaskColumns:
    kinds: dict[int, int] = {}  # id of a fused pass's parts -> its kind
    sends: dict[tuple[float, int, Category], int] = {}  # (bytes, peer, category) -> its kind
    by_kind: list[tuple[Part, ...]] = []
    by_send: list[Task] = []
    kind, send_kind = [-1] * len(tasks), [-1] * len(tasks)
    for task in tasks:  # one pass: a pipeline stage has thousands of tasks
        comm = task.comm
        if task.parts:
            if id(task.parts) not in kinds:
                kinds[id(task.parts)] = len(by_kind)
                by_kind.append(task.parts)
            kind[task.index] = kinds[id(task.parts)]
        elif comm is not None and comm.op is CollectiveOp.SEND_RECV and not task.receives:
            key = (comm.nbytes, comm.peer, task.category)
            if key not in sends:
                sends[key] = len(by_send)
                by_send.append(task)
            send_kind[task.index] = sends[key]
    categories: dict[Category, int] = {}
    category = [categories.setdefault(t.category, len(categories)) for t in tasks]
    return TaskColumns(
        np.array(category, dtype=np.int64),
        tuple(str(c) for c in categories),
        np.array([t.stream is Stream.HOST for t in tasks], dtype=bool),
        np.array(kind, dtype=np.int64),
        tuple(by_kind),
        np.array(send_kind, dtype=np.int64),
        tuple(by_send),
        np.array([t.duration_s for t in tasks], dtype=float),
    )


# ---- emitting work: as tasks, or as timed parts of one fused task ---------------------------

H = TypeVar("H")


class Emitter(Protocol[H]):
    def compute(
        self,
        name: str,
        seconds: float,
        category: Category,
        deps: Sequence[H],
        stream: Stream = Stream.COMPUTE,
        sm_share: float = 0.0,
    ) -> H: ...

    def comm(
        self,
        name: str,
        comm: Comm,
        category: Category,
        deps: Sequence[H],
        stream: Stream = Stream.COMPUTE,
    ) -> H: ...


class PartTimer:
    """Times work with fixed durations as streams would run it; handles are end times."""

    def __init__(self, comm_time: Callable[[Comm], float]) -> None:
        self.comm_time = comm_time
        self.parts: list[Part] = []
        self.free: dict[Stream, float] = {}

    def compute(
        self,
        name: str,
        seconds: float,
        category: Category,
        deps: Sequence[float],
        stream: Stream = Stream.COMPUTE,
        sm_share: float = 0.0,
        comm: Comm | None = None,
    ) -> float:
        start = max([self.free.get(stream, 0.0), *deps])
        self.free[stream] = start + seconds
        if seconds > 0:
            self.parts.append(Part(name, category, stream, start, seconds, comm, sm_share))
        return start + seconds

    def comm(
        self,
        name: str,
        comm: Comm,
        category: Category,
        deps: Sequence[float],
        stream: Stream = Stream.COMPUTE,
    ) -> float:
        return self.compute(name, self.comm_time(comm), category, deps, stream, comm=comm)


class ProgramWriter:
    """Appends tasks to one rank's program; every part of the step adds its work through it.

    On gloo (`gloo`), DeepSpeed's streams are no-ops and its calls block, so work DeepSpeed puts
    on its reduction or TP stream runs on the compute stream.
    """

    def __init__(self, stage: int, device: DeviceProfile, dtype: str, gloo: bool) -> None:
        self.program = Program(stage)
        self.device = device
        self.dtype = dtype
        self.gloo = gloo

    def micro_batch(self, index: int) -> None:
        """The micro-batch the tasks added from now on work for (-1: the step as a whole)."""
        self.program.micro_batch = index

    def compute(
        self,
        name: str,
        seconds: float,
        category: Category,
        deps: Sequence[Task],
        stream: Stream = Stream.COMPUTE,
        sm_share: float = 0.0,
    ) -> Task:
        task = Task(name, stream, category, seconds, deps=list(deps), sm_share=sm_share)
        return self.program.add(task)

    def comm(
        self,
        name: str,
        comm: Comm,
        category: Category,
        deps: Sequence[Task],
        stream: Stream = Stream.COMPUTE,
    ) -> Task:
        if self.gloo and stream in (Stream.REDUCE, Stream.TP):
            stream = Stream.COMPUTE  # DeepSpeed's CPU accelerator has no real streams
        return self.program.add(Task(name, stream, category, comm=comm, deps=list(deps)))

    def fused(
        self,
        name: str,
        category: Category,
        parts: tuple[Part, ...],
        seconds: float,
        deps: list[Task],
    ) -> Task:
        """A pass of fixed-time work as one task: its parts keep their own timing; its SM
        share is its kernels' over the pass."""
        on_sms = sum(p.duration_s * p.sm_share for p in parts)
        share = on_sms / seconds if seconds > 0 else 0.0
        task = Task(name, Stream.COMPUTE, category, seconds, deps=deps, parts=parts, sm_share=share)
        return self.program.add(task)

    def memory_pass(
        self, name: str, nbytes: float, deps: Sequence[Task], stream: Stream = Stream.COMPUTE
    ) -> Task:
        """Bandwidth-bound bookkeeping (copies, scaling in place) of `nbytes` copied."""
        seconds = self.device.copy_time_s(nbytes, self.dtype)
        return self.compute(name, seconds, Category.OPTIMIZER, deps, stream)

    def recv(self, tag: str, nbytes: float, peer: int) -> Task:
        comm = Comm(CollectiveOp.SEND_RECV, nbytes, Group.PP, peer, tag)
        task = Task(f"recv.{tag}", Stream.P2P, Category.PP_COMM, comm=comm, receives=True)
        return self.program.add(task)

    def send(self, tag: str, nbytes: float, peer: int, deps: list[Task], stream: Stream) -> Task:
        comm = Comm(CollectiveOp.SEND_RECV, nbytes, Group.PP, peer, tag)
        return self.comm(f"send.{tag}", comm, Category.PP_COMM, deps, stream)
