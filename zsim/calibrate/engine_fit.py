"""DeepSpeed's own host time per call, read off the tiny steps `engine_host` times: each
phase's mean minus what the simulator already charges for the same tiny step on the
fitted profile (its kernels, collectives and Adam step). Two layer counts give a line in the
parameter tensors (each tiny layer holds one): what a call costs and what each tensor adds
(ZeRO-3's step gathers every persistent parameter apart, `_post_step`), both at least 0. The
simulator charges them once per call on a CPU rank (`DeviceProfile.engine_host_s`, keys
"z<stage>.<phase>" and "z<stage>.<phase>_per_tensor"; `step.job.StageJob.engine_host_s`).
DeepSpeed's PipelineEngine likewise, per instruction ("pipe<stage>.<phase>", `pipe_host`):
rank 0's (the first stage's) time per call against the simulated tiny pipeline's on rank 0.
PyTorch FSDP2 likewise ("fsdp-<sharding>.<phase>", `fsdp_host`), each tiny layer a unit; its
cost per unit grows with the unit's bytes (`benchmarks/validation/README.md`, 2026-12-04: 0.6
ms a 16 KiB unit's forward, 1.3-1.4 a 4 MiB one's beyond the simulated copies and GEMMs), so
the same step at wider layers ("fsdp-full@2048") gives what a unit of each size costs beyond
the tiny one's ("..._per_unit_at_16MiB"; `device.unit_size_extra_s`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from zsim.calibrate.measurement import Kind, Measurement
from zsim.cluster.device import (
    FSDP_TINY_UNIT_BYTES,
    FSDP_UNIT_SWEEP_MIB,
    DeviceProfile,
    per_unit_at_key,
)
from zsim.cluster.topology import Topology
from zsim.step.phases import PHASES
from zsim.workload.model import ModelSpec
from zsim.workload.model_presets import preset, with_overrides
from zsim.workload.parallel import DpEngine, ParallelConfig, PipelineEngine, Precision, ZeroStage
from zsim.workload.sharding import FsdpSharding

LAYERS = (8, 16)
PIPE_STAGES = (0, 1)  # the ZeRO stages DeepSpeed's PipelineEngine runs
PIPE_PHASES = ("forward", "backward", "send", "step")
PIPE_MICRO_BATCHES = 4
FSDP_SHARDINGS = ("full", "grad-op")  # a hybrid mesh needs 4 ranks: charged as full
CALLS = (
    *(f"z{s}" for s in range(4)),
    *(f"pipe{s}" for s in PIPE_STAGES),
    *(f"fsdp-{s}" for s in FSDP_SHARDINGS),
)
_FSDP_UNIT = ("_per_unit", *(per_unit_at_key("", mib) for mib in FSDP_UNIT_SWEEP_MIB))
ENGINE_CALLS = tuple(
    f"{call}.{phase}{unit}"
    for call in CALLS
    for phase in (PIPE_PHASES if call.startswith("pipe") else PHASES)
    for unit in ("", "_per_tensor", *(_FSDP_UNIT if call.startswith("fsdp-") else ()))
)
"""The keys of a profile's `engine_host_s`: seconds per call, per parameter tensor and (FSDP)
per unit, and what a unit of each swept size costs beyond the tiny one's."""
BIASED = "+bias"  # a call's tiny model with biases: two tensors per layer ("fsdp-full+bias")
WIDTH = 64  # kernels of microseconds: the step is mostly the engine's own time
WIDER = "@"  # a call's tiny model at another width ("fsdp-full@2048"): FSDP2's unit-size sweep
assert 4 * WIDTH * WIDTH == FSDP_TINY_UNIT_BYTES
MICRO_BATCH = 4
HOST_SUFFIX = "_host"  # a phase's time outside collectives ("z3.forward_host")


