"""How a job is run: the parallel layout, ZeRO stage, batch, precision and DeepSpeed's knobs.

Defaults follow DeepSpeed 0.19 (`deepspeed/runtime/zero/config.py`); a `ParallelConfig` is
read from and written to a real `ds_config.json` in `zsim.workload.ds_config`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import IntEnum, StrEnum
from typing import Any

from zsim.errors import InputError, positive_int, require
from zsim.workload import zero_plus_plus as zpp
from zsim.workload.eager import Elementwise
from zsim.workload.knobs import ZeroKnobs as ZeroKnobs  # its home before it had its own
from zsim.workload.mechanisms import Mechanism, modelled, parse_mechanisms
from zsim.workload.model import AttentionKernel
from zsim.workload.pipe_partition import Balancer, PartitionMethod
from zsim.workload.sharding import FsdpSharding, check_fsdp, shard_ranks
from zsim.workload.te_overlap import TE_DEFAULT_SMS, SmMargins, parse_sms

STAGE0_ALLREDUCE_BUCKET_NUMEL = 500_000_000
"""Elements per all-reduce bucket of DeepSpeed's stage 0 (`MEMORY_OPT_ALLREDUCE_SIZE`,
deepspeed/runtime/engine.py:151, the default of `DeepSpeedEngine.allreduce_gradients` ->
`buffered_allreduce_fallback`): the schedule's buckets and the ledger's flattened copy."""


class ZeroStage(IntEnum):
    """What ZeRO partitions across data-parallel ranks; each stage includes the ones below."""

    NONE = 0
    """Plain data parallelism: every rank holds all model states."""
    OPTIMIZER = 1
    """Optimizer states (fp32 master, Adam m and v) are partitioned."""
    GRADIENTS = 2
    """Gradients are partitioned too (reduced to their owner during backward)."""
    PARAMETERS = 3
    """Parameters are partitioned too, gathered per module when needed."""


class Precision(StrEnum):
    FP16 = "fp16"
    BF16 = "bf16"
    FP32 = "fp32"
    # TransformerEngine's FP8 (Megatron-Core --fp8-format): the blocks' linears in FP8, the
    # rest, the parameters and the activations in bf16 (zsim.workload.fp8)
    FP8 = "fp8"

    @property
    def bytes(self) -> int:
        return 4 if self is Precision.FP32 else 2

    @property
    def mixed(self) -> bool:
        return self is not Precision.FP32

    @property
    def compute(self) -> Precision:
        """The dtype of every kernel but FP8's GEMMs (and of the peak MFU is counted against)."""
        return Precision.BF16 if self is Precision.FP8 else self


class Recompute(StrEnum):
    NONE = "none"
    SELECTIVE = "selective"  # recompute attention's softmax/dropout only (Korthikanti et al.)
    # torchtitan's op-level selective AC: keep matmul (except every second one of a block)
    # and attention outputs, replay the rest (zsim.workload.shapes.sac_replay)
    SELECTIVE_OP = "selective-op"
    # torchtitan's layer-level selective AC: every second block full (its option's default "2")
    SELECTIVE_LAYER = "selective-layer"
    FULL = "full"  # keep each layer's input, replay the forward in backward


class Offload(StrEnum):
    NONE = "none"
    OPTIMIZER = "optimizer"  # ZeRO-Offload: optimizer states and step on the host
    OPTIMIZER_PARAMS = "optimizer+params"  # ZeRO-Infinity (CPU): parameters too (stage 3 only)


