"""DeepSpeed's own host time per call, measured: real steps of a tiny model for each ZeRO
stage, forward, backward and step timed apart on every rank (CPU ranks, where the host
thread is the device).

Phase diagnosis of the validation runs (`benchmarks/validation/README.md`) found host time the
simulation lacks: the engine's Python around each `engine(x)`, `engine.backward` and
`engine.step` (its hooks and coordinator, bucket bookkeeping, the optimizer wrapper). A step
of `LAYERS` linear layers `WIDTH` wide has kernels and messages of microseconds, so what it
takes is mostly that host time; `zsim.calibrate.engine_fit` subtracts what the
simulator already charges for the same tiny step (its collectives' call latencies, its
kernels, its Adam step) and keeps the rest, per stage and phase, as a cost per call and one
per parameter tensor (two layer counts). A microbenchmark of the engine: the validation's
models are not used.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zsim.calibrate.engine_fit import LAYERS, MICRO_BATCH, tiny_case, tiny_model
from zsim.calibrate.measurement import Kind, Measurement
from zsim.step.phases import PHASES
from zsim.workload.ds_config import to_training_ds_config

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
    """For each call ("z<stage>", "fsdp-<sharding>") and layer count, the tiny model's steps
    on the engine its builder makes, one row per phase (ops "<call>.<phase>"); rank 0's."""
    rows = []
    for call, build in engines.items():
        for layers in LAYERS:
            times = _steps(build, layers)
            for phase in PHASES:
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


def _steps(build: Callable[[nn.Module], Any], layers: int) -> list[dict[str, float]]:
    from zsim.testbed import torchmodels

    spec = tiny_model(layers)
    torch.manual_seed(0)
    engine = build(torchmodels.build(spec))
    x, y = torchmodels.batch(spec, MICRO_BATCH, dtype=torch.float32, device=engine.device)
    out = []
    for i in range(WARMUP_STEPS + STEPS):
        dist.barrier()
        t0 = time.perf_counter()
        loss = engine(x, y)
        t1 = time.perf_counter()
        engine.backward(loss)
        t2 = time.perf_counter()
        engine.step()
        t3 = time.perf_counter()
        if i >= WARMUP_STEPS:
            out.append({"forward": t1 - t0, "backward": t2 - t1, "step": t3 - t2})
    destroy = getattr(engine, "destroy", None)  # DeepSpeed's; FSDP has nothing to tear down
    if destroy is not None:
        destroy()
    return out


def max_over_ranks(samples: list[float]) -> list[float]:
    t = torch.tensor(samples, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [float(v) for v in t]
