"""torchrun, the one way calibration and validation start ranks: on this host, on one node of a
real multi-node run, or on every node of an emulated cluster (one torchrun per namespace, joined
by a static rendezvous on node 0's address).

Every launcher is started tagged (`procs`), its output goes to a log per node, node 0's lines
can be followed as they come (progress), and whatever happens (a rank raises, a launcher dies,
time runs out, Ctrl-C) the run ends with nothing of it left running.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from zsim.testbed import procs
from zsim.testbed.emulate import EmulatedCluster

TORCHRUN_PORT = 29500  # torchrun's default --master_port
POLL_S = 0.1


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Torchrun:
    """`python -m torch.distributed.run` of `program` on `nnodes` nodes of `nproc_per_node`
    ranks. `master_port` 0: a free port on one node, torchrun's default 29500 across nodes
    (every node must name the same port, and a free port is only known on one host)."""

    program: tuple[str, ...]
    nnodes: int = 1
    nproc_per_node: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 0

    def port(self) -> int:
        if self.master_port:
            return self.master_port
        return TORCHRUN_PORT if self.nnodes > 1 else free_port()

    def argv(self, node_rank: int, port: int) -> list[str]:
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={self.nproc_per_node}",
            f"--nnodes={self.nnodes}",
            f"--node_rank={node_rank}",
            f"--master_addr={self.master_addr}",
            f"--master_port={port}",
            "--max_restarts=0",
            *self.program,
        ]


@dataclass(frozen=True)
class Ended:
    """How a run ended: each launcher's exit code (None: still running when it was stopped)."""

    codes: tuple[int | None, ...]
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(c == 0 for c in self.codes)

    @property
    def failure(self) -> tuple[int, int] | None:
        """(node, exit code) of the first launcher that failed."""
        return next(((i, c) for i, c in enumerate(self.codes) if c not in (None, 0)), None)


def run(
    job: Torchrun,
    env: Mapping[str, str],
    logs: Sequence[Path],
    *,
    node_ranks: Sequence[int] = (0,),
    cluster: EmulatedCluster | None = None,
    kind: str = "run",
    timeout_s: float | None = None,
    on_line: Callable[[str], None] | None = None,
    on_tick: Callable[[], None] | None = None,
) -> Ended:
    """Start the nodes `node_ranks` of `job` here (in `cluster`'s namespaces when given), each
    writing to its log; call `on_line` with node 0's lines as they come and `on_tick` while
    waiting; return when every launcher exited 0, one failed, or `timeout_s` passed. Raises
    OSError when a launcher cannot be started; stops everything in every case."""
    tag = procs.new_tag(kind)
    port = job.port()
    started: list[subprocess.Popen[bytes]] = []
    lines: queue.Queue[str] = queue.Queue()
    try:
        with contextlib.ExitStack() as files, _follow(lines) as follow:
            try:
                for i, node in enumerate(node_ranks):
                    log = files.enter_context(logs[i].open("wb"))
                    out = subprocess.PIPE if i == 0 and on_line is not None else log
                    streams = {"stdout": out, "stderr": subprocess.STDOUT}
                    argv = job.argv(node, port)
                    if cluster is None:
                        proc = procs.spawn(argv, tag, env, **streams)
                    else:
                        proc = cluster.popen(node, argv, env, tag=tag, **streams)
                    started.append(proc)
                    if out is subprocess.PIPE:
                        follow(proc.stdout, log)
                return _wait(started, timeout_s, lambda: _drain(lines, on_line), on_tick)
            finally:
                procs.stop(started, tag)  # the pipes close, the readers end
    finally:
        _drain(lines, on_line)


def _wait(
    started: Sequence[subprocess.Popen[bytes]],
    timeout_s: float | None,
    drain: Callable[[], None],
    on_tick: Callable[[], None] | None,
) -> Ended:
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        drain()
        codes = tuple(procs.exit_code(p) for p in started)
        ended = Ended(codes)
        if ended.failure is not None or ended.ok:
            return ended
        if deadline is not None and time.monotonic() > deadline:
            return Ended(codes, timed_out=True)
        if on_tick is not None:
            on_tick()
        time.sleep(POLL_S)


@contextlib.contextmanager
def _follow(
    lines: queue.Queue[str],
) -> Iterator[Callable[[IO[bytes] | None, IO[bytes]], None]]:
    """Readers that copy a pipe to its log and queue its lines for the waiting thread."""
    threads: list[threading.Thread] = []

    def follow(pipe: IO[bytes] | None, log: IO[bytes]) -> None:
        def copy() -> None:
            assert pipe is not None
            for raw in pipe:
                log.write(raw)
                lines.put(raw.decode(errors="replace").rstrip("\n"))

        thread = threading.Thread(target=copy, daemon=True)
        thread.start()
        threads.append(thread)

    try:
        yield follow
    finally:
        for thread in threads:
            thread.join(timeout=30)


def _drain(lines: queue.Queue[str], on_line: Callable[[str], None] | None) -> None:
    while True:
        try:
            line = lines.get_nowait()
        except queue.Empty:
            return
        if on_line is not None:
            on_line(line)


def log_tail(logs: Sequence[Path], lines: int = 3) -> list[str]:
    """The last lines of the logs that say something: the error lines if there are any."""
    text: list[str] = []
    for log in logs:
        with contextlib.suppress(OSError):
            text += log.read_text(errors="replace").splitlines()
    errors = [t for t in text if "Error" in t or "error" in t]
    return (errors or text)[-lines:]
