"""What every part of one rank's step reads: the job as one rank of a pipeline stage sees it.

Immutable; the parts that keep state while the program is written (the gradient buckets, the
ZeRO-3 gathers in flight, the kernel timings) hold it themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from zsim.cluster.device import DeviceProfile, unit_size_extra_s
from zsim.workload.layout import rank_chunks
from zsim.workload.mechanisms import Mechanism
from zsim.workload.model import Layer, ModelSpec, ParamTensor
from zsim.workload.parallel import DpEngine, ParallelConfig, PipelineEngine, ZeroStage
from zsim.workload.shapes import Shard, layer_input_bytes
from zsim.workload.sharding import FsdpSharding, is_unit


@dataclass(frozen=True)
class StageJob:
    """One rank of pipeline stage `stage`: its model chunks (virtual stages c * pp + stage).

    `gloo`: the CPU backend, where DeepSpeed's streams are no-ops and its calls block.
    `node_gpus`: the GPUs of a node (DeepSpeed's `device_count()`, qgZ's first all-to-all).
    """

    model: ModelSpec
    cfg: ParallelConfig
    device: DeviceProfile
    stage: int
    gloo: bool
    chunks: tuple[tuple[Layer, ...], ...]
    node_gpus: int = 1

    @classmethod
    def of(
        cls,
        model: ModelSpec,
        cfg: ParallelConfig,
        device: DeviceProfile,
        stage: int,
        gloo: bool,
        node_gpus: int = 1,
    ) -> StageJob:
        chunks = tuple(rank_chunks(model, cfg, stage))
        return cls(model, cfg, device, stage, gloo, chunks, node_gpus)

    @property
    def qgz_nodes(self) -> int:
        """The nodes qgZ averages gradients across (0: it does not act)."""
        return self.cfg.qgz_nodes(self.node_gpus)

    @property
    def dtype(self) -> str:
        return str(self.cfg.precision.compute)

    @property
    def element_bytes(self) -> int:
        return self.cfg.precision.bytes

    def tensors(self) -> list[ParamTensor]:
        """The rank's parameter tensors in forward order."""
        return [t for chunk in self.chunks for x in chunk for t in x.tensors]

    def params(self) -> int:
        """Parameters this rank holds (its TP slice of its stage's layers)."""
        return self._params

    @cached_property
    def _params(self) -> int:  # asked once per micro-batch by the builder: summed once
        return sum(x.params(self.cfg.tp) for chunk in self.chunks for x in chunk)

    def padded(self, numel: float) -> float:
        """A gather's output: each rank's shard is ceil(n / dp) elements."""
        return -(-numel // self.cfg.dp_cp) * self.cfg.dp_cp

    def persistent_tensors(self) -> list[ParamTensor]:
        """ZeRO-3's persistent tensors: never partitioned, gathered after every step
        (`stage3_param_persistence_threshold`, elements per TP rank)."""
        limit = self.cfg.knobs.param_persistence_threshold
        return [t for t in self.tensors() if t.per_rank(self.cfg.tp) <= limit]

    def engine_host_s(self, phase: str) -> float:
        """DeepSpeed's own host seconds per `engine(x)`, `engine.backward` or `engine.step`
        call on a CPU rank, or per forward, backward, send or step of its PipelineEngine: the
        profile's measured cost per call plus its cost per parameter tensor times the rank's
        tensors (`calibrate.engine_fit`; under ZeRO-3 its persistent ones, as every tiny
        layer's is: fetched ones added nothing measurable, 6.4 against 6.5 ms for 8 and 16
        fetched layers); PyTorch FSDP2's per call, per unit and per tensor likewise
        (`fsdp_host`), with what a unit of its size costs beyond the tiny one's (the
        microbenchmark's unit-size sweep); none elsewhere, nor under Megatron's pipeline or DDP,
        whose calls differ."""
        cfg = self.cfg
        pipe = cfg.pp > 1
        applies = self.gloo and cfg.dp_engine is not DpEngine.MEGATRON
        applies &= not pipe or cfg.pipeline_engine is PipelineEngine.DEEPSPEED
        if not applies or not cfg.models(Mechanism.ENGINE_HOST):
            return 0.0
        host = self.device.engine_host_s
        call = f"{'pipe' if pipe else 'z'}{int(cfg.zero_stage)}.{phase}"
        if cfg.dp_engine is DpEngine.FSDP:  # a hybrid mesh's hooks are FULL_SHARD's
            grad_op = cfg.fsdp_sharding is FsdpSharding.GRAD_OP
            call = f"fsdp-{'grad-op' if grad_op else 'full'}.{phase}"
        deepspeed3 = cfg.zero_stage is ZeroStage.PARAMETERS and cfg.dp_engine is DpEngine.DEEPSPEED
        # ZeRO-3's tiny layers' are all persistent; FSDP shards every tensor
        tensors = self.persistent_tensors() if deepspeed3 else self.tensors()
        units = [x for chunk in self.chunks for x in chunk if is_unit(x)]
        return (
            host.get(call, 0.0)
            + host.get(f"{call}_per_tensor", 0.0) * len(tensors)
            + host.get(f"{call}_per_unit", 0.0) * len(units)  # FSDP's hooks run once per unit
            + sum(unit_size_extra_s(host, call, self._unit_bytes(x)) for x in units)
        )

    def _unit_bytes(self, unit: Layer) -> float:
        """An FSDP2 unit's gathered parameters, in the training dtype."""
        return float(unit.params(self.cfg.tp) * self.cfg.precision.bytes)

    def activation_bytes(self) -> float:
        """A pipeline message: one layer's input for one micro-batch."""
        return layer_input_bytes(self.model, Shard.of(self.cfg))
