"""PyTorch FSDP2's own host time per call, measured as `engine_host` measures DeepSpeed's: real
steps of the tiny model (`LAYERS` x Linear(`WIDTH`, `WIDTH`)), each layer `fully_shard`-ed as
`zsim.step.fsdp` assumes and the root too, forward, backward and step timed apart on every
rank (CPU ranks, where the host thread is the device).

The validation's first FSDP runs (`benchmarks/validation/README.md`, 2026-12-03) spent 15 ms a
forward outside its collectives where the simulator charged 10 ms of kernels and copies, and
8 ms more in the step: FSDP's Python per unit (its pre- and post-forward hooks, the DTensor
bookkeeping of each gather and reduction) and torch's Adam and clip_grad_norm_ over DTensors.
`engine_fit` subtracts the simulated tiny step and keeps a cost per call and per parameter
tensor (here one per unit), per sharding and phase.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from zsim.calibrate.engine_fit import FSDP_SHARDINGS, LAYERS, MICRO_BATCH, tiny_model
from zsim.calibrate.engine_host import STEPS, WARMUP_STEPS, max_over_ranks
from zsim.calibrate.measurement import Kind, Measurement
from zsim.step.phases import PHASES


def fsdp_host(dtype: str) -> list[Measurement]:
    """Every rank runs this together; rank 0 keeps the rows: per sharding and phase, the
    slowest rank's time of each step."""
    rows = []
    for sharding in FSDP_SHARDINGS:
        for layers in LAYERS:
            times = _steps(sharding, layers)
            for phase in PHASES:
                samples = max_over_ranks([t[phase] for t in times])
                op = f"fsdp-{sharding}.{phase}"
                rows.append(Measurement(Kind.ENGINE_HOST, op, dtype, tuple(samples), params=layers))
    return rows if dist.get_rank() == 0 else []


def _steps(sharding: str, layers: int) -> list[dict[str, float]]:
    from zsim.testbed import torchmodels
    from zsim.testbed.fsdp_engine import FsdpEngine

    spec = tiny_model(layers)
    torch.manual_seed(0)
    engine = FsdpEngine(torchmodels.build(spec), {"sharding": sharding}, 1, torch.float32)
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
    return out
