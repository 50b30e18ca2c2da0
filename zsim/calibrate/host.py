"""The machine a calibration runs on: what it can run (refused before anything is written),
what it is (CPU, cores, memory, load: recorded in the profile), and the memory one rank has."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import platform
import socket
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from zsim.errors import InputError, require


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
