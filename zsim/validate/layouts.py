"""The model a validation rank trains, by layout (needs torch and DeepSpeed; run by the worker).

- data parallel: `torchmodels.build`, DeepSpeed's engine over every rank;
- tensor parallel (tp > 1): one rank's Megatron shard (`tp_layers.TpDecoder`); TP groups are
  consecutive ranks and data-parallel groups stride over them (Megatron's order, tp innermost),
  handed to DeepSpeed as its `mpu`;
- pipeline parallel (pp > 1): DeepSpeed's `PipelineModule` of the seeds' Linear layers split
  uniformly over pp stages, trained by its `PipelineEngine.train_batch` (its 1F1B
  `TrainSchedule`: one train_batch is a whole optimizer step of `gradient_accumulation_steps`
  micro-batches);
- PyTorch FSDP2 (`fsdp_engine`), data parallel, in place of DeepSpeed's engine.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.pipe import PipelineModule
from torch import nn
from torch.nn import functional as F

from zsim.testbed import torchmodels, tp_layers
from zsim.workload.model import ModelSpec


class TensorParallelGroups:
    """Megatron-style `mpu` for DeepSpeed: TP groups of consecutive ranks, DP groups across."""

    def __init__(self, tp: int) -> None:
        world, rank = dist.get_world_size(), dist.get_rank()
        self.tp, self.dp = tp, world // tp
        tp_groups = [list(range(i * tp, (i + 1) * tp)) for i in range(self.dp)]
        dp_groups = [list(range(j, world, tp)) for j in range(tp)]
        # every rank creates every group, in the same order
        tp_handles = [dist.new_group(r) for r in tp_groups]
        dp_handles = [dist.new_group(r) for r in dp_groups]
        self.tp_group, self.tp_rank = tp_handles[rank // tp], rank % tp
        self.dp_group, self.dp_rank = dp_handles[rank % tp], rank // tp
        self.dp_ranks = dp_groups[rank % tp]

    def get_model_parallel_group(self) -> Any:
        return self.tp_group

    def get_model_parallel_rank(self) -> int:
        return self.tp_rank

    def get_model_parallel_world_size(self) -> int:
        return self.tp

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size

    def get_data_parallel_group(self) -> Any:
        return self.dp_group

    def get_data_parallel_rank(self) -> int:
        return self.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.dp

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self.dp_ranks


class Trainer:
    """A DeepSpeed engine and how one micro-step (or, for pipelines, one step) runs on it."""

    def __init__(
        self,
        spec: ModelSpec,
        ds_config: dict[str, Any],
        layout: tuple[int, int, int],
        fsdp: dict[str, Any] | None = None,
    ) -> None:
        tp, pp, seed = layout
        torch.manual_seed(seed)  # the same weights and batch on every rank
        self.pipelined = pp > 1
        mpu = TensorParallelGroups(tp) if tp > 1 else None
        model = _module(spec, tp, pp, mpu)
        self.engine: Any
        if fsdp is not None:  # PyTorch FSDP2 instead of DeepSpeed's engine (`fsdp_engine`)
            from zsim.testbed.fsdp_engine import FsdpEngine

            dtype = torch.bfloat16 if ds_config.get("bf16", {}).get("enabled") else torch.float32
            accum = int(ds_config["gradient_accumulation_steps"])
            self.engine = FsdpEngine(model, fsdp, accum, dtype)
        else:
            self.engine, *_ = deepspeed.initialize(
                model=model, model_parameters=model.parameters(), config=ds_config, mpu=mpu
            )
            dtype = next(self.engine.module.parameters()).dtype
        micro = int(ds_config["train_micro_batch_size_per_gpu"])
        self.batch = torchmodels.batch(spec, micro, dtype=dtype, device=self.engine.device)
        self.dtype = dtype

    def data(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield self.batch


def _module(spec: ModelSpec, tp: int, pp: int, mpu: TensorParallelGroups | None) -> nn.Module:
    if mpu is not None:
        return tp_layers.TpDecoder(spec, tp, mpu.tp_rank, mpu.tp_group)
    if pp > 1:
        layers = [nn.Linear(spec.hidden, spec.hidden, bias=spec.bias) for _ in range(spec.layers)]
        return PipelineModule(
            layers=layers, num_stages=pp, loss_fn=F.mse_loss, partition_method="uniform"
        )
    return torchmodels.build(spec)
