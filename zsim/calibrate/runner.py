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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zsim.calibrate.fit import Fit, fit_profile
from zsim.calibrate.plan import PROGRESS, Plan
from zsim.calibrate.profile import Calibration, save_profile
from zsim.errors import require


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
    master_port: int = 0  # 0: a free port


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---- launching ----------------------------------------------------------------------------


def worker_argv(launch: Launch, plan_path: Path, raw_path: Path) -> list[str]:
    port = launch.master_port or _free_port()
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


def worker_env(device: str, launch: Launch) -> dict[str, str]:
    env = dict(os.environ)
    if device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    if launch.threads is not None:
        env["OMP_NUM_THREADS"] = str(launch.threads)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_workers(
    argv: list[str],
    env: Mapping[str, str],
    on_progress: Callable[[int, int, str], None],
    timeout_s: float | None = None,
) -> None:
    """Run torchrun; report `@zsim-progress` lines; raise CalibrationFailed with the output's
    tail when it fails."""
    tail: deque[str] = deque(maxlen=30)
    proc = subprocess.Popen(
        argv,
        env=dict(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(PROGRESS):
                _, done, total, label = [*line.rstrip("\n").split(" ", 3), ""][:4]
                on_progress(int(done), int(total), label)
            else:
                tail.append(line.rstrip("\n"))
        code = proc.wait(timeout=timeout_s)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 15)
        proc.wait(timeout=30)
        raise
    if code != 0:
        errors = [t for t in tail if "Error" in t or "error" in t] or list(tail)
        raise CalibrationFailed(
            f"the calibration workers failed (exit {code}): {errors[-1] if errors else ''}\n"
            + "\n".join(tail)
        )


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
) -> Written | None:
    """Measure, fit, write. Nothing is written at `out` unless everything succeeded. None on a
    node other than node 0 (it only measures; node 0 gathers and writes)."""
    check_machine(plan.device, launch.nproc)
    require(out.suffix == ".json", "out", str(out), "a path ending in .json")
    info: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "device": plan.device,
        "topology": plan.topology,
        "nproc_per_node": launch.nproc,
        "nnodes": launch.nnodes,
        "load_before": load_average(),
        **host_description(),
    }
    with tempfile.TemporaryDirectory(prefix="zsim-calibrate-") as tmp:
        plan_path, raw_path = Path(tmp) / "plan.json", Path(tmp) / "raw.json"
        plan_path.write_text(json.dumps(plan.to_dict()))
        with progress_bar(show_progress) as update:
            run_workers(
                worker_argv(launch, plan_path, raw_path), worker_env(plan.device, launch), update
            )
        if launch.node_rank != 0:
            return None
        raw = json.loads(raw_path.read_text())
    info["load_after"] = load_average()
    info |= raw["provenance"]
    info |= memory_of(info)
    cal, fit = fit_calibration(name, raw["measurements"], info, plan)
    written = save_profile(cal, out)
    if plot:
        from zsim.calibrate.plots import save_fit_png

        written.append(save_fit_png(cal, fit, out.with_name(out.stem + "-fit.png")))
    return Written(cal, fit, written)


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


def fit_calibration(
    name: str, rows: list[dict[str, Any]], info: Mapping[str, Any], plan: Plan
) -> tuple[Calibration, Fit]:
    from zsim.calibrate.plan import Measurement

    measurements = tuple(Measurement.from_dict(r) for r in rows)
    fit = fit_profile(name, measurements, info)
    cal = Calibration(
        name=name,
        profile=fit.profile,
        measurements=measurements,
        residuals=fit.residuals,
        collective_params=fit.collective_params,
        provenance=dict(info),
        plan=plan.to_dict(),
    )
    return cal, fit
