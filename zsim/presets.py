"""Built-in presets found in the data folders: GPU profiles (spec sheet + reference fit)."""

from __future__ import annotations

from functools import cache
from pathlib import Path

from zsim.config_io import data_dir, load_csv, load_mapping
from zsim.errors import InputError
from zsim.hardware import DeviceProfile, profile_from_spec


def _gpu_dir() -> Path:
    return data_dir("calibration") / "presets"


def gpu_names() -> list[str]:
    return sorted(p.stem for p in _gpu_dir().glob("*.yaml"))


@cache
def gpu(name: str) -> DeviceProfile:
    """A built-in GPU profile by name (e.g. `a100-80gb`)."""
    if name not in gpu_names():
        raise InputError("gpu", name, "one of " + ", ".join(gpu_names()))
    spec = load_mapping(_gpu_dir() / f"{name}.yaml", "gpu")
    measured_on = None
    if "efficiency_from" in spec:
        measured_on = load_mapping(_gpu_dir() / f"{spec['efficiency_from']}.yaml", "gpu")
    reference = load_csv(data_dir("calibration") / "reference" / "microbenchmarks_gemm_hbm.csv")
    return profile_from_spec(spec, reference, measured_on)
