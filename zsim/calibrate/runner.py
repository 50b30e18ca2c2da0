"""Run a calibration: check the machine, launch the workers with torchrun, show progress, fit,
and write the profile (JSON + CSV + PNG), each file renamed into place only when complete.

`python -m torch.distributed.run --nproc_per_node N -m zsim.calibrate.worker` is what runs
(`zsim.testbed.torchrun`, as validation launches DeepSpeed training): torchrun's own placement
(it sets OMP_NUM_THREADS=1 per rank when N > 1 and the variable is unset), so compute is measured
with the threads training will have. On CPU, DS_ACCELERATOR=cpu is set for any DeepSpeed
import, and the backend is gloo; on CUDA, NCCL.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import sys
import tempfile
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TextIO

from zsim.calibrate import speed
from zsim.calibrate.fit import Fit, fit_profile
from zsim.calibrate.holdout import held_out_residuals
from zsim.calibrate.host import (
    busy_host,
    check_machine,
    check_writable,
    host_description,
    load_average,
    memory_of,
)
from zsim.calibrate.measurement import Measurement, merge_launches
from zsim.calibrate.plan import PROGRESS, RANKS_ON_HOST_ENV, Plan
from zsim.calibrate.profile import Calibration, save_profile
from zsim.errors import require
from zsim.testbed import torchrun
from zsim.testbed.emulate import NODE_DEV, EmulatedCluster
from zsim.testbed.emulation_plan import EmulationPlan, emulated
from zsim.testbed.procs import CPU_ALLOCATOR_ENV

LAUNCH_TIMEOUT_S = 6 * 3600.0
"""How long one launch of the workers may run before it is stopped: the longest CPU
calibrations here took under an hour per launch; a stuck rendezvous or collective ends here."""

Progress = Callable[[int, int, str], None]


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


def worker_job(launch: Launch, plan_path: Path, raw_path: Path) -> torchrun.Torchrun:
    program = ("-m", "zsim.calibrate.worker", "--plan", str(plan_path), "--out", str(raw_path))
    return torchrun.Torchrun(
        program, launch.nnodes, launch.nproc, launch.master_addr, launch.master_port
    )


def worker_argv(launch: Launch, plan_path: Path, raw_path: Path) -> list[str]:
    """The torchrun command line of this node of the launch."""
    job = worker_job(launch, plan_path, raw_path)
    return job.argv(launch.node_rank, job.port())


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
        env.update(CPU_ALLOCATOR_ENV)
        env["DS_ACCELERATOR"] = "cpu"
        if ifname is not None:
            env["GLOO_SOCKET_IFNAME"] = ifname
    env["OMP_NUM_THREADS"] = str(threads_per_rank(launch, ranks_on_host))
    env[RANKS_ON_HOST_ENV] = str(ranks_on_host)  # emulated nodes share this host's cores
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONWARNINGS"] = "ignore::FutureWarning"
    return env


def run_workers(
    plan: Plan,
    launch: Launch,
    paths: tuple[Path, Path],
    update: Progress,
    cluster: EmulatedCluster | None = None,
    timeout_s: float = LAUNCH_TIMEOUT_S,
) -> None:
    """One launch of the workers: this host's node of `launch`, or with `cluster` every node
    in its namespaces (node 0 holds rank 0). Raises CalibrationFailed with the output's tail."""
    plan_path, raw_path = paths
    if cluster is None:
        nodes: tuple[int, ...] = (launch.node_rank,)
        ifname = "lo" if launch.nnodes == 1 else None  # several real hosts: gloo picks
        env = worker_env(plan.device, launch, launch.nproc, ifname)
    else:
        nodes = tuple(range(launch.nnodes))
        env = worker_env(plan.device, launch, launch.nnodes * launch.nproc, NODE_DEV)
    logs = [raw_path.with_name(f"node{n}.log") for n in nodes]
    tail: deque[str] = deque(maxlen=40)

    def line(text: str) -> None:
        if text.startswith(PROGRESS):
            _, done, total, label = [*text.split(" ", 3), ""][:4]
            update(int(done), int(total), label)
        else:
            tail.append(text)

    job = worker_job(launch, plan_path, raw_path)
    ended = torchrun.run(
        job,
        env,
        logs,
        node_ranks=nodes,
        cluster=cluster,
        kind="calibrate",
        timeout_s=timeout_s,
        on_line=line,
    )
    if not ended.ok:
        raise CalibrationFailed(_failure(ended, list(tail), logs[1:], timeout_s))


