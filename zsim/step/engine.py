"""Runs the programs of a step on simpy: one process per stream of every simulated rank.

Ranks that are symmetric (every data- and tensor-parallel peer of a pipeline stage) run the
same program, so by default only one rank per pipeline stage is simulated. Its collectives
still put every member's flows on the network, and so do the replica groups (the same
collective in the other TP/DP groups) whose routes share a link with it, so contention is
what the full cluster would see. `full=True` simulates every rank: collectives then start
when all members have reached them.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import simpy

from zsim.cluster.grid import RankGrid
from zsim.network.collective import CollectiveCall, CollectiveOp
from zsim.network.communicator import Communicator
from zsim.step.groups import RankGroups
from zsim.step.handover import Tally, replay, resume
from zsim.step.prefix import Prefix, time_prefix
from zsim.step.program import Comm, Group, Part, Program, Stream, Task
from zsim.step.sm_hold import SmHold
from zsim.step.spans import EngineResult, FusedPass, Span, TaskBlock
from zsim.step.traffic import Traffic

_SendCalls = tuple[CollectiveCall, list[CollectiveCall]]  # a send and its replicas' sends


@dataclass
class _Rendezvous:
    arrived: int = 0
    done: simpy.Event | None = None


class Engine(RankGroups):
    def __init__(
        self,
        programs: Sequence[Program],
        grid: RankGrid,
        comms: Communicator,
        full: bool = False,
        virtual_stages: int = 1,
        slowdown: Mapping[int, float] | None = None,
        block: int = 1,
        cp: int = 1,
        sms: SmHold | None = None,
    ) -> None:
        super().__init__(grid, comms, full, block, cp)
        self.env = comms.env
        self.slowdown = dict(slowdown or {})  # rank -> factor on its kernels (a straggler)
        self.sms = sms  # NCCL's kernels hold SMs (`step.sm_hold`); None: not modelled
        self.held: dict[int, int] = {}  # rank -> SMs its running collectives hold
        self._sm_change: dict[int, simpy.Event] = {}  # rank -> fires when `held` changes
        self.v = virtual_stages
        self.spans: list[Span] = []
        self.passes: list[FusedPass] = []
        self.blocks: list[TaskBlock] = []  # the prefix's tasks, as columns (`handover.replay`)
        # rank -> by task index, whether it has ended; the end events someone waits for
        self.ended: dict[int, list[bool]] = {}
        self._ends: dict[tuple[int, int], simpy.Event] = {}
        self.pending: dict[tuple[object, ...], _Rendezvous] = {}
        # (rank, tag) -> what ends the rank's receive of that tag when its data arrives
        self.receivers: dict[tuple[int, str], Callable[[float], None]] = {}
        self.calls: dict[tuple[int, Group, Stream], itertools.count[int]] = {}
        self.traffic = Traffic(comms, self.simulated)
        self.tally = Tally()  # the passes' and sends' traffic, booked once per kind at the end
        self.programs = programs
        # rank -> by task index, when each task started and ended (its launch, for a collective)
        self.task_start: dict[int, list[float]] = {}
        self.task_end: dict[int, list[float]] = {}
        self._sends: dict[tuple[int, int], list[tuple[int, int]]] = {}
        self._send_calls: dict[tuple[int, float, int], _SendCalls] = {}
        self._expected: dict[int, int] = {}
        # (op, bytes, id of a cached group, root) -> the call, holding the group alive
        self._calls: dict[tuple[object, ...], tuple[CollectiveCall, tuple[int, ...]]] = {}

    # ---- running ----

    def run(self) -> EngineResult:
        """The prefix up to the first collective (`zsim.step.prefix`), the rest on simpy."""
        prefix = time_prefix(self)
        self.task_start, self.task_end = prefix.start, prefix.end  # the loop completes them
        for rank in self.ranks:  # a prefix may leave ranks out: none of their tasks timed
            tasks = len(self.programs[self.coords(rank)[1]].tasks)
            self.task_start.setdefault(rank, [math.nan] * tasks)
            self.task_end.setdefault(rank, [math.nan] * tasks)
        running = replay(self, prefix)
        for rank in self.ranks:
            program = self.programs[self.coords(rank)[1]]
            ended = self.ended[rank] = prefix.finished_mask(rank, len(program.tasks))
            resumed = {i for r, i in running if r == rank}
            for task in program.tasks:  # in issue order, as the processes start
                if task.index in resumed:
                    start = prefix.start[rank][task.index]
                    end = running[(rank, task.index)]
                    self.env.process(resume(self, rank, task, start, end))
                elif task.receives and not ended[task.index]:
                    self.receive(rank, task)
            for stream_tasks in program.streams().values():
                self._start_stream(rank, stream_tasks, prefix)
        self.env.run()
        ends = self.ended.items()
        unfinished = [(r, i) for r, ended in ends for i, e in enumerate(ended) if not e]
        if unfinished:
            raise RuntimeError(f"deadlock: {len(unfinished)} tasks never ran, e.g. {unfinished[0]}")
        self.tally.book(self)
        per_rank = {k: v / len(self.ranks) for k, v in self.traffic.sent.items()}
        links = self.traffic.by_link_class()
        return EngineResult(
            self.spans, self.env.now, self.ranks, per_rank, links, self.passes, blocks=self.blocks
        )

    def _start_stream(self, rank: int, tasks: list[Task], prefix: Prefix) -> None:
        """A stream's process from its first task the prefix did not start (a stream's tasks
        start in order, so those it started come first), after the last one it did."""
        ran = 0
        while ran < len(tasks) and prefix.ran(rank, tasks[ran].index):
            ran += 1
        if ran == len(tasks):
            return
        last = tasks[ran - 1].index if ran else None
        running = None if last is None or self.ended[rank][last] else self.end(rank, last)
        self.env.process(self.stream(rank, tasks[ran:], running))

    def stream(
        self, rank: int, tasks: list[Task], running: simpy.Event | None
    ) -> Generator[simpy.Event, Any, None]:
        """One stream of one rank: its tasks in issue order, each after its dependencies;
        `running`: the end of the prefix's task still running at the cut, if any (the stream
        is free when it ends)."""
        ended = self.ended[rank]
        if running is not None and not running.processed:
            yield running
        for task in tasks:
            waiting = [self.end(rank, d.index) for d in task.deps if not ended[d.index]]
            if waiting:  # dependencies already done cost no event
                yield waiting[0] if len(waiting) == 1 else self.env.all_of(waiting)
            start = self.env.now
            if task.comm is None:
                seconds = task.duration_s * self.kernel_factor(rank, task.stream)
                yield from self.run_compute(rank, task.sm_share, seconds)
            else:
                ctas = self.holds(rank, task)
                self.hold(rank, ctas)
                value = yield self.communicate(rank, task)
                self.hold(rank, -ctas)
                if task.comm.op is not CollectiveOp.SEND_RECV:
                    start = value  # its launch: waiting for the group's other members is idle
            if task.parts:
                self.record_parts(rank, task, start)
            else:
                self.record(rank, task, start, self.env.now)
            self.finish(rank, task)

    def run_compute(
        self, rank: int, sm_share: float, seconds: float
    ) -> Generator[simpy.Event, Any, None]:
        """A compute task of `seconds` alone, its SM-bound share slower while collectives
        hold SMs (`step.sm_hold`): it progresses at the rate of the moment, re-timed at each
        change."""
        if self.sms is None or sm_share <= 0.0:
            yield self.env.timeout(seconds)
            return
        left = seconds
        while left > 0.0:
            rate = self.sms.rate(self.held.get(rank, 0), sm_share)
            change = self._sm_change.get(rank)
            if change is None:
                change = self._sm_change[rank] = self.env.event()
            began, done = self.env.now, self.env.timeout(left / rate)
            yield done | change
            left = 0.0 if done.processed else left - (self.env.now - began) * rate

    def holds(self, rank: int, task: Task) -> int:
        """The SMs a collective task of `rank` holds while it runs."""
        comm = task.comm
        if self.sms is None or comm is None or not self.sms.beside(comm, task.stream):
            return 0
        return self.sms.ctas(comm, self.group_of(rank, comm.group))

    def hold(self, rank: int, ctas: int) -> None:
        """`rank`'s collectives take (or give back) `ctas` SMs: its compute re-times."""
        if not ctas:
            return
        self.held[rank] = self.held.get(rank, 0) + ctas
        change = self._sm_change.pop(rank, None)
        if change is not None:
            change.succeed()

    def kernel_factor(self, rank: int, stream: Stream) -> float:
        """How much slower `rank` runs tasks of `stream` than the profile says: a straggler's
        device work (its compute and reduction streams), not the host's or the PCIe copies."""
        if stream in (Stream.HOST, Stream.PCIE):
            return 1.0
        return self.slowdown.get(rank, 1.0)

    def record_parts(self, rank: int, task: Task, start: float) -> None:
        """A fused task: its template of parts, shifted to its start; its collectives'
        traffic tallied."""
        self.tally.add_pass(rank, task.parts)
        self.task_start[rank][task.index] = start
        self.task_end[rank][task.index] = self.env.now  # later than its parts' where slowed
        self.passes.append(FusedPass.of(rank, task, start))

    def pass_calls(self, rank: int, parts: tuple[Part, ...]) -> list[tuple[CollectiveCall, int]]:
        """The collectives of a fused pass's parts, each with the groups it stands for."""
        return [
            (
                self.call(p.comm.op, p.comm.nbytes, self.group_of(rank, p.comm.group)),
                self.copies(rank, p.comm.group),
            )
            for p in parts
            if p.comm is not None
        ]

    def record(self, rank: int, task: Task, start: float, end: float) -> None:
        self.task_start[rank][task.index], self.task_end[rank][task.index] = start, end
        self.spans.append(Span.of(rank, task, start, end))

    def end(self, rank: int, index: int) -> simpy.Event:
        """The event of a task's end, made when a task first waits for it (most tasks'
        ends nobody waits for: the next task of their stream starts after them anyway)."""
        key = (rank, index)
        found = self._ends.get(key)
        if found is None:
            found = self._ends[key] = self.env.event()
        return found

    def finish(self, rank: int, task: Task) -> None:
        assert not self.ended[rank][task.index]  # tasks end once
        self.ended[rank][task.index] = True
        event = self._ends.pop((rank, task.index), None)
        if event is not None:
            event.succeed()

    def receive(self, rank: int, task: Task) -> None:
        """A receive ends when its data has arrived (`deliver`), with no process or event of
        its own: the send's end ends it."""
        assert task.comm is not None  # recv tasks always carry their comm
        self.receivers[(rank, task.comm.tag)] = partial(self._received, rank, task)

    def _received(self, rank: int, task: Task, sent_at: float) -> None:
        self.record(rank, task, sent_at, self.env.now)  # waiting for the sender is idle time
        self.finish(rank, task)

    def deliver(self, rank: int, tag: str, sent_at: float) -> None:
        """A send's data has arrived at `rank`: its receive ends (it learns when the data
        left: waiting for the sender is idle time)."""
        self.receivers.pop((rank, tag))(sent_at)

    def communicate(self, rank: int, task: Task) -> simpy.Event:
        comm = task.comm
        assert comm is not None
        if comm.op is CollectiveOp.SEND_RECV:
            return self.send(rank, task)
        members = self.group_of(rank, comm.group)
        counter = self.calls.setdefault((rank, comm.group, task.stream), itertools.count())
        key = (comm.group, id(members), task.stream, next(counter))  # groups: cached tuples
        meeting = self.pending.setdefault(key, _Rendezvous(done=self.env.event()))
        meeting.arrived += 1
        assert meeting.done is not None
        expected = self.expected(members)
        if meeting.arrived == expected:
            del self.pending[key]
            self.env.process(self.launch(task, comm, members, meeting.done))
        return meeting.done

    def call(
        self, op: CollectiveOp, nbytes: float, members: tuple[int, ...], root: int = 0
    ) -> CollectiveCall:
        """One instance per call and group (groups are cached tuples): hashing and checking a
        group of many GPUs once, not at every launch."""
        key = (op, nbytes, id(members), root)
        found = self._calls.get(key)
        if found is None:
            found = self._calls[key] = (CollectiveCall(op, nbytes, members, root=root), members)
        return found[0]

    def expected(self, members: tuple[int, ...]) -> int:
        """How many simulated ranks a collective of `members` waits for."""
        found = self._expected.get(id(members))
        if found is None:  # groups are cached tuples: their ids are theirs
            found = self._expected[id(members)] = sum(1 for r in members if r in self.simulated)
        return found

    def launch(
        self, task: Task, comm: Comm, members: tuple[int, ...], done: simpy.Event
    ) -> Generator[simpy.Event, None, None]:
        call = self.book_collective(self.traffic, task, members)
        replicas = [
            self.call(comm.op, comm.nbytes, group, comm.root)
            for group in self.contending_replicas(members, comm)
        ]
        launched = self.env.now
        yield self.comms.run(call, replicas)
        done.succeed(launched)

    def send_replicas(self, rank: int, offset: int) -> list[tuple[int, int]]:
        """The other (dp, tp) replicas' sends of the same activation, where they share links."""
        if self.full:
            return []
        key = (rank, offset)
        if key not in self._sends:
            dp_i, pp_i, tp_i = self.coords(rank)
            mine = (rank, self.peer(rank, offset))
            sources = [
                self.grid.rank(d, pp_i, t)
                for d, t in itertools.product(range(self.grid.dp), range(self.grid.tp))
                if (d, t) != (dp_i, tp_i)
            ]
            pairs = [(src, self.peer(src, offset)) for src in sources]
            self._sends[key] = self.comms.sharing_pairs(mine, pairs)
        return self._sends[key]

    def send_calls(self, rank: int, comm: Comm) -> tuple[CollectiveCall, list[CollectiveCall]]:
        """A pipeline send's call, and the same send of the other (dp, tp) replicas whose
        flows share its links (kept: a pipeline repeats its sends)."""
        key = (rank, comm.nbytes, comm.peer)
        if key not in self._send_calls:
            call = CollectiveCall(
                CollectiveOp.SEND_RECV, comm.nbytes, (rank, self.peer(rank, comm.peer))
            )
            replicas = [
                CollectiveCall(CollectiveOp.SEND_RECV, comm.nbytes, pair)
                for pair in self.send_replicas(rank, comm.peer)
            ]
            self._send_calls[key] = (call, replicas)
        return self._send_calls[key]

    def book_send(
        self, rank: int, task: Task, times: int = 1, traffic: Traffic | None = None
    ) -> None:
        """A pipeline send's traffic (`times` the same), for every (dp, tp) replica it stands
        for."""
        assert task.comm is not None
        call = self.send_calls(rank, task.comm)[0]
        copies = 1 if self.full else self.grid.dp * self.grid.tp
        (traffic or self.traffic).book(call, task.category, rank, copies, times)

    def book_task(self, traffic: Traffic, rank: int, task: Task) -> None:
        """What one task of `rank`'s booked in the run, booked again to `traffic` (a
        collective by the first simulated member of its group, as it launched once)."""
        comm = task.comm
        if task.parts:
            traffic.book_pass(rank, task.parts, self.pass_calls)
        elif comm is None or task.receives:
            return
        elif comm.op is CollectiveOp.SEND_RECV:
            self.book_send(rank, task, traffic=traffic)
        else:
            members = self.group_of(rank, comm.group)
            if rank == next(r for r in members if r in self.simulated):
                self.book_collective(traffic, task, members)

    def book_collective(
        self, traffic: Traffic, task: Task, members: tuple[int, ...]
    ) -> CollectiveCall:
        """A collective's traffic, for its group and the replica groups it stands for."""
        comm = task.comm
        assert comm is not None
        call = self.call(comm.op, comm.nbytes, members, comm.root)
        traffic.book(call, task.category, copies=self.copies(members[0], comm.group))
        return call

    def send(self, rank: int, task: Task) -> simpy.Event:
        assert task.comm is not None
        self.tally.add_send(rank, task)
        call, replicas = self.send_calls(rank, task.comm)
        transfer = self.comms.send(call, replicas)
        peer, tag, sent_at = call.group[1], task.comm.tag, self.env.now
        transfer.callbacks.append(lambda _: self.deliver(peer, tag, sent_at))
        return transfer
