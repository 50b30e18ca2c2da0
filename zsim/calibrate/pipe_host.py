"""DeepSpeed's PipelineEngine's own host time per instruction, measured: real `train_batch`
steps of a tiny `PipelineModule` over every rank (one stage each), each instruction of its
TrainSchedule timed on rank 0 (the first stage, whose instructions wait on no other rank's:
its sends return once gloo has the message, its last backward ends the pipeline's).

Phase diagnosis of the pipeline validation (`benchmarks/validation/README.md`) left 10-20 ms of
a 102-119 ms step that no calibration row covered, in the engine's Python around each
instruction (about 20 per stage and step). A stage of `engine_fit.LAYERS` / world linear
layers `WIDTH` wide has kernels and messages of microseconds, so each instruction's time is
mostly that host work; `zsim.calibrate.engine_fit` subtracts what the simulator charges for the
same tiny step and keeps the rest per call ("pipe<stage>.<phase>": forward, backward, the
step's reduce, tied reduce and optimizer instructions together, and a send).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from zsim.calibrate.engine_fit import LAYERS, PIPE_PHASES, PIPE_STAGES, WIDTH, tiny_pipe_case
from zsim.calibrate.measurement import Kind, Measurement
from zsim.step.phases import PIPE_INSTRUCTIONS
from zsim.workload.ds_config import to_training_ds_config

WARMUP_STEPS = 5
STEPS = 15
_PHASE_OF = {**PIPE_INSTRUCTIONS, "SendActivation": "send"}  # instruction -> charged phase


def pipe_host(dtype: str) -> list[Measurement]:
    """Every rank runs this together; rank 0 keeps the rows: per stage and phase, its mean
    seconds per call in each step (a step's `step` phase is one call of its three)."""
    if dist.get_world_size() < 2:
        return []
    rows = []
    for stage in PIPE_STAGES:
        for layers in LAYERS:
            per_step = _steps(stage, layers)
            for phase in PIPE_PHASES:
                samples = tuple(s[phase] for s in per_step)
                op = f"pipe{stage}.{phase}"
                rows.append(Measurement(Kind.ENGINE_HOST, op, dtype, samples, params=layers))
    return rows if dist.get_rank() == 0 else []


def _steps(stage: int, layers: int) -> list[dict[str, float]]:
    import deepspeed  # the calibrate extra
    from deepspeed.pipe import PipelineModule

    world = dist.get_world_size()
    case = tiny_pipe_case(stage, world)
    torch.manual_seed(0)
    linear = [nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)]
    model = PipelineModule(
        layers=linear, num_stages=world, loss_fn=F.mse_loss, partition_method="uniform"
    )
    config = to_training_ds_config(case)
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    x = torch.randn(case.micro_batch, WIDTH)

    def data() -> Any:
        while True:
            yield x, x

    spent: dict[str, list[float]] = defaultdict(list)
    engine._INSTRUCTION_MAP = {  # the instance's own map: the class's stays as it was
        kind: _timed(run, spent[_PHASE_OF[kind.__name__]]) if kind.__name__ in _PHASE_OF else run
        for kind, run in type(engine)._INSTRUCTION_MAP.items()
    }
    batches, out = data(), []
    for i in range(WARMUP_STEPS + STEPS):
        for calls in spent.values():
            calls.clear()
        dist.barrier()
        engine.train_batch(batches)
        if i >= WARMUP_STEPS:
            out.append({p: _per_call(p, spent[p], case.grad_accum) for p in PIPE_PHASES})
    engine.destroy()
    return out


def _per_call(phase: str, seconds: list[float], micro_batches: int) -> float:
    """A step's mean seconds per call: per micro-batch for passes and sends, per step for the
    step's instructions."""
    return sum(seconds) / (1 if phase == "step" else micro_batches)


def _timed(run: Callable[..., Any], spent: list[float]) -> Callable[..., Any]:
    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return run(self, *args, **kwargs)
        finally:
            spent.append(time.perf_counter() - start)

    return timed