def tiny_model(layers: int, bias: bool = False, width: int = WIDTH) -> ModelSpec:
    """The model the microbenchmark trains: `layers` x Linear(width, width), no bias (with
    `bias`, two tensors a layer: FSDP's cost per unit and per tensor apart)."""
    return replace(with_overrides(preset("toy-mlp"), layers=layers, hidden=width), bias=bias)


def sweep_width(mib: int) -> int:
    """The width whose Linear(width, width) holds `mib` MiB of fp32 parameters."""
    return math.isqrt((mib << 20) // 4)


def call_model(call: str, layers: int) -> ModelSpec:
    """The tiny model of a microbenchmark call ("z3", "fsdp-full+bias", "fsdp-full@2048")."""
    width = int(call.split(WIDER)[1]) if WIDER in call else WIDTH
    return tiny_model(layers, call.endswith(BIASED), width)


def fsdp_sharding(call: str) -> str:
    """The sharding of an FSDP2 call ("fsdp-grad-op@2048" -> "grad-op")."""
    return call.removeprefix("fsdp-").split(WIDER)[0].removesuffix(BIASED)


def call_layers(call: str) -> tuple[int, ...]:
    """The layer counts a call is timed at: both for a line in the tensors, else the first."""
    return LAYERS[:1] if call.endswith(BIASED) or WIDER in call else LAYERS


def tiny_case(stage: int, world: int) -> ParallelConfig:
    return ParallelConfig(
        dp=world, zero_stage=ZeroStage(stage), micro_batch=MICRO_BATCH, precision=Precision.FP32
    )


def tiny_pipe_case(stage: int, world: int) -> ParallelConfig:
    """A stage per rank, DeepSpeed's PipelineEngine, `PIPE_MICRO_BATCHES` per step."""
    return ParallelConfig(
        pp=world,
        zero_stage=ZeroStage(stage),
        micro_batch=MICRO_BATCH,
        grad_accum=PIPE_MICRO_BATCHES,
        precision=Precision.FP32,
        pipeline_engine=PipelineEngine.DEEPSPEED,
    )


def tiny_fsdp_case(sharding: str, world: int) -> ParallelConfig:
    """FSDP2 over every rank with `sharding` (each tiny layer a unit)."""
    fsdp = {"dp_engine": DpEngine.FSDP, "fsdp_sharding": FsdpSharding(sharding)}
    return replace(tiny_case(3, world), **fsdp)  # type: ignore[arg-type]


def engine_host_s(
    profile: DeviceProfile, rows: Sequence[Measurement], topology: str
) -> dict[str, float]:
    """{"z<stage>.<phase>": host seconds per call, "..._per_tensor": per parameter tensor}
    from the ENGINE_HOST rows (ops "z<stage>.<phase>" or "pipe<stage>.<phase>", `params` =
    layers; a pipeline's rank holds its stage's share). Where a call has "<phase>_host" rows
    (its time outside collectives), those are read against the simulated time outside
    collectives, so that what the collective model misses on the tiny messages is not
    taken for host time; else the whole phase against the whole simulated phase."""
    from zsim.inputs import presets

    measured = [r for r in rows if r.kind is Kind.ENGINE_HOST]
    if not measured:
        return {}
    host_calls = {r.op.split(".")[0] for r in measured if r.op.endswith(HOST_SUFFIX)}
    chosen = [
        r for r in measured if r.op.endswith(HOST_SUFFIX) == (r.op.split(".")[0] in host_calls)
    ]
    topo = presets.topology(topology)
    bare = replace(profile, engine_host_s={})
    extra: dict[str, list[tuple[int, int, float]]] = {}
    wide: dict[str, list[tuple[int, int, float]]] = {}  # FSDP2's sweep: key -> (MiB, units, s)
    for call, layers in sorted({(r.op.split(".")[0], r.params) for r in chosen}):
        simulated = _simulated(call, layers, bare, topo)
        base, _, width = call.partition(WIDER)
        for r in chosen:
            if r.op.startswith(f"{call}.") and r.params == layers:
                beyond = r.time_s - simulated[r.op.split(".")[1]]
                held = layers // topo.world_size if call.startswith("pipe") else layers
                phase = r.op.split(".")[1].removesuffix(HOST_SUFFIX)
                key = f"{base.replace(BIASED, '')}.{phase}"
                if width:
                    mib = 4 * int(width) ** 2 >> 20
                    wide.setdefault(key, []).append((mib, held, beyond))
                    continue
                tensors = 2 * held if call.endswith(BIASED) else held
                extra.setdefault(key, []).append((held, tensors, beyond))  # rank 0's
    out = {k: v for key, points in extra.items() for k, v in _line(key, points).items()}
    return out | _unit_sizes(out, wide)


def _unit_sizes(
    fitted: dict[str, float], wide: dict[str, list[tuple[int, int, float]]]
) -> dict[str, float]:
    """What a unit of each swept size costs per call beyond the tiny unit's: the sweep's
    one-tensor units, less what the tiny fit charges them, per unit; at least 0."""
    out = {}
    for key, points in wide.items():
        per_unit = fitted.get(f"{key}_per_unit", 0.0) + fitted.get(f"{key}_per_tensor", 0.0)
        for mib, units, beyond in points:
            tiny = fitted.get(key, 0.0) + per_unit * units
            out[per_unit_at_key(key, mib)] = max(0.0, (beyond - tiny) / units)
    return out


def _line(key: str, points: list[tuple[int, int, float]]) -> dict[str, float]:
    """Seconds per call and per tensor from points (units, tensors, seconds) of one unit per
    tensor; with a point of two tensors per unit (a biased tiny model), per unit apart from
    per tensor too. Each at least 0."""
    plain = sorted(p for p in points if p[0] == p[1])
    (l0, _, t0), (l1, _, t1) = plain[0], plain[-1]
    slope = max(0.0, (t1 - t0) / (l1 - l0)) if l1 > l0 else 0.0
    out = {key: max(0.0, t0 - slope * l0), f"{key}_per_tensor": slope}
    biased = [p for p in points if p[1] > p[0]]
    if biased:
        units, tensors, t = biased[0]
        same = next((p for p in plain if p[0] == units), plain[0])  # as many units, 1 tensor
        per_tensor = min(slope, max(0.0, (t - same[2]) / (tensors - same[1])))
        out |= {f"{key}_per_tensor": per_tensor, f"{key}_per_unit": slope - per_tensor}
    return out


def _simulated(call: str, layers: int, bare: DeviceProfile, topo: Topology) -> dict[str, float]:
    """Seconds per call the simulator charges rank 0 for the tiny step of `call` ("z<stage>",
    "pipe<stage>" or "fsdp-<sharding>"), by phase."""
    from zsim.simulation import simulate
    from zsim.step.phases import simulated_phases, simulated_pipeline_phases

    pipe, world = call.startswith("pipe"), topo.world_size
    if call.startswith("fsdp-"):
        case = tiny_fsdp_case(fsdp_sharding(call), world)
    else:
        stage = int(call.removeprefix("pipe" if pipe else "z"))
        case = (tiny_pipe_case if pipe else tiny_case)(stage, world)
    report = simulate(call_model(call, layers), case, topo, bare, fold=False)  # reads spans
    spans = report.engine.all_spans()
    if not pipe:
        phases = simulated_phases(spans, 0, report.step_time_s)
        outside = {f"{p}{HOST_SUFFIX}": phases[p] - phases[f"{p}_comm"] for p in PHASES}
        return phases | outside
    phases = simulated_pipeline_phases(spans, 0, report.step_time_s)
    m = case.grad_accum
    sends = sum(s.end_s - s.start_s for s in spans if s.rank == 0 and s.name.startswith("send."))
    return {"forward": phases["forward"] / m, "backward": phases["backward"] / m,
            "send": sends / m, "step": phases["step"]}  # fmt: skip