def _failure(ended: torchrun.Ended, tail: list[str], others: list[Path], timeout_s: float) -> str:
    for log in others:
        with contextlib.suppress(OSError):
            tail += log.read_text(errors="replace").splitlines()[-10:]
    errors = [t for t in tail if "Error" in t or "error" in t] or tail
    last = errors[-1].strip() if errors else "no output"
    if ended.timed_out:
        how = f"ran past {timeout_s:.0f} s and were stopped"
    else:
        node, code = ended.failure or (0, 0)
        how = f"failed (node {node}, exit {code})"
    return f"the calibration workers {how}: {last}\n" + "\n".join(tail)


def plain_progress(stream: TextIO) -> Callable[[int, int, str], None]:
    """Progress as a line per tenth of the work, where no terminal shows a bar (a log)."""
    shown = [-1]

    def update(done: int, total: int, label: str) -> None:
        tenth = done * 10 // total if total else -1
        if tenth > shown[0]:
            shown[0] = tenth
            print(f"calibrating: {done}/{total} {label}", file=stream, flush=True)

    return update


@contextlib.contextmanager
def progress_bar(
    enabled: bool, stream: TextIO | None = None
) -> Iterator[Callable[[int, int, str], None]]:
    """A rich progress bar fed by worker progress lines (silent when disabled; plain lines
    when `stream`, stderr by default, is not a terminal)."""
    if not enabled:
        yield lambda _done, _total, _label: None
        return
    stream = stream or sys.stderr
    if not stream.isatty():
        yield plain_progress(stream)
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
    emulation: EmulationPlan | None = None,
    timeout_s: float = LAUNCH_TIMEOUT_S,
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
    raws = _measure(plan, launch, emulation, show_progress, timeout_s, info)
    if launch.node_rank != 0:
        return None
    info["load_after"] = load_average()
    if plan.device == "cpu":  # the machine's speed the rows were measured at (`speed`)
        ranks = launch.nproc * (launch.nnodes if emulation is not None else 1)  # on this host
        info["speed_probe_s"] = speed.probe_ranks(ranks)
    info |= launches_provenance([raw["provenance"] for raw in raws])
    info |= memory_of(info)
    rows = merge_launches([[Measurement.from_dict(r) for r in raw["measurements"]] for raw in raws])
    cal, fit = fit_measurements(name, tuple(rows), info, plan.to_dict())
    return _write(cal, fit, out, plot)


def _measure(
    plan: Plan,
    launch: Launch,
    emulation: EmulationPlan | None,
    show_progress: bool,
    timeout_s: float,
    info: dict[str, Any],
) -> list[dict[str, Any]]:
    """Every launch of the workers (a fresh emulated cluster each); node 0's raw results."""
    raws: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="zsim-calibrate-") as tmp:
        plan_path = Path(tmp) / "plan.json"
        plan_path.write_text(json.dumps(plan.per_launch().to_dict()))
        with progress_bar(show_progress) as update:
            for k in range(plan.launches):
                raw_path = Path(tmp) / f"raw{k}.json"
                shown = launch_progress(update, k, plan.launches)
                with emulated(emulation) as cluster:
                    here = launch
                    if cluster is not None:  # node 0's fresh namespace: the default port is free
                        here = replace(
                            launch,
                            node_rank=0,
                            master_addr=cluster.address(0),
                            master_port=torchrun.TORCHRUN_PORT,
                        )
                    run_workers(plan, here, (plan_path, raw_path), shown, cluster, timeout_s)
                    if cluster is not None:
                        applied = cluster.emulation
                        info["emulation"] = applied.as_dict() if applied is not None else {}
                if launch.node_rank == 0:
                    raws.append(json.loads(raw_path.read_text()))
    return raws


def _write(cal: Calibration, fit: Fit, out: Path, plot: bool) -> Written:
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


def refit(cal: Calibration, out: Path, plot: bool = True) -> Written:
    """The stored measurements of `cal` fitted again with this zsim, written to `out`."""
    info = dict(cal.provenance) | {
        "refit_date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    }
    new, fit = fit_measurements(cal.name, cal.measurements, info, cal.plan)
    return _write(new, fit, out, plot)


def fit_measurements(
    name: str,
    measurements: tuple[Measurement, ...],
    info: Mapping[str, Any],
    plan: Mapping[str, Any],
) -> tuple[Calibration, Fit]:
    fit = fit_profile(name, measurements, info)
    held_out = held_out_residuals(name, measurements, info, fit.fitted)
    cal = Calibration(
        name=name,
        profile=fit.profile,
        measurements=measurements,
        residuals=fit.residuals + held_out,
        collective_params=fit.collective_params,
        provenance=dict(info),
        plan=dict(plan),
    )
    return cal, fit
