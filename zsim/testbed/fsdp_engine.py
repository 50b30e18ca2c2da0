"""PyTorch FSDP2 in the shape of a DeepSpeed engine, for the validation worker and the
calibration's host-time microbenchmark (needs torch).

The model is wrapped as `zsim.step.fsdp` assumes: `fully_shard` on each block (the seeds' MLP:
each Linear layer), then on the root; `MixedPrecisionPolicy(param_dtype=<dtype>,
reduce_dtype=float32)`; torch's Adam over the sharded parameters. HYBRID_SHARD runs on a 2D
mesh (replicate, shard) whose shard dimension is consecutive ranks. `engine(x, y)` is the
forward and loss, `backward` scales by the accumulation as DeepSpeed does, `step` steps and
zeroes the gradients (freed, `set_to_none`, torch's default).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

LEARNING_RATE = 1e-4  # as to_training_ds_config's Adam


class FsdpEngine:
    """The methods and fields of DeepSpeed's engine the worker uses."""

    def __init__(self, model: nn.Module, engine: dict[str, Any], accum: int, dtype: Any) -> None:
        world, device = dist.get_world_size(), "cpu"
        shard = int(engine.get("shard_size") or world)
        hybrid = engine["sharding"] == "hybrid"
        mesh = (
            init_device_mesh(device, (world // shard, shard), mesh_dim_names=("replicate", "shard"))
            if hybrid
            else init_device_mesh(device, (world,))
        )
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        again = engine["sharding"] != "grad-op"
        for unit in units(model):
            fully_shard(unit, mesh=mesh, reshard_after_forward=again, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)  # the root: kept gathered (lazy init)
        self.module = model
        self.optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)
        self.basic_optimizer = self.optimizer
        self.device = torch.device(device)
        self._accum = accum
        self._micro_batches = 0  # since construction: engine.step steps at every accum-th

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.module(*inputs)
        return out

    def gradient_accumulation_steps(self) -> int:
        return self._accum

    def backward(self, loss: torch.Tensor) -> None:
        torch.autograd.backward(loss / self._accum)

    def step(self) -> None:
        """At the accumulation boundary only, as DeepSpeed's engine.step is called after every
        micro-batch and steps at the boundary."""
        self._micro_batches += 1
        if self._micro_batches % self._accum:
            return
        torch.nn.utils.clip_grad_norm_(self.module.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad()


def units(model: nn.Module) -> list[nn.Module]:
    """The modules wrapped one by one: a decoder's blocks, the MLP's layers."""
    blocks = getattr(model, "blocks", None)
    found: nn.Module = blocks if blocks is not None else getattr(model, "net")  # noqa: B009
    return list(found.children())


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, or the tensor itself."""
    to_local = getattr(t, "to_local", None)
    out: torch.Tensor = to_local() if to_local is not None else t
    return out
