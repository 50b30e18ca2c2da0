"""Run a calibration: check the machine, launch the workers with torchrun, show progress, fit,
and write the profile (JSON + CSV + PNG), each file renamed into place only when complete.

`python -m torch.distributed.run --nproc_per_node N -m zsim.calibrate.worker` is what runs:
torchrun's own placement (it sets OMP_NUM_THREADS=1 per rank when N > 1 and the variable is
unset), which is how zsim's validation launches DeepSpeed training, so compute is measured
with the threads training will have. On CPU, DS_ACCELERATOR=cpu is set for any DeepSpeed
import, and the backend is gloo; on CUDA, NCCL.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import importlib.util
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from zsim.calibrate.fit import Fit, fit_profile
from zsim.calibrate.plan import PROGRESS, RANKS_ON_HOST_ENV, Measurement, Plan, merge_launches
from zsim.calibrate.profile import Calibration, save_profile
from zsim.errors import InputError, require

TORCHRUN_PORT = 29500  # torchrun's default --master_port


class CalibrationFailed(RuntimeError):
    """The workers failed (not bad input): the message carries the tail of their output."""


@dataclass(frozen=True)
class Launch:
    """How the workers are started."""

    nproc: int
    threads: int | None = None  # per rank; None: torchrun's rule (1 when nproc > 1)
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: a free port on one node, torchrun's default 29500 across nodes


# ---- checks -------------------------------------------------------------------------------


def check_machine(device: str, nproc: int) -> None:
    """Refuse, as InputError, what this machine cannot run (before anything is written)."""
    require(
        importlib.util.find_spec("torch") is not None,
        "device",
        device,
        "a machine with torch installed (pip install 'zsim[calibrate]')",
    )
    if device != "cuda":
        return
    import torch  # calibrate may import torch; the check needs it

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    require(
        count > 0, "device", "cuda", "a machine with a CUDA GPU (torch sees none): use --device cpu"
    )
    require(nproc <= count, "nproc", nproc, f"at most {count}, the CUDA devices torch sees")


def check_writable(out: Path) -> None:
    """Refuse an output folder that cannot be written, before hours of measuring (the folder
    is created; no file is left in it)."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out.parent, prefix=".zsim-write-test-"):
            pass
    except OSError as exc:
        raise InputError("out", str(out), f"a path this user can write ({exc.strerror})") from None


def host_description() -> dict[str, Any]:
    """CPU model, cores, memory and load of this host (no torch needed)."""
    cpu = platform.processor() or "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    memory = 0
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory = int(line.split()[1]) * 1024
    return {
        "cpu_model": cpu,
        "cpu_cores": os.cpu_count(),
        "host_memory_bytes": memory,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "hostname": socket.gethostname(),
    }


def load_average() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def busy_host(load: list[float], cores: int) -> str:
    """A warning when other work competes for the cores (empty when the host looks idle)."""
    if load and load[0] > 0.5 * cores:
        return (
            f"this host is busy (load {load[0]:.1f} on {cores} cores): measurements will be "
            "slower and noisier than on an idle host; the load is recorded in the profile"
        )
    return ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---- launching ----------------------------------------------------------------------------


def worker_argv(launch: Launch, plan_path: Path, raw_path: Path) -> list[str]:
    # every node must name the same port: a free port is only known on one host
    port = launch.master_port or (TORCHRUN_PORT if launch.nnodes > 1 else _free_port())
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={launch.nproc}",
        f"--nnodes={launch.nnodes}",
        f"--node_rank={launch.node_rank}",
        f"--master_addr={launch.master_addr}",
        f"--master_port={port}",
        "-m",
        "zsim.calibrate.worker",
        "--plan",
        str(plan_path),
        "--out",
        str(raw_path),
    ]


