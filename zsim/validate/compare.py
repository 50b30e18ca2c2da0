"""Predicted against measured: the simulator's step time (with a band from the profile's
spread) and the memory ledger, beside what the real run measured; errors and the MAPE.

The prediction sees only the case (model, layout, the cluster it ran on) and a calibrated
profile. Nothing measured in validation goes into it, and nothing here writes to a profile.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from zsim.errors import InputError
from zsim.memory import MemoryLedger, ledger
from zsim.step.phases import simulated_phases, simulated_pipeline_phases
from zsim.testbed.nic import frame_bytes
from zsim.validate.band import model_error, widened
from zsim.validate.runner import Case, Measurement

BAND_PERCENTILES = (5.0, 95.0)
MEMORY_CATEGORIES = ("parameters", "gradients", "optimizer_states", "comm_buffers", "activations")


@dataclass(frozen=True)
class Prediction:
    step_time_s: float
    low_s: float  # 5th percentile over profiles sampled from the calibration's spread
    high_s: float  # 95th percentile
    memory: MemoryLedger
    band_samples: int  # profiles simulated for the band (0: none, low = high = step time)
    phases: dict[str, float] = field(default_factory=dict)  # rank 0's (`phase_split`)
    model_error: float = 0.0  # the band's model part, relative (`band.model_error`)
    # bytes a step puts on the links between nodes and their switch, both directions
    nic_bytes: float | None = None


class PredictionUnavailable(Exception):
    """No prediction for this case, and why (no profile, no simulator, the simulator failed)."""


Simulate = Callable[..., Any]


def _simulator() -> Simulate:
    """`zsim.simulate(model, parallel, topology, device) -> Report`."""
    try:
        from zsim.simulation import simulate
    except ImportError as exc:
        raise PredictionUnavailable(f"the simulator is not available ({exc})") from None
    return simulate


def predict(
    case: Case, profile_path: Path | None, band_samples: int = 20, burst_bytes: int | None = None
) -> Prediction:
    """Simulate `case` on the cluster it ran on, with the calibrated profile at `profile_path`;
    the band is the 5th-95th percentile over `band_samples` profiles resampled from the
    calibration's repeats, widened by the model's own error on held-out microbenchmarks
    (`zsim.validate.band`). The bytes between nodes are the frames their interfaces count
    (`testbed.nic.frame_bytes`; `burst_bytes`: the emulated links' tbf bucket)."""
    if profile_path is None:
        raise PredictionUnavailable("no --profile given (make one with `zsim calibrate`)")
    simulate = _simulator()
    from zsim.calibrate.profile import load_calibration, sample_profiles
    from zsim.inputs import presets

    topology = presets.topology(case.topology)
    try:
        calibration = load_calibration(profile_path)
        # its phases are cut from every task's span: no steady-state fold
        report = simulate(case.model, case.parallel, topology, calibration.profile, fold=False)
        step = float(report.step_time_s)
        samples: list[float] = []
        if band_samples > 0:
            try:
                profiles = sample_profiles(calibration, band_samples, seed=0)
            except InputError:  # a profile without raw measurements: no band
                profiles = []
            samples = [
                float(simulate(case.model, case.parallel, topology, p).step_time_s)
                for p in profiles
            ]
    except Exception as exc:  # a profile that lacks a rate, a simulator bug: note it per case
        raise PredictionUnavailable(f"the simulator failed: {type(exc).__name__}: {exc}") from exc
    low, high = (
        (float(np.percentile(samples, BAND_PERCENTILES[0])), float(np.percentile(samples, 95.0)))
        if samples
        else (step, step)
    )
    critical = report.critical
    residuals = calibration.residuals  # held-out ones among them
    error = model_error(residuals, critical.compute_s, critical.exposed_comm_s, step)
    low, high = widened(min(low, step), max(high, step), error)
    cut = simulated_pipeline_phases if case.parallel.pp > 1 else simulated_phases
    phases = cut(report.engine.all_spans(), 0, step)
    nic = None
    if case.nodes > 1:
        nic = frame_bytes(node_link_bytes(report.link_traffic_bytes, topology), burst_bytes)
    return Prediction(step, low, high, report.memory, len(samples), phases, error, nic)


def node_link_bytes(link_bytes: dict[str, float], topology: Any) -> float:
    """Bytes on the links of the nodes' NICs (the class the fabric names), over both
    directions: what the nodes' interfaces count as received plus sent."""
    return float(link_bytes.get(str(topology.fabric.nic_class), 0.0))


# ---- rows -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Compared:
    """One case: what was measured, what was predicted (or why not), and the errors."""

    measurement: Measurement
    prediction: Prediction | None
    prediction_note: str
    ledger: MemoryLedger

    @property
    def case(self) -> Case:
        return self.measurement.case

    @property
    def step_error_pct(self) -> float | None:
        m, p = self.measurement.step_time_s, self.prediction
        if m is None or p is None:
            return None
        return error_pct(p.step_time_s, m)

    @property
    def nic_error_pct(self) -> float | None:
        """The simulated bytes on the nodes' links against what their interfaces counted."""
        got, p = self.measurement.nic_bytes_per_step, self.prediction
        if got is None or p is None or p.nic_bytes is None:
            return None
        return error_pct(p.nic_bytes, got)

    def measured_memory(self) -> dict[str, int | None]:
        m = self.measurement
        held = m.held_bytes or {}
        out: dict[str, int | None] = {c: held.get(c) for c in MEMORY_CATEGORIES}
        out["activations"] = m.activations_bytes
        return out

    def ledger_memory(self) -> dict[str, float]:
        lg = self.ledger
        return {
            "parameters": lg.parameters,
            # the engine's gradient tensors include the optimizer step's fp32 partition
            "gradients": lg.gradients + lg.step_buffers,
            "optimizer_states": lg.optimizer_states,
            "comm_buffers": lg.comm_buffers,
            "activations": lg.activations if lg.activations is not None else math.nan,
        }


def error_pct(predicted: float, measured: float) -> float | None:
    """Signed error of a prediction, in % of the measurement (None when nothing was measured)."""
    if measured == 0:
        return None
    return 100.0 * (predicted - measured) / measured


def mape(rows: Sequence[Compared]) -> float | None:
    """Mean absolute step-time error (%) over the cases with both numbers."""
    errors = [abs(e) for r in rows if (e := r.step_error_pct) is not None]
    return sum(errors) / len(errors) if errors else None


def compare(
    measurement: Measurement,
    profile_path: Path | None,
    band_samples: int = 20,
    burst_bytes: int | None = None,
) -> Compared:
    case = measurement.case
    prediction, note = None, ""
    try:
        prediction = predict(case, profile_path, band_samples, burst_bytes)
    except PredictionUnavailable as exc:
        note = str(exc)
    return Compared(measurement, prediction, note, ledger(case.model, case.parallel))