class PipelineSchedule(StrEnum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"


class PipelineEngine(StrEnum):
    """Whose pipeline runs the stages: DeepSpeed's PipelineEngine (its TrainSchedule, blocking
    p2p) or Megatron's schedules (GPipe, 1F1B, interleaved; asynchronous p2p)."""

    DEEPSPEED = "deepspeed"
    MEGATRON = "megatron"


class DpEngine(StrEnum):
    """Whose data parallelism reduces the gradients and, with ZeRO-1, shards the optimizer:
    DeepSpeed's engine and ZeroOptimizer (`zsim.step.zero_reduce`), Megatron-Core's DDP and
    distributed optimizer (`zsim.step.megatron_dp`) or PyTorch's FSDP (`zsim.step.fsdp`)."""

    DEEPSPEED = "deepspeed"
    MEGATRON = "megatron"
    FSDP = "fsdp"  # PyTorch FSDP2's fully_shard (`zsim.step.fsdp`), with zero_stage 3


@dataclass(frozen=True)
class ParallelConfig:
    """The layout and batch of one job. World size = dp * tp * pp * cp."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1  # context-parallel ranks splitting each sequence (zsim.workload.context_parallel)
    zero_stage: ZeroStage = ZeroStage.NONE
    micro_batch: int = 1
    grad_accum: int = 1
    precision: Precision = Precision.FP16
    recompute: Recompute = Recompute.NONE
    offload: Offload = Offload.NONE
    sequence_parallel: bool = False
    pp_schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B
    pipeline_engine: PipelineEngine = PipelineEngine.DEEPSPEED
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved 1F1B)
    # how DeepSpeed's PipelineModule splits the layers (zsim.workload.pipe_partition)
    pp_partition: PartitionMethod = PartitionMethod.UNIFORM
    pp_balancer: Balancer = Balancer.DP
    flash_attention: bool = False
    # which fused kernel (with flash attention): its speed by shape is zsim.cluster.flash_rates
    attention_kernel: AttentionKernel = AttentionKernel.FLASH2
    # a block's bandwidth-bound ops: fused kernels, or PyTorch's eager ops (zsim.workload.eager)
    elementwise: Elementwise = Elementwise.FUSED
    knobs: ZeroKnobs = field(default_factory=ZeroKnobs)
    # DeepSpeed was given a model-parallel unit (Megatron-DeepSpeed always passes one; a plain
    # deepspeed.initialize does not); None: one exactly when tp > 1 or pp > 1
    mpu: bool | None = None
    # mechanisms switched off (an ablation: zsim.workload.mechanisms); none in a real job
    without: frozenset[Mechanism] = frozenset()
    dp_engine: DpEngine = DpEngine.DEEPSPEED
    # Megatron-Core's --overlap-param-gather (with dp_engine megatron, ZeRO-1, overlap_comm)
    overlap_param_gather: bool = False
    # Megatron-Core's --tp-comm-overlap (TransformerEngine userbuffers; sequence parallel)
    tp_comm_overlap: bool = False
    # with it, the SMs TE's kernels take from each overlapped GEMM (zsim.workload.te_overlap)
    tp_overlap_sms: SmMargins = TE_DEFAULT_SMS
    # Megatron's --async-tensor-model-parallel-allreduce (since 2021-08; off: the backward's
    # input-gradient all-reduce after the weight-gradient GEMM, on the compute stream)
    async_tp_allreduce: bool = True
    # Megatron's --gradient-accumulation-fusion (since 2022-02, 83b1e42: the wgrad GEMM adds
    # into main_grad; off, and before it: autograd adds each micro-batch's into .grad)
    grad_accumulation_fusion: bool = True
    # with dp_engine fsdp: how FSDP shards, and the hybrid mesh's shard dimension (0: dp)
    fsdp_sharding: FsdpSharding = FsdpSharding.FULL
    fsdp_shard_size: int = 0

    def models(self, mechanism: Mechanism) -> bool:
        """Whether `mechanism` is modelled (not switched off by `without`)."""
        return modelled(mechanism, self.without)

    @property
    def has_mpu(self) -> bool:
        """Whether DeepSpeed is given a model-parallel unit (default: exactly when tp > 1 or
        pp > 1, as Megatron-DeepSpeed and DeepSpeed's pipeline engine give one)."""
        return self.mpu if self.mpu is not None else (self.tp > 1 or self.pp > 1)

    @property
    def one_dp_group(self) -> bool:
        """ZeRO-3 gathers and reduce-scatters on one process group, so one NCCL stream. With
        an mpu both use its data-parallel group; without one, parameters are gathered on
        WORLD and gradients reduced on the engine's clone of it, two communicators
        (deepspeed 0.19: partition_parameters.Init, utils/groups._clone_world_group)."""
        return self.models(Mechanism.ONE_PROCESS_GROUP) and self.has_mpu

    def __post_init__(self) -> None:
        for name, kind in ENUM_FIELDS.items():  # accept "full", 3, ... from Python callers
            object.__setattr__(self, name, _as_enum(name, getattr(self, name), kind))
        object.__setattr__(self, "without", parse_mechanisms(self.without))
        object.__setattr__(self, "tp_overlap_sms", parse_sms(self.tp_overlap_sms))
        for name in ("dp", "tp", "pp", "cp", "micro_batch", "grad_accum", "virtual_stages"):
            positive_int(name, getattr(self, name))
        require(
            self.offload is not Offload.OPTIMIZER_PARAMS or self.zero_stage is ZeroStage.PARAMETERS,
            "offload",
            str(self.offload),
            "optimizer+params offload needs ZeRO stage 3",
        )
        require(
            self.offload is Offload.NONE or self.zero_stage >= ZeroStage.OPTIMIZER,
            "offload",
            str(self.offload),
            "offload needs ZeRO stage 1, 2 or 3",
        )
        sp_ok = not self.sequence_parallel or self.tp > 1
        require(sp_ok, "sequence_parallel", True, "sequence parallelism needs tp > 1")
        self._check_pipeline()
        self._check_attention()
        zpp.check(self)
        self._check_context()
        self._check_megatron()
        check_fsdp(self)
        require(  # Megatron: "number of microbatches is not divisible by pipeline-parallel size"
            self.pp_schedule is not PipelineSchedule.INTERLEAVED or self.grad_accum % self.pp == 0,
            "grad_accum",
            self.grad_accum,
            f"a multiple of pp={self.pp} (Megatron's interleaved schedule runs micro-batches "
            "in groups of pp)",
        )

    def _check_attention(self) -> None:
        """A fused kernel needs flash attention; torchtitan's op-level selective AC as zsim
        models it: its 1D (FSDP) layout, where no TP reduce-scatter output is kept, with SDPA's
        fused attention, which it saves."""
        fused = self.flash_attention or self.attention_kernel is AttentionKernel.FLASH2
        require(fused, "attention_kernel", str(self.attention_kernel), "flash2 without flash")
        if self.recompute is Recompute.SELECTIVE_OP:
            why = "with recompute selective-op (torchtitan's op-level AC, modelled without TP)"
            require(self.tp == 1, "tp", self.tp, f"1 {why}")
            require(self.flash_attention, "flash_attention", False, f"true {why}")
        if self.recompute is Recompute.SELECTIVE_LAYER:
            why = "with recompute selective-layer (torchtitan's layer AC: FSDP2, no pipeline)"
            require(self.pp == 1, "pp", self.pp, f"1 {why}")
            fsdp = self.dp_engine is DpEngine.FSDP
            require(fsdp, "dp_engine", str(self.dp_engine), f"fsdp {why}")

    def _check_context(self) -> None:
        """Context parallelism and FP8 as zsim models them: Megatron-Core's on TransformerEngine
        (`zsim.workload.context_parallel`, `zsim.workload.fp8`), CP with its fused attention."""
        cp = self.cp > 1
        why = "cp > 1 (context parallelism)" if cp else "precision fp8 (TransformerEngine's FP8)"
        if cp or self.precision is Precision.FP8:
            megatron = self.dp_engine is DpEngine.MEGATRON
            require(megatron, "dp_engine", str(self.dp_engine), f"megatron with {why}")
        require(not cp or self.flash_attention, "flash_attention", False, f"true with {why}")

    def _check_pipeline(self) -> None:
        """DeepSpeed's and Megatron's pipeline rules."""
        require(
            self.pp == 1 or self.zero_stage < ZeroStage.GRADIENTS,
            "zero_stage",
            int(self.zero_stage),
            "0 or 1 with pp > 1 (DeepSpeed: ZeRO-2 and ZeRO-3 are incompatible with pipeline "
            "parallelism)",
        )
        require(
            self.pp == 1
            or self.pipeline_engine is PipelineEngine.MEGATRON
            or self.pp_schedule is PipelineSchedule.ONE_F_ONE_B,
            "pp_schedule",
            str(self.pp_schedule),
            "1f1b with DeepSpeed's pipeline engine (its TrainSchedule); gpipe and interleaved "
            "need --pipeline-engine megatron",
        )
        require(
            self.pipeline_engine is PipelineEngine.DEEPSPEED
            or self.pp_partition is PartitionMethod.UNIFORM,
            "pp_partition",
            str(self.pp_partition),
            "uniform with Megatron's schedules (the others are DeepSpeed PipelineModule's)",
        )
        require(
            self.virtual_stages == 1 or self.pp_schedule is PipelineSchedule.INTERLEAVED,
            "virtual_stages",
            self.virtual_stages,
            "1 unless --pp-schedule interleaved",
        )
        require(  # Megatron-Core's parallel_state.initialize_model_parallel
            self.virtual_stages == 1 or self.pp > 1,
            "virtual_stages",
            self.virtual_stages,
            "1 with pp 1 (Megatron: 'pipeline-model-parallel size should be greater than 1 "
            "with interleaved schedule')",
        )

    def _check_megatron(self) -> None:
        """Megatron's rules (arguments.py): --tp-comm-overlap needs sequence parallelism; its
        DDP is ZeRO-0 or, with the distributed optimizer, ZeRO-1, without offload;
        --overlap-param-gather needs the distributed optimizer and --overlap-grad-reduce."""
        require(
            not self.tp_comm_overlap or self.sequence_parallel,
            "tp_comm_overlap",
            True,
            "with sequence parallelism (Megatron: 'Tensor parallel communication/GEMM overlap "
            "can happen only when sequence parallelism is enabled')",
        )
        require(
            self.grad_accumulation_fusion or self.dp_engine is not DpEngine.MEGATRON,
            "grad_accumulation_fusion",
            False,
            "with dp_engine deepspeed (Megatron-LM's local DDP before 2022-02): Megatron-Core's "
            "DDP adding each micro-batch into main_grad in a hook is not modelled",
        )
        if self.dp_engine is not DpEngine.MEGATRON:
            require(
                not self.overlap_param_gather,
                "overlap_param_gather",
                True,
                "only with dp_engine megatron (Megatron-Core's --overlap-param-gather)",
            )
            return
        require(
            self.pp == 1 or self.pipeline_engine is PipelineEngine.MEGATRON,
            "pipeline_engine",
            str(self.pipeline_engine),
            "megatron with dp_engine megatron and pp > 1 (Megatron-Core's DDP runs under its "
            "own schedules, not DeepSpeed's PipelineEngine)",
        )
        require(
            self.zero_stage <= ZeroStage.OPTIMIZER and self.offload is Offload.NONE,
            "zero_stage",
            int(self.zero_stage),
            "0 (DDP) or 1 (--use-distributed-optimizer), without offload, with dp_engine megatron",
        )
        require(
            not self.overlap_param_gather
            or (self.zero_stage is ZeroStage.OPTIMIZER and self.overlap_comm),
            "overlap_param_gather",
            True,
            "ZeRO-1 (the distributed optimizer) with --overlap-comm (--overlap-grad-reduce)",
        )

    @property
    def zero_plus_plus(self) -> str:
        """ZeRO++'s parts that act in this layout, in the paper's names ("" for none)."""
        return zpp.parts(self)

    def qgz_nodes(self, node_gpus: int) -> int:
        """The nodes qgZ averages gradients across, on nodes of `node_gpus` GPUs (0: none)."""
        return zpp.qgz_nodes(self, node_gpus)

    @property
    def shard_ranks(self) -> int:
        """The ranks a partition of the model states is spread over (FSDP's hybrid mesh
        shards within fewer than dp)."""
        return shard_ranks(self)

    @property
    def dp_block(self) -> int:
        """Consecutive data-parallel ranks that form a group of their own: ZeRO++'s hpZ
        secondary partition, or FSDP's hybrid shard group (1: none)."""
        fsdp = self.dp_engine is DpEngine.FSDP
        return self.shard_ranks if fsdp else self.knobs.hpz_partition_size

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def sizes(self, sep: str = ", ") -> tuple[str, str]:
        """The layout's factors as messages name them, cp where there is one."""
        names = ("dp", "tp", "pp", *(("cp",) if self.cp > 1 else ()))
        return " x ".join(names), sep.join(f"{n}={getattr(self, n)}" for n in names)

    @property
    def dp_cp(self) -> int:
        """The ranks that hold the same parameters: gradients are reduced, and ZeRO's states
        sharded, over data x context parallel ranks (Megatron's `with_context_parallel`)."""
        return self.dp * self.cp

    @property
    def global_batch(self) -> int:
        """DeepSpeed's train_batch_size: micro_batch x grad_accum x dp."""
        return self.micro_batch * self.grad_accum * self.dp

    @property
    def overlap_comm(self) -> bool:
        if self.knobs.overlap_comm is None:
            return self.zero_stage is ZeroStage.PARAMETERS
        return self.knobs.overlap_comm


ENUM_FIELDS: dict[str, type[Any]] = {  # the fields given by name (a flag, a YAML key)
    "zero_stage": ZeroStage,
    "precision": Precision,
    "recompute": Recompute,
    "offload": Offload,
    "pp_schedule": PipelineSchedule,
    "pipeline_engine": PipelineEngine,
    "attention_kernel": AttentionKernel,
    "elementwise": Elementwise,
    "pp_partition": PartitionMethod,
    "pp_balancer": Balancer,
    "dp_engine": DpEngine,
    "fsdp_sharding": FsdpSharding,
}


def _as_enum(name: str, value: Any, kind: type[Any]) -> Any:
    try:
        return kind(value)
    except ValueError:
        allowed = ", ".join(str(e.value) for e in kind)
        raise InputError(name, value, f"one of {allowed}") from None


def with_stage(cfg: ParallelConfig, stage: ZeroStage) -> ParallelConfig:
    """The same job at another ZeRO stage (offload kept only where that stage allows it)."""
    offload = cfg.offload
    if stage is ZeroStage.NONE:
        offload = Offload.NONE
    elif stage is not ZeroStage.PARAMETERS and offload is Offload.OPTIMIZER_PARAMS:
        offload = Offload.OPTIMIZER
    return replace(cfg, zero_stage=stage, offload=offload)