def threads_per_rank(launch: Launch, ranks_on_host: int) -> int:
    """Threads each rank gets: the flag, else the host's cores shared by its ranks (at least
    one), the rule zsim's validation launches DeepSpeed with (and torchrun's 1 for 2 ranks on
    2 cores)."""
    if launch.threads is not None:
        return launch.threads
    return max(1, (os.cpu_count() or 1) // ranks_on_host)


def worker_env(
    device: str, launch: Launch, ranks_on_host: int, ifname: str | None
) -> dict[str, str]:
    """The environment of the workers, as zsim's validation gives its training ranks."""
    env = dict(os.environ)
    if device == "cpu":
        from zsim.testbed.procs import CPU_ALLOCATOR_ENV

        env.update(CPU_ALLOCATOR_ENV)
        env["DS_ACCELERATOR"] = "cpu"
        if ifname is not None:
            env["GLOO_SOCKET_IFNAME"] = ifname
    env["OMP_NUM_THREADS"] = str(threads_per_rank(launch, ranks_on_host))
    env[RANKS_ON_HOST_ENV] = str(ranks_on_host)  # emulated nodes share this host's cores
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONWARNINGS"] = "ignore::FutureWarning"
    return env


def watch(
    started: list[subprocess.Popen[bytes]],
    on_progress: Callable[[int, int, str], None],
    logs: list[Path],
) -> None:
    """Follow the first launcher's output (progress lines, the rest kept for errors) until it
    ends, then wait for the others; raise CalibrationFailed with the output's tail when one
    fails."""
    tail: deque[str] = deque(maxlen=40)
    first = started[0]
    assert first.stdout is not None
    for raw in first.stdout:
        line = raw.decode(errors="replace").rstrip("\n")
        if line.startswith(PROGRESS):
            _, done, total, label = [*line.split(" ", 3), ""][:4]
            on_progress(int(done), int(total), label)
        else:
            tail.append(line)
    codes = [p.wait() for p in started]
    if any(codes):
        for log in logs:
            with contextlib.suppress(OSError):
                tail.extend(log.read_text(errors="replace").splitlines()[-10:])
        errors = [t for t in tail if "Error" in t or "error" in t] or list(tail)
        node, code = next((i, c) for i, c in enumerate(codes) if c)
        raise CalibrationFailed(
            f"the calibration workers failed (node {node}, exit {code}): "
            f"{errors[-1].strip() if errors else 'no output'}\n" + "\n".join(tail)
        )


def launch_local(argv: list[str], env: Mapping[str, str], tag: str) -> subprocess.Popen[bytes]:
    from zsim.testbed import procs

    return procs.spawn(argv, tag, env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


@contextlib.contextmanager
def progress_bar(enabled: bool) -> Iterator[Callable[[int, int, str], None]]:
    """A rich progress bar fed by worker progress lines (silent when disabled)."""
    if not enabled:
        yield lambda _done, _total, _label: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (
        TextColumn("calibrating"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
    )
    with Progress(*columns, transient=True) as bar:
        task = bar.add_task("starting workers", total=None)

        def update(done: int, total: int, label: str) -> None:
            bar.update(task, completed=done, total=total, description=label)

        yield update


def run_local(
    plan: Plan,
    launch: Launch,
    plan_path: Path,
    raw_path: Path,
    update: Callable[[int, int, str], None],
) -> None:
    """One torchrun on this host (one node of a real multi-node run when nnodes > 1)."""
    from zsim.testbed import procs

    ifname = "lo" if launch.nnodes == 1 else None  # several real hosts: gloo picks
    env = worker_env(plan.device, launch, launch.nproc, ifname)
    tag = procs.new_tag("calibrate")
    started = [launch_local(worker_argv(launch, plan_path, raw_path), env, tag)]
    try:
        watch(started, update, [])
    finally:
        procs.stop(started, tag)


@dataclass(frozen=True)
class Emulation:
    """Nodes emulated as network namespaces (zsim.testbed.emulate), as validation runs them."""

    nodes: int
    ranks_per_node: int
    rate_bps: float  # the topology's inter-node rate
    scale: float  # applied rate = rate_bps * scale
    latency_s: float


def run_emulated(
    plan: Plan,
    emulation: Emulation,
    plan_path: Path,
    raw_path: Path,
    update: Callable[[int, int, str], None],
) -> dict[str, Any]:
    """One torchrun per emulated node; node 0 holds rank 0. What was applied is returned."""
    from zsim.testbed import procs
    from zsim.testbed.emulate import NODE_DEV, EmulatedCluster

    launch = Launch(
        nproc=emulation.ranks_per_node,
        threads=None,
        nnodes=emulation.nodes,
        master_port=TORCHRUN_PORT,  # inside node 0's fresh namespace: free
    )
    world = emulation.nodes * emulation.ranks_per_node
    env = worker_env(plan.device, launch, world, NODE_DEV)  # every rank shares this host
    with EmulatedCluster(
        nodes=emulation.nodes,
        ranks_per_node=emulation.ranks_per_node,
        rate_bps=emulation.rate_bps,
        scale=emulation.scale,
        latency_s=emulation.latency_s,
    ) as cluster:
        tag = procs.new_tag("calibrate")
        logs = [raw_path.with_name(f"node{n}.log") for n in range(emulation.nodes)]
        started = []
        with contextlib.ExitStack() as files:
            try:
                for node in range(emulation.nodes):
                    node_launch = replace(launch, node_rank=node, master_addr=cluster.address(0))
                    argv = worker_argv(node_launch, plan_path, raw_path)
                    if node == 0:
                        out: dict[str, Any] = {"stdout": subprocess.PIPE}
                    else:
                        out = {"stdout": files.enter_context(logs[node].open("wb"))}
                    started.append(
                        cluster.popen(node, argv, env, tag=tag, stderr=subprocess.STDOUT, **out)
                    )
                watch(started, update, logs)
            finally:
                procs.stop(started, tag)
        applied = cluster.emulation
        return applied.as_dict() if applied is not None else {}


# ---- the whole run ------------------------------------------------------------------------


@dataclass(frozen=True)
class Written:
    calibration: Calibration
    fit: Fit
    paths: list[Path]


def calibrate(
    plan: Plan,
    launch: Launch,
    name: str,
    out: Path,
    show_progress: bool = True,
    plot: bool = True,
    emulation: Emulation | None = None,
) -> Written | None:
    """Measure, fit, write. Nothing is written at `out` unless everything succeeded. None on a
    node other than node 0 (it only measures; node 0 gathers and writes)."""
    check_machine(plan.device, launch.nproc)
    require(out.suffix == ".json", "out", str(out), "a path ending in .json")
    check_writable(out)
    info: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "device": plan.device,
        "topology": plan.topology,
        "nproc_per_node": launch.nproc,
        "nnodes": launch.nnodes,
        "load_before": load_average(),
        **host_description(),
    }
    busy = busy_host(info["load_before"], info.get("cpu_cores") or 1)
    if busy:
        print(f"zsim: warning: {busy}", file=sys.stderr)
        info["warning"] = busy
    raws: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="zsim-calibrate-") as tmp:
        plan_path = Path(tmp) / "plan.json"
        plan_path.write_text(json.dumps(plan.per_launch().to_dict()))
        with progress_bar(show_progress) as update:
            for k in range(plan.launches):
                raw_path = Path(tmp) / f"raw{k}.json"
                shown = launch_progress(update, k, plan.launches)
                if emulation is None:
                    run_local(plan, launch, plan_path, raw_path, shown)
                else:
                    info["emulation"] = run_emulated(plan, emulation, plan_path, raw_path, shown)
                if launch.node_rank == 0:
                    raws.append(json.loads(raw_path.read_text()))
    if launch.node_rank != 0:
        return None
    info["load_after"] = load_average()
    info |= launches_provenance([raw["provenance"] for raw in raws])
    info |= memory_of(info)
    rows = merge_launches([[Measurement.from_dict(r) for r in raw["measurements"]] for raw in raws])
    cal, fit = fit_measurements(name, tuple(rows), info, plan.to_dict())
    written = save_profile(cal, out)
    if plot:
        from zsim.calibrate.plots import save_fit_png

        written.append(save_fit_png(cal, fit, out.with_name(out.stem + "-fit.png")))
    return Written(cal, fit, written)


def launch_progress(
    update: Callable[[int, int, str], None], k: int, launches: int
) -> Callable[[int, int, str], None]:
    """Launch k's worker progress shown as part of all launches."""
    if launches == 1:
        return update

    def shown(done: int, total: int, label: str) -> None:
        update(k * total + done, launches * total, f"launch {k + 1}/{launches}, {label}")

    return shown


def launches_provenance(each: list[dict[str, Any]]) -> dict[str, Any]:
    """The workers' provenance of several launches as one: the first launch's, with the
    launches counted, their measuring time summed and the largest rank footprint."""
    out = dict(each[0])
    out["launches"] = len(each)
    out["measure_seconds"] = round(sum(p.get("measure_seconds", 0.0) for p in each), 1)
    if all("rank_rss_bytes" in p for p in each):
        out["rank_rss_bytes"] = max(p["rank_rss_bytes"] for p in each)
    return out


def memory_of(info: Mapping[str, Any]) -> dict[str, float]:
    """The device memory of one rank: the GPU's, or on CPU the host's shared by its ranks; the
    reserved part is what one rank holds before training (CUDA context, or the process)."""
    if "device_memory_bytes" in info:
        return {
            "memory_bytes": float(info["device_memory_bytes"]),
            "reserved_bytes": float(info.get("device_reserved_bytes", 0)),
        }
    local = max(1, int(info.get("local_world_size", 1)))
    return {
        "memory_bytes": float(info["host_memory_bytes"]) / local,
        "reserved_bytes": float(info.get("rank_rss_bytes", 0)),
    }


def refit(cal: Calibration, out: Path, plot: bool = True) -> Written:
    """The stored measurements of `cal` fitted again with this zsim, written to `out`."""
    info = dict(cal.provenance) | {
        "refit_date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    }
    new, fit = fit_measurements(cal.name, cal.measurements, info, cal.plan)
    written = save_profile(new, out)
    if plot:
        from zsim.calibrate.plots import save_fit_png

        written.append(save_fit_png(new, fit, out.with_name(out.stem + "-fit.png")))
    return Written(new, fit, written)


def fit_measurements(
    name: str,
    measurements: tuple[Measurement, ...],
    info: Mapping[str, Any],
    plan: Mapping[str, Any],
) -> tuple[Calibration, Fit]:
    fit = fit_profile(name, measurements, info)
    cal = Calibration(
        name=name,
        profile=fit.profile,
        measurements=measurements,
        residuals=fit.residuals,
        collective_params=fit.collective_params,
        provenance=dict(info),
        plan=dict(plan),
    )
    return cal, fit
