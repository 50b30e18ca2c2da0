"""Starting and always stopping the processes of a validation run.

Every process is started in its own process group with `ZSIM_RUN_TAG=<tag>` in its environment,
which its descendants inherit (torchrun starts each worker in a session of its own, so a process
group alone does not reach them). Stopping a run signals the groups, then kills whatever process
still carries the tag: nothing outlives the run, even when a launcher died first.

A group is signalled only while its leader is unreaped (`waitid(WNOWAIT)` looks without
reaping), so its id cannot have been reused by another process.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

TAG_VAR = "ZSIM_RUN_TAG"

# glibc malloc as a caching allocator for CPU ranks (calibration and training alike). By
# default glibc serves blocks above its mmap threshold (at most 32 MiB) with fresh mmap()s and
# unmaps them on free, so DeepSpeed's per-step buffers (the 2 GB gradient bucket, flattened
# copies, Adam temporaries) page-fault on every step: measured here, that doubled a ZeRO step
# (8 x Linear(1024), 2 ranks: 190 -> 90 ms at stage 0, 318 -> 125 ms at stage 3). The CUDA
# caching allocator keeps freed blocks, and so do the jemalloc/TCMalloc allocators PyTorch's
# CPU performance guide recommends; these tunables (mallopt(3)) make glibc keep them too,
# so the CPU testbed allocates as a GPU does. A thread's own arena (gloo's worker threads
# allocate the gathered and cloned buffers) grows in heaps of at most 64 MiB, and glibc 2.36
# unmaps an emptied heap unless the top pad covers it, whatever the trim threshold (heap_trim).
# Measured on 2 ranks, all_gather_into_tensor outputs of 16-62 MiB, 12 calls each: without the
# pad, 62 of the 121 calls after the first faulted the whole output in again, with it 4 (a new
# heap still opens now and then); a ZeRO-1 step faulted its 33.6 MB gathered parameters in
# (8,201 faults) in 2 of 4 steps without it, in none of 8 with it. A block larger than a heap
# is mapped fresh on every call in a thread's arena, even with mmap off: that one the
# simulator models (`LocalWork.fresh_above_bytes`).
CPU_ALLOCATOR_ENV = {
    "MALLOC_MMAP_MAX_": "0",  # never mmap() a block: every tensor comes from the heap
    "MALLOC_TRIM_THRESHOLD_": str(1 << 40),  # never give freed heap back to the kernel
    "MALLOC_TOP_PAD_": str(1 << 30),  # and never unmap a thread arena's emptied heap
}
_SEQ = iter(range(1_000_000))


def new_tag(kind: str) -> str:
    """A tag unique on this machine: prefix, pid, sequence number."""
    return f"zsim-{os.getpid()}-{next(_SEQ)}-{kind}"


def spawn(
    argv: Sequence[str], tag: str, env: Mapping[str, str] | None = None, **kwargs: Any
) -> subprocess.Popen[bytes]:
    """Start `argv` as the leader of a new session, tagged."""
    full_env = dict(os.environ if env is None else env) | {TAG_VAR: tag}
    return subprocess.Popen(list(argv), env=full_env, start_new_session=True, **kwargs)


def exit_code(proc: subprocess.Popen[Any]) -> int | None:
    """The exit status if `proc` has ended, without reaping it (None while it runs)."""
    if proc.returncode is not None:
        return proc.returncode
    info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    if info is None:
        return None
    if info.si_code == os.CLD_EXITED:
        return info.si_status
    return -info.si_status  # killed by a signal, as subprocess reports it


_STOPPING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def terminate_raises() -> Iterator[None]:
    """While active, SIGTERM and SIGHUP raise KeyboardInterrupt (as SIGINT does), so that the
    `finally` blocks that stop processes and delete namespaces run. Main thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupted(signum: int, _frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    old = {sig: signal.signal(sig, interrupted) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def uninterrupted() -> Iterator[None]:
    """Hold SIGINT, SIGTERM and SIGHUP back while cleaning up; they are delivered after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, _STOPPING)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def stop(procs: Sequence[subprocess.Popen[Any]], tag: str | None, grace_s: float = 5.0) -> None:
    """SIGTERM every group, wait up to `grace_s`, SIGKILL the groups, reap; then SIGKILL every
    straggler carrying `tag` (None: only the groups). Signals wait until it is done."""
    with uninterrupted():
        _stop(procs, tag, grace_s)


def _stop(procs: Sequence[subprocess.Popen[Any]], tag: str | None, grace_s: float) -> None:
    for proc in procs:
        _signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(exit_code(p) is None for p in procs):
        time.sleep(0.05)
    for proc in procs:
        _signal_group(proc, signal.SIGKILL)
    for proc in procs:
        if proc.returncode is None:
            proc.wait(timeout=30)
    if tag is not None:
        kill_tagged(tag)


def _signal_group(proc: subprocess.Popen[Any], sig: int) -> None:
    if proc.returncode is not None:
        return  # reaped: the id may belong to someone else now
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def _tags() -> dict[int, str]:
    """pid -> ZSIM_RUN_TAG of every process that carries one (any namespace, any session)."""
    prefix = f"{TAG_VAR}=".encode()
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone, or not ours to read
            continue
        for item in environ.split(b"\0"):
            if item.startswith(prefix):
                found[int(entry.name)] = item[len(prefix) :].decode(errors="replace")
    return found


def tagged_pids(tag: str) -> list[int]:
    """Processes whose environment carries `ZSIM_RUN_TAG=tag`."""
    return [pid for pid, t in _tags().items() if t == tag]


def owner_pid(tag: str) -> int | None:
    """The zsim process that made a tag (`zsim-<pid>-<seq>-<kind>`)."""
    parts = tag.split("-")
    return int(parts[1]) if len(parts) > 2 and parts[0] == "zsim" and parts[1].isdigit() else None


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def kill_orphans() -> list[int]:
    """SIGKILL processes left by a zsim process that no longer exists (it was SIGKILLed)."""
    orphans = [
        pid
        for pid, tag in _tags().items()
        if (owner := owner_pid(tag)) is not None and not alive(owner)
    ]
    for pid in orphans:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return orphans


def kill_tagged(tag: str, attempts: int = 50) -> None:
    """SIGKILL every process carrying the tag, until none is left."""
    for _ in range(attempts):
        pids = tagged_pids(tag)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
