"""PyTorch FSDP2's own host time per call, measured as `engine_host` measures DeepSpeed's: real
steps of the tiny model (`LAYERS` x Linear(`WIDTH`, `WIDTH`)), each layer `fully_shard`-ed as
`zsim.step.fsdp` assumes and the root too, forward, backward and step timed apart on every
rank (CPU ranks, where the host thread is the device).

The validation's first FSDP runs (`benchmarks/validation/README.md`, 2026-12-03) spent 15 ms a
forward outside its collectives where the simulator charged 10 ms of kernels and copies, and
8 ms more in the step: FSDP's Python per unit (its pre- and post-forward hooks, the DTensor
bookkeeping of each gather and reduction) and torch's Adam and clip_grad_norm_ over DTensors.
`engine_fit` subtracts the simulated tiny step and keeps a cost per call, per unit and per
parameter tensor, per sharding and phase: 8 and 16 layers of one tensor each give per unit
plus per tensor, 8 layers with biases (two tensors each) per tensor alone, and 8 layers of
1 and 16 MiB (`device.FSDP_UNIT_SWEEP_MIB`) what a unit of that size costs beyond.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

from zsim.calibrate.engine_fit import BIASED, FSDP_SHARDINGS, WIDER, fsdp_sharding, sweep_width
from zsim.calibrate.engine_host import host_rows
from zsim.calibrate.measurement import Measurement
from zsim.cluster.device import FSDP_UNIT_SWEEP_MIB


def fsdp_host(dtype: str) -> list[Measurement]:
    """Every rank runs this together; rank 0 keeps the rows: per sharding and phase, the
    slowest rank's time of each step."""
    calls = [f"fsdp-{s}{v}" for s in FSDP_SHARDINGS for v in ("", BIASED, *SWEEP)]
    return host_rows(dtype, {call: partial(_fsdp, fsdp_sharding(call)) for call in calls})


SWEEP = tuple(f"{WIDER}{sweep_width(mib)}" for mib in FSDP_UNIT_SWEEP_MIB)  # "@512", "@2048"


def _fsdp(sharding: str, model: nn.Module) -> Any:
    from zsim.testbed.fsdp_engine import FsdpEngine

    return FsdpEngine(model, {"sharding": sharding}, 1, torch.float32)
