"""A plan's winner as files to run: its ds_config.json (PyTorch FSDP2's arguments as
fsdp.json when FSDP won) and the launcher lines.

The ds_config holds DeepSpeed's keys (`workload.ds_config.to_ds_config`: the batch rule
satisfied, the ZeRO stage, buckets, offload, precision); tensor and pipeline parallelism are
the training script's: pretrain_gpt.py's flags when Megatron's layers or pipeline won
(Megatron-Core's with its own DDP and no ds_config, Megatron-DeepSpeed's under DeepSpeed: the
model's shape, its parallel sizes, recompute, precision), DeepSpeed's PipelineModule
(`num_stages`, `partition_method`) otherwise.
"""

from __future__ import annotations

from typing import Any

from zsim.workload.cross_entropy import megatron_model
from zsim.workload.ds_config import to_ds_config
from zsim.workload.layout import LAYER_AC_EVERY
from zsim.workload.model import ModelKind, ModelSpec
from zsim.workload.parallel import (
    DpEngine,
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
    if megatron_model(cfg):
        return [*head, f"torchrun {rendezvous} pretrain_gpt.py \\", *_megatron(model, cfg)]
    # PipelineModule's own default is "parameters": say the split zsim simulated
    split = f" --num-stages {cfg.pp} --partition-method '{cfg.pp_partition}'"
    stages = split if cfg.pp > 1 else ""
    return [
        *head,
        f"torchrun {rendezvous} train.py --deepspeed --deepspeed_config ds_config.json{stages}",
    ]


def _megatron(model: ModelSpec, cfg: Any) -> list[str]:
    """pretrain_gpt.py's flags: Megatron-Core's (NVIDIA Megatron-LM) when its DDP won,
    Megatron-DeepSpeed's (deepspeedai) under DeepSpeed; the two name some flags apart."""
    core = cfg.dp_engine is DpEngine.MEGATRON
    flags = [
        f"--tensor-model-parallel-size {cfg.tp}",
        f"--pipeline-model-parallel-size {cfg.pp}",
        f"--micro-batch-size {cfg.micro_batch}",
        f"--global-batch-size {cfg.global_batch}",
    ]
    if model.kind is ModelKind.TRANSFORMER:
        flags += _model_flags(model, core)
    if cfg.pp_schedule is PipelineSchedule.INTERLEAVED:
        layers = model.layers // (cfg.pp * cfg.virtual_stages)
        flags.append(f"--num-layers-per-virtual-pipeline-stage {layers}")
    if cfg.pp > 1 and cfg.pp_partition != "uniform":  # Megatron-DeepSpeed's flag
        flags.append(f"--pp-partition-method '{cfg.pp_partition}'")
    if cfg.sequence_parallel:
        flags.append("--sequence-parallel")
    if cfg.flash_attention:  # Megatron-DeepSpeed's --use-flash-attn is version 1
        flags.append("--use-flash-attn" if core else "--use-flash-attn-v2")
    if cfg.recompute is Recompute.FULL:  # Megatron-Core refuses full without a layer count
        flags.append("--recompute-granularity full --recompute-method uniform")
        flags.append("--recompute-num-layers 1")
    elif cfg.recompute is Recompute.SELECTIVE:
        flags.append("--recompute-granularity selective")
    if cfg.precision.mixed:
        flags.append(f"--{cfg.precision.compute}")
    flags += _megatron_core(cfg) if core else ["--deepspeed --deepspeed_config ds_config.json"]
    return [f"    {flag} \\" for flag in flags[:-1]] + [f"    {flags[-1]}"]


def _model_flags(model: ModelSpec, core: bool) -> list[str]:
    """The model's shape as the script builds it; every choice that differs from the
    scripts' defaults (GeLU, LayerNorm, biases, learned positions, tied head, dropout 0.1)."""
    flags = [
        f"--num-layers {model.layers}",
        f"--hidden-size {model.hidden}",
        f"--ffn-hidden-size {model.ffn_hidden}",
        f"--num-attention-heads {model.heads}",
        f"--seq-length {model.seq_len}",
        f"--max-position-embeddings {model.seq_len}",
    ]
    if model.n_kv_heads != model.heads:
        gqa = f"--group-query-attention --num-query-groups {model.n_kv_heads}"
        flags.append(gqa if core else f"--num-key-value-heads {model.n_kv_heads}")
    if model.gated_mlp:
        flags.append("--swiglu")
    if model.rmsnorm:
        flags.append(f"--normalization {'RMSNorm' if core else 'rmsnorm'}")
    if not model.bias:
        flags.append("--disable-bias-linear")
    if model.rotary:
        rope = "--position-embedding-type rope"
        flags.append(rope if core else "--use-rotary-position-embeddings")
    elif not model.learned_positions:  # ALiBi: neither script has it (BigScience's fork did)
        flags.append("--position-embedding-type none" if core else "--no-position-embedding")
    if not model.tied_embeddings:
        flags.append("--untie-embeddings-and-output-weights")
    if not model.dropout:
        flags.append("--attention-dropout 0 --hidden-dropout 0")
    return flags


def _megatron_core(cfg: Any) -> list[str]:
    """Megatron-Core's own flags for what zsim simulated of its DDP, CP and FP8."""
    flags = [f"--context-parallel-size {cfg.cp}"] if cfg.cp > 1 else []
    if cfg.zero_stage:
        flags.append("--use-distributed-optimizer")
    if cfg.overlap_comm:
        flags.append("--overlap-grad-reduce")
    if cfg.overlap_param_gather:
        flags.append("--overlap-param-gather")
    if cfg.tp_comm_overlap:
        flags.append("--tp-comm-overlap")
    if cfg.precision is Precision.FP8:
        flags.append("--fp8-format hybrid")
    return flags
