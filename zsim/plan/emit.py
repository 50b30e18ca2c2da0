"""A plan's winner as files to run: its ds_config.json (PyTorch FSDP2's arguments as
fsdp.json when FSDP won) and the launcher lines.

The ds_config holds DeepSpeed's keys (`workload.ds_config.to_ds_config`: the batch rule
satisfied, the ZeRO stage, buckets, offload, precision); tensor and pipeline parallelism are
the training script's: Megatron-DeepSpeed's flags when the Megatron engine won, DeepSpeed's
PipelineModule (`num_stages`, `partition_method`) otherwise.
"""

from __future__ import annotations

from typing import Any

from zsim.workload.ds_config import to_ds_config
from zsim.workload.layout import LAYER_AC_EVERY
from zsim.workload.model import ModelKind, ModelSpec
from zsim.workload.parallel import (
    DpEngine,
    PipelineEngine,
    PipelineSchedule,
    Precision,
    Recompute,
)
from zsim.workload.sharding import FsdpSharding


def ds_config(cfg: Any) -> dict[str, Any]:
    ds = to_ds_config(cfg)
    if cfg.recompute is not Recompute.NONE:
        ds["activation_checkpointing"] = {"partition_activations": False}
    return ds


def config_files(cfg: Any) -> dict[str, dict[str, Any]]:
    """The winner's configuration file: DeepSpeed's ds_config, or FSDP2's arguments."""
    if cfg.dp_engine is DpEngine.FSDP:
        return {"fsdp.json": fsdp_config(cfg)}
    if cfg.dp_engine is DpEngine.MEGATRON:
        return {}  # Megatron-Core takes it all as flags (launch.sh)
    return {"ds_config.json": ds_config(cfg)}


def fsdp_config(cfg: Any) -> dict[str, Any]:
    """`fully_shard`'s arguments as zsim simulated them (`zsim.step.fsdp`): each block wrapped,
    then the model; the mesh (replicate, shard) of a hybrid layout; torchtitan's mixed
    precision."""
    shard = cfg.shard_ranks
    hybrid = cfg.fsdp_sharding is FsdpSharding.HYBRID
    return {
        "api": "torch.distributed.fsdp.fully_shard",
        "wrap": "fully_shard(block) for each transformer block, then fully_shard(model)",
        "reshard_after_forward": cfg.fsdp_sharding is not FsdpSharding.GRAD_OP,
        "mesh": {
            "shape": [cfg.dp // shard, shard] if hybrid else [cfg.dp],
            "mesh_dim_names": ["replicate", "shard"] if hybrid else ["shard"],
        },
        "tensor_parallel_size": cfg.tp,
        "mp_policy": {"param_dtype": str(cfg.precision), "reduce_dtype": "fp32"},
        "micro_batch": cfg.micro_batch,
        "gradient_accumulation_steps": cfg.grad_accum,
        "global_batch": cfg.global_batch,
        "activation_checkpointing": _torchtitan_ac(cfg.recompute),
        # torchtitan's [training] compile and [model] norm_type (zsim.workload.eager)
        "compile": not cfg.elementwise.eager,
        "norm_type": "rmsnorm" if cfg.elementwise.eager_norm else "fused_rmsnorm",
    }


def _torchtitan_ac(recompute: Recompute) -> Any:
    """torchtitan's [activation_checkpoint] section for its op- and layer-level AC; the
    mode's name else."""
    if recompute is Recompute.SELECTIVE_OP:
        return {"mode": "selective", "selective_ac_option": "op"}
    if recompute is Recompute.SELECTIVE_LAYER:
        return {"mode": "selective", "selective_ac_option": str(LAYER_AC_EVERY)}
    return str(recompute)


def launch_lines(model: ModelSpec, cfg: Any, nodes: int, gpus_per_node: int) -> list[str]:
    """Shell lines that start the planned job (the training script is the user's)."""
    head = [
        "#!/usr/bin/env bash",
        f"# {model.name} on {nodes} node(s) x {gpus_per_node} GPUs, planned by zsim.",
        "# Run on every node; set MASTER_ADDR (node 0) and NODE_RANK per node.",
        "set -euo pipefail",
    ]
    rendezvous = (
        f"--nnodes {nodes} --nproc_per_node {gpus_per_node} "
        '--node_rank "${NODE_RANK:-0}" --master_addr "${MASTER_ADDR:-127.0.0.1}" '
        "--master_port 29500"
    )
    if cfg.dp_engine is DpEngine.FSDP:
        return [*head, f"torchrun {rendezvous} train.py --fsdp-config fsdp.json"]
    megatron = cfg.dp_engine is DpEngine.MEGATRON
    if (cfg.pp > 1 and cfg.pipeline_engine is PipelineEngine.MEGATRON) or cfg.tp > 1 or megatron:
        return [*head, f"torchrun {rendezvous} pretrain_gpt.py \\", *_megatron(model, cfg)]
    # PipelineModule's own default is "parameters": say the split zsim simulated
    split = f" --num-stages {cfg.pp} --partition-method '{cfg.pp_partition}'"
    stages = split if cfg.pp > 1 else ""
    return [
        *head,
        f"torchrun {rendezvous} train.py --deepspeed --deepspeed_config ds_config.json{stages}",
    ]


def _megatron(model: ModelSpec, cfg: Any) -> list[str]:
    flags = [
        f"--tensor-model-parallel-size {cfg.tp}",
        f"--pipeline-model-parallel-size {cfg.pp}",
        f"--micro-batch-size {cfg.micro_batch}",
        f"--global-batch-size {cfg.global_batch}",
    ]
    if model.kind is ModelKind.TRANSFORMER:
        flags += [
            f"--num-layers {model.layers}",
            f"--hidden-size {model.hidden}",
            f"--num-attention-heads {model.heads}",
            f"--seq-length {model.seq_len}",
            f"--max-position-embeddings {model.seq_len}",
        ]
    if cfg.pp_schedule is PipelineSchedule.INTERLEAVED:
        layers = model.layers // (cfg.pp * cfg.virtual_stages)
        flags.append(f"--num-layers-per-virtual-pipeline-stage {layers}")
    if cfg.pp > 1 and cfg.pp_partition != "uniform":  # Megatron-DeepSpeed's flag
        flags.append(f"--pp-partition-method '{cfg.pp_partition}'")
    if cfg.sequence_parallel:
        flags.append("--sequence-parallel")
    if cfg.flash_attention:
        flags.append("--use-flash-attn")
    if cfg.recompute is Recompute.FULL:
        flags.append("--recompute-granularity full --recompute-method uniform")
    elif cfg.recompute is Recompute.SELECTIVE:
        flags.append("--recompute-granularity selective")
    if cfg.precision.mixed:
        flags.append(f"--{cfg.precision.compute}")
    if cfg.dp_engine is not DpEngine.MEGATRON:
        flags.append("--deepspeed --deepspeed_config ds_config.json")
    else:
        flags += _megatron_core(cfg)
    return [f"    {flag} \\" for flag in flags[:-1]] + [f"    {flags[-1]}"]


def _megatron_core(cfg: Any) -> list[str]:
    """Megatron-Core's own flags for what zsim simulated of its DDP, CP and FP8."""
    flags = [f"--context-parallel-size {cfg.cp}"] if cfg.cp > 1 else []
    if cfg.zero_stage:
        flags.append("--use-distributed-optimizer")
    if cfg.overlap_comm:
        flags.append("--overlap-grad-reduce")
    if cfg.overlap_param_gather:
        flags.append("--overlap-param-gather")
    if cfg.precision is Precision.FP8:
        flags.append("--fp8-format hybrid")
    return flags
