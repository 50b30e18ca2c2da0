"""The flags that describe a model and a layout, shared by `zsim run` and `zsim memory`."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from zsim.workload.model_presets import PRESETS


def add_model_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", help=f"preset: {', '.join(PRESETS)}")
    g.add_argument("--params", help="parameter count only (model-state ledger), e.g. 7.5e9")
    for flag in ("layers", "hidden", "heads", "ffn-hidden", "seq-len", "vocab", "kv-heads"):
        g.add_argument(f"--{flag}", metavar="N", help=f"override the preset's {flag}")


def _add_pipeline_flags(g: Any) -> None:
    g.add_argument("--pp-schedule", help="gpipe, 1f1b or interleaved")
    g.add_argument("--pipeline-engine", help="deepspeed (PipelineEngine, default) or megatron")
    g.add_argument("--virtual-stages", metavar="V", help="model chunks per rank (interleaved)")
    g.add_argument(
        "--pp-partition-method",
        dest="pp_partition",
        metavar="M",
        help="how DeepSpeed's PipelineModule splits the layers: uniform (default), parameters, "
        "type:transformer (Megatron-DeepSpeed's) or type:transformer|embedding",
    )
    g.add_argument(
        "--pp-balancer",
        metavar="B",
        help="DeepSpeed's partition_balanced: dp (since 0.12.5, default) or bisect (before)",
    )


def _add_kernel_flags(g: Any) -> None:
    g.add_argument("--flash-attention", action="store_true", default=None)
    g.add_argument(
        "--attention-kernel",
        metavar="K",
        help="the fused attention kernel: flash2 (default) or triton (flash-attn's Triton "
        "kernel, llm-foundry's attn_impl: triton; A100 only)",
    )
    g.add_argument(
        "--elementwise",
        metavar="E",
        help="a block's norms, RoPE, activation: fused (fused kernels or torch.compile, "
        "default), eager (one kernel per PyTorch op, torchtitan without compile) or "
        "eager-fused-norm (eager with a fused RMSNorm)",
    )


def add_parallel_flags(p: argparse.ArgumentParser, stage: bool = True) -> None:
    g = p.add_argument_group("layout and batch")
    g.add_argument("--ds-config", type=Path, help="a DeepSpeed ds_config.json to read")
    for flag, text in (
        ("dp", "data-parallel size"),
        ("tp", "tensor-parallel size"),
        ("pp", "pipeline-parallel size"),
        ("cp", "context-parallel size (Megatron-Core's, splitting each sequence)"),
        ("micro-batch", "per-GPU micro-batch"),
        ("grad-accum", "gradient accumulation steps"),
        ("global-batch", "train_batch_size = micro x accum x dp"),
    ):
        g.add_argument(f"--{flag}", metavar="N", help=text)
    if stage:
        g.add_argument("--stage", help="ZeRO stage 0-3")
    g.add_argument(
        "--precision", help="fp16, bf16, fp32 (default fp16) or fp8 (TE: --dp-engine megatron)"
    )
    g.add_argument(
        "--recompute",
        help="none, selective, selective-op (torchtitan's op-level AC), selective-layer "
        "(its layer AC: every 2nd block full) or full",
    )
    g.add_argument("--offload", help="none, optimizer or optimizer+params")
    g.add_argument("--sequence-parallel", action="store_true", default=None)
    _add_kernel_flags(g)
    _add_pipeline_flags(g)
    _add_megatron_flags(g)
    k = p.add_argument_group("DeepSpeed knobs (elements, as in ds_config)")
    for knob in (
        "reduce-bucket-size",
        "allgather-bucket-size",
        "prefetch-bucket-size",
        "param-persistence-threshold",
        "max-live-parameters",
        "max-reuse-distance",
    ):
        k.add_argument(f"--{knob}", metavar="N")
    k.add_argument("--overlap-comm", action=argparse.BooleanOptionalAction, default=None)
    z = p.add_argument_group("ZeRO++ (ZeRO-3; DeepSpeed's zero_hpz_partition_size, ...)")
    z.add_argument(
        "--hpz",
        "--hpz-partition-size",
        dest="hpz_partition_size",
        metavar="H",
        help="hpZ: a secondary parameter partition over H consecutive ranks (e.g. a node)",
    )
    z.add_argument(
        "--quantized-weights",
        action="store_true",
        default=None,
        help="qwZ: parameter all-gathers in int8 with fp32 scales",
    )
    z.add_argument(
        "--quantized-gradients",
        action="store_true",
        default=None,
        help="qgZ: gradients averaged in int4 by all-to-alls within, then across the nodes",
    )


def _add_megatron_flags(g: Any) -> None:
    """Megatron-Core's switches zsim models (its DDP and overlaps)."""
    g.add_argument(
        "--dp-engine",
        "--engine",
        dest="dp_engine",
        help="deepspeed (its engine and ZeRO, default), megatron (Megatron-Core's DDP; with "
        "--stage 1 its distributed optimizer; --overlap-comm is --overlap-grad-reduce) or "
        "fsdp (PyTorch FSDP2's fully_shard, ZeRO-3's partition: --sharding)",
    )
    g.add_argument(
        "--sharding",
        dest="fsdp_sharding",
        metavar="S",
        help="with --engine fsdp: full (FULL_SHARD, default), grad-op (SHARD_GRAD_OP) or "
        "hybrid (HYBRID_SHARD: full within --shard-size ranks, replicated across)",
    )
    g.add_argument(
        "--shard-size",
        dest="fsdp_shard_size",
        metavar="N",
        help="with --sharding hybrid: the ranks of one shard group (default: a node's "
        "data-parallel ranks, as torch's HYBRID_SHARD)",
    )
    g.add_argument(
        "--tp-comm-overlap",
        action="store_true",
        default=None,
        help="Megatron-Core's TP collectives beside the GEMMs (TransformerEngine userbuffers; "
        "needs --sequence-parallel)",
    )
    g.add_argument(
        "--tp-comm-overlap-cfg",
        metavar="YAML",
        help="with --tp-comm-overlap: TransformerEngine's userbuffers settings by layer "
        "(Megatron's flag; each layer's num_sm taken from its GEMM where set_sm_margin is on). "
        "Default: TE's own (16 SMs from its pipeline and bulk GEMMs)",
    )
    g.add_argument(
        "--no-async-tensor-model-parallel-allreduce",
        dest="async_tp_allreduce",
        action="store_false",
        default=None,
        help="Megatron before 2021-08 (and BigScience's Megatron-DeepSpeed): the backward's "
        "TP all-reduce of an input gradient after its weight-gradient GEMM, not beside it",
    )
    g.add_argument(
        "--no-gradient-accumulation-fusion",
        dest="grad_accumulation_fusion",
        action="store_false",
        default=None,
        help="Megatron before 2022-02 (its local DDP): each micro-batch's gradients added into "
        ".grad by autograd, not by the weight-gradient GEMM into main_grad",
    )
    g.add_argument(
        "--overlap-param-gather",
        action="store_true",
        default=None,
        help="Megatron-Core's: the distributed optimizer's gathers in the next forward",
    )
