"""DeepSpeed's own host time per call, measured: real steps of a tiny model for each ZeRO
stage, forward, backward and step timed apart on every rank (CPU ranks, where the host
thread is the device).

Phase diagnosis of the validation runs (`benchmarks/validation/README.md`) found host time the
simulation lacks: the engine's Python around each `engine(x)`, `engine.backward` and
`engine.step` (its hooks and coordinator, bucket bookkeeping, the optimizer wrapper). A step
of `LAYERS` linear layers `WIDTH` wide has kernels and messages of microseconds, so what it
takes is mostly that host time. The time the rank's thread spends inside collectives is
timed apart and left out (on a shaped link a tiny message costs more than the collective
model says, and that is not host time); `zsim.calibrate.engine_fit` subtracts what the
simulator already charges outside collectives for the same tiny step (its kernels, its Adam
step) and keeps the rest, per stage and phase, as a cost per call and one per parameter
tensor (two layer counts). A microbenchmark of the engine: the validation's models are not
used.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zsim.calibrate.engine_fit import (
    HOST_SUFFIX,
    MICRO_BATCH,
    call_layers,
    call_model,
    tiny_case,
)
from zsim.calibrate.measurement import Kind, Measurement
from zsim.step.phases import PHASES
from zsim.testbed.phase_clock import PhaseClock
from zsim.workload.ds_config import to_training_ds_config
from zsim.workload.model import ModelSpec

WARMUP_STEPS = 5
STEPS = 15
STAGES = (0, 1, 2, 3)


def ds_config(stage: int) -> dict[str, Any]:
    """The stage as zsim's validation runs it (DeepSpeed's defaults, `validate.runner`)."""
    return to_training_ds_config(tiny_case(stage, dist.get_world_size()))


def engine_host(dtype: str) -> list[Measurement]:
    """Every rank runs this together; rank 0 keeps the rows: per stage and phase, the slowest
    rank's time of each step."""
    return host_rows(dtype, {f"z{stage}": partial(_deepspeed, stage) for stage in STAGES})


def host_rows(dtype: str, engines: Mapping[str, Callable[[nn.Module], Any]]) -> list[Measurement]:
    """For each call ("z<stage>", "fsdp-<sharding>", `engine_fit.call_model`'s) and layer
    count (`call_layers`), the tiny model's steps on the engine its builder makes, two rows
    per phase (rank 0's): "<call>.<phase>", the phase's wall time, and "<call>.<phase>_host",
    the same less the time the rank's thread spent inside collectives (what `engine_fit`
    reads)."""
    rows = []
    for call, build in engines.items():
        for layers in call_layers(call):
            times = _steps(build, call_model(call, layers))
            for phase in (*PHASES, *(f"{p}{HOST_SUFFIX}" for p in PHASES)):
                samples = max_over_ranks([t[phase] for t in times])
                op = f"{call}.{phase}"
                rows.append(Measurement(Kind.ENGINE_HOST, op, dtype, tuple(samples), params=layers))
    return rows if dist.get_rank() == 0 else []


def _deepspeed(stage: int, model: nn.Module) -> Any:
    import deepspeed  # the calibrate extra; imported here so that the other rows need not

    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config(stage)
    )
    return engine


def _steps(build: Callable[[nn.Module], Any], spec: ModelSpec) -> list[dict[str, float]]:
    from zsim.testbed import torchmodels

    torch.manual_seed(0)
    engine = build(torchmodels.build(spec))
    x, y = torchmodels.batch(spec, MICRO_BATCH, dtype=torch.float32, device=engine.device)
    clock = _collective_clock()
    try:
        for _ in range(WARMUP_STEPS + STEPS):
            dist.barrier()
            clock.start_step()
            with clock.phase("forward"):
                loss = engine(x, y)
            with clock.phase("backward"):
                engine.backward(loss)
            with clock.phase("step"):
                engine.step()
            clock.end_step()
    finally:
        clock.restore()
    destroy = getattr(engine, "destroy", None)  # DeepSpeed's; FSDP has nothing to tear down
    if destroy is not None:
        destroy()
    return [_with_host(step) for step in clock.steps[WARMUP_STEPS:]]


def _collective_clock() -> PhaseClock:
    """A clock on torch.distributed's collectives and, when DeepSpeed's engine made one, on
    deepspeed.comm's backend (its shared-memory all-reduce bypasses torch)."""
    clock = PhaseClock()
    clock.instrument(torch.distributed)
    ds_comm = sys.modules.get("deepspeed.comm.comm")
    backend = getattr(ds_comm, "cdb", None)
    if backend is not None:
        clock.instrument(backend)
    return clock


def _with_host(step: dict[str, Any]) -> dict[str, float]:
    """A step's phases, and each less the collectives its thread was inside."""
    comm = step["comm_s"]
    inside = {p: sum(v for k, v in comm.items() if k.startswith(f"{p}.")) for p in PHASES}
    return {p: step[p] for p in PHASES} | {f"{p}{HOST_SUFFIX}": step[p] - inside[p] for p in PHASES}


def max_over_ranks(samples: list[float]) -> list[float]:
    t = torch.tensor(samples, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [float(v) for v in t]
