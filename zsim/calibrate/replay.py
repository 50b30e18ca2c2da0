"""The simulator's time of a measured row under a profile: what `zsim run` would predict for
that microbenchmark. Only the simulator's own functions are used (not the fit's): a kernel from
`DeviceProfile.op_time_s`, a layer from `DeviceProfile.layer_time`, a copy or an Adam step from
the profile's rates, a collective from the flow simulation (`communicator.simulate_s`) of
the calls the microbenchmark ran, on the measured cluster's topology with the profile applied."""

from __future__ import annotations

from collections.abc import Callable

from zsim.calibrate.bounds import group_gpus
from zsim.calibrate.links import calls_of
from zsim.calibrate.measurement import LAYER_FIELDS, Kind, Measurement
from zsim.calibrate.profile import Calibration
from zsim.cluster.calibrated import apply_profile
from zsim.cluster.device import ADAM_STEP_BYTES_PER_PARAM, DeviceProfile
from zsim.cluster.topology import Topology
from zsim.inputs import presets
from zsim.network.communicator import simulate_s
from zsim.workload.model import ComputeOp, OpKind


def simulated_s(profile: DeviceProfile, topo: Topology | None, row: Measurement) -> float:
    """Seconds per call of `row`'s microbenchmark; `topo` has the profile applied
    (`zsim.calibrate.links.apply_profile`; needed for collective and ping-pong rows). A
    ping-pong's one-way time is its route's latency: the model's time of a byte alone."""
    if row.kind is Kind.GEMM:
        op = ComputeOp(row.op, OpKind.GEMM, row.flops, 0.0, row.shape[:3], row.shape[3])
        return profile.op_time_s(op, row.dtype)
    if row.kind is Kind.ATTENTION:
        return profile.op_time_s(ComputeOp(row.op, OpKind.ATTENTION, row.flops, 0.0), row.dtype)
    if row.kind is Kind.MEMORY:
        return profile.op_time_s(ComputeOp(row.op, OpKind.MEMORY, 0.0, row.size_bytes), row.dtype)
    if row.kind in LAYER_FIELDS:
        layer = profile.layer_time(row.layer_key)
        seconds = None if layer is None else getattr(layer, LAYER_FIELDS[row.kind])
        if seconds is None:
            raise KeyError(f"the profile has no {row.kind} time for layer {row.layer_key}")
        return float(seconds)
    if row.kind is Kind.HOST_COPY:
        return row.size_bytes / profile.host_link_bytes_per_s
    if row.kind is Kind.OPTIMIZER:
        return row.params * ADAM_STEP_BYTES_PER_PARAM / profile.optimizer_bytes_per_s
    if row.kind is Kind.ENGINE_HOST:
        raise ValueError(f"{row.label}: a whole step's phase, not one op the simulator times")
    if topo is None:
        raise ValueError(f"{row.label}: a collective or ping-pong row needs its topology")
    if row.kind is Kind.PINGPONG:
        a, b = group_gpus(topo, row.group, 2)[:2]
        return float(topo.route(a, b).latency_s)
    return max(simulate_s(topo, calls_of(topo, row)))


def model_of(cal: Calibration) -> Callable[[Measurement], float]:
    """`simulated_s` of a row under the calibration's profile, on the topology it measured."""
    topo = apply_profile(presets.topology(str(cal.provenance["topology"])), cal.profile)
    return lambda row: simulated_s(cal.profile, topo, row)
