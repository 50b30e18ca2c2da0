"""DeepSpeed's own host time per call, read off the tiny steps `engine_host` times: each
phase's median minus what the simulator already charges for the same tiny step on the
fitted profile (its kernels, collectives and Adam step). Two layer counts give a line in the
parameter tensors (each tiny layer holds one): what a call costs and what each tensor adds
(ZeRO-3's step gathers every persistent parameter apart, `_post_step`), both at least 0. The
simulator charges them once per call on a CPU rank (`DeviceProfile.engine_host_s`, keys
"z<stage>.<phase>" and "z<stage>.<phase>_per_tensor"; `step.job.StageJob.engine_host_s`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from zsim.calibrate.measurement import Kind, Measurement
from zsim.cluster.device import DeviceProfile
from zsim.workload.model import ModelSpec
from zsim.workload.model_presets import preset, with_overrides
from zsim.workload.parallel import ParallelConfig, Precision, ZeroStage

LAYERS = (8, 16)
WIDTH = 64  # kernels of microseconds: the step is mostly the engine's own time
MICRO_BATCH = 4


def tiny_model(layers: int) -> ModelSpec:
    """The model the microbenchmark trains: `layers` x Linear(WIDTH, WIDTH), no bias."""
    return replace(with_overrides(preset("toy-mlp"), layers=layers, hidden=WIDTH), bias=False)


def tiny_case(stage: int, world: int) -> ParallelConfig:
    return ParallelConfig(
        dp=world, zero_stage=ZeroStage(stage), micro_batch=MICRO_BATCH, precision=Precision.FP32
    )


def engine_host_s(
    profile: DeviceProfile, rows: Sequence[Measurement], topology: str
) -> dict[str, float]:
    """{"z<stage>.<phase>": host seconds per call, "..._per_tensor": per parameter tensor}
    from the ENGINE_HOST rows (ops "z<stage>.<phase>", `params` = layers)."""
    from zsim.inputs import presets
    from zsim.simulation import simulate
    from zsim.step.phases import simulated_phases

    measured = [r for r in rows if r.kind is Kind.ENGINE_HOST]
    if not measured:
        return {}
    topo = presets.topology(topology)
    bare = replace(profile, engine_host_s={})
    extra: dict[str, list[tuple[int, float]]] = {}
    for stage, layers in sorted({(int(r.op.split(".")[0][1:]), r.params) for r in measured}):
        report = simulate(tiny_model(layers), tiny_case(stage, topo.world_size), topo, bare)
        simulated = simulated_phases(report.engine.all_spans(), 0, report.step_time_s)
        for r in measured:
            if r.op.startswith(f"z{stage}.") and r.params == layers:
                beyond = r.median_s - simulated[r.op.split(".")[1]]
                extra.setdefault(r.op, []).append((layers, beyond))
    out = {}
    for call, points in extra.items():
        (l0, t0), (l1, t1) = min(points), max(points)
        per_tensor = max(0.0, (t1 - t0) / (l1 - l0)) if l1 > l0 else 0.0
        out[call] = max(0.0, t0 - per_tensor * l0)
        out[f"{call}_per_tensor"] = per_tensor
    return out
