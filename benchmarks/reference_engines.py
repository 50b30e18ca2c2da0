"""The frameworks' engines and knobs, as the published rows ran them, in ParallelConfig's
fields (`reference_mapping.map_row` reads them)."""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from reference_measured import Skip

from zsim.cluster.flash_rates import family_of
from zsim.workload.eager import Elementwise
from zsim.workload.mechanisms import Mechanism
from zsim.workload.model import AttentionKernel, ModelSpec
from zsim.workload.parallel import DpEngine, PipelineEngine, ZeroKnobs, ZeroStage
from zsim.workload.te_overlap import SmMargins, from_ub_cfgs


def flash(fw: str) -> bool:
    """FlashAttention where the software used it: Megatron-Core/NeMo, MPT (llm-foundry's
    Triton kernel, see triton_kernel), torchtitan (SDPA flash); not in Megatron-LM 2020-21,
    BLOOM's Megatron-DeepSpeed or the DeepSpeed tutorials' Megatron GPT-2."""
    return fw in ("mcore", "mpt", "torchtitan")


# llm-foundry's benchmark tables ran `attn_impl: triton` (scripts/train/benchmarking/
# submit_benchmarks.py's default at a7d6a44 and 5e85bd6, never overridden by sweep.sh; the MPT
# yamls say the same), i.e. its vendored flash_attn_triton.py, not FlashAttention-2's CUDA
# kernels. Its speed by shape and mask is in the flash-attention README's A100 figure
# ("FlashAttention Triton", zsim.cluster.flash_rates); the H100 figure has no Triton kernel.
def triton_kernel(gpu: str) -> AttentionKernel:
    """llm-foundry's Triton kernel, on a GPU the figure has it for (a row on another is
    skipped: costing it as FlashAttention-2, 1.3-2.5x faster (Dao 2023), is a guess)."""
    if family_of(gpu) != "a100":
        raise Skip(f"llm-foundry's Triton attention (attn_impl: triton) has no rate on {gpu}")
    return AttentionKernel.TRITON


def elementwise(row: dict[str, str], fw: str) -> Elementwise:
    """How the run's norms, RoPE and activations ran (zsim.workload.eager). torchtitan runs
    eagerly unless its row names torch.compile (`compile = false` in its train configs): the
    A100 tables' configs (395a526, 2024-04) set `norm_type = "fused_rmsnorm"` (a Triton
    kernel), the H100 tables' (d4c86e3, 2025-01) `norm_type = "rmsnorm"` (eager PyTorch). The
    other sources ran fused kernels (Megatron's, TE's; llm-foundry's MPT has no RoPE or gate)."""
    if fw != "torchtitan" or "torch.compile" in row["system_framework"]:
        return Elementwise.FUSED
    if row["source_id"] == "torchtitan_perf_a100":
        return Elementwise.EAGER_FUSED_NORM
    return Elementwise.EAGER


def kernels(row: dict[str, str], fw: str) -> dict[str, Any]:
    """The attention and elementwise kernels the run's software ran."""
    return {"flash_attention": flash(fw), "elementwise": elementwise(row, fw)}


# The SMs TransformerEngine's comm kernels take under --tp-comm-overlap (zsim.workload.
# te_overlap), as each source ran: TE 1.x's defaults (Megatron-Core's 2024 README runs, NeMo
# 24.05 / 24.09: 16 a pipeline or bulk kernel, the margin off, the same SMs held); NeMo's
# GPT-3 175B recipe in NVIDIA/dgxc-benchmarking (nemo_megatron/gpt3_175b_hydra.yaml at
# 35a9aec, `ub_tp_comm_overlap_cfg`) gives its pipelined proj_fprop 24 SMs and fc2_fprop 20,
# its bulk layers 4, 8, 2 and 4.
DGXC_GPT3_UB_CFGS = {
    "qkv_dgrad": {"method": "bulk", "num_sm": 4, "set_sm_margin": 0},
    "qkv_wgrad": {"method": "bulk", "num_sm": 8, "set_sm_margin": 0},
    "fc1_dgrad": {"method": "bulk", "num_sm": 2, "set_sm_margin": 0},
    "fc1_wgrad": {"method": "bulk", "num_sm": 4, "set_sm_margin": 0},
    "proj_fprop": {"method": "pipeline", "num_sm": 24, "set_sm_margin": 1},
    "fc2_fprop": {"method": "pipeline", "num_sm": 20, "set_sm_margin": 1},
}


def tp_overlap_sms(row: dict[str, str], assumed: list[str]) -> SmMargins:
    """The SMs TE took from each overlapped GEMM in the row's run."""
    if row["source_id"] == "nvidia_dgxc_benchmarking" and "GPT-3" in row["model_name"]:
        return from_ub_cfgs(DGXC_GPT3_UB_CFGS)
    assumed.append("TE 1.x userbuffers' defaults (16 SMs a pipeline or bulk kernel)")
    return from_ub_cfgs({})


def block_params(model: ModelSpec, tp: int) -> int:
    return next(x.params(tp) for x in model.layer_list() if str(x.kind) == "block")


def zero_plus_plus(named: str) -> dict[str, Any]:
    """ZeRO++'s parts as a row names them, lower case ("zero++ (qwz+hpz(16)+qgz)"): DeepSpeed's
    zero_quantized_weights, zero_hpz_partition_size, zero_quantized_gradients."""
    if "zero++" not in named:
        return {}
    hpz = re.search(r"hpz(?: partition)?[ (]*(\d+)", named)
    return {
        "quantized_weights": "qwz" in named,
        "quantized_gradients": "qgz" in named,
        "hpz_partition_size": int(hpz.group(1)) if hpz else 1,
    }


def engine_fields(
    fw: str, stage: ZeroStage, model: ModelSpec, tp: int, assumed: list[str]
) -> dict[str, Any]:
    """The frameworks' engines and knobs as ParallelConfig fields."""
    knobs, mcore = ZeroKnobs(), fw == "mcore" and stage <= ZeroStage.OPTIMIZER
    if mcore:  # Megatron-Core's DDP: --overlap-grad-reduce, with the distributed optimizer
        knobs = ZeroKnobs(overlap_comm=True)  # --overlap-param-gather too (the READMEs' runs)
        assumed.append("--overlap-grad-reduce --overlap-param-gather --tp-comm-overlap")
    if fw == "mpt" and stage >= ZeroStage.GRADIENTS:  # Composer's FSDP1, as DeepSpeed's ZeRO
        unit = block_params(model, tp)  # FSDP wraps each block: gather / reduce per block
        knobs = ZeroKnobs(reduce_bucket_size=unit, prefetch_bucket_size=unit, overlap_comm=True)
        if stage is ZeroStage.PARAMETERS:  # FULL_SHARD reshards after forward: gathered
            knobs = replace(knobs, max_reuse_distance=unit)  # again for (recompute +) backward
    megatron = fw in ("megatron", "mcore")
    # torchtitan's FSDP2 is zsim's FSDP engine (zsim.step.fsdp follows torchtitan's apply_fsdp)
    fsdp = fw == "torchtitan" and stage is ZeroStage.PARAMETERS
    return {
        "knobs": knobs,
        # Megatron's schedules, but BLOOM's Megatron-DeepSpeed ran DeepSpeed's PipelineEngine
        "pipeline_engine": PipelineEngine.MEGATRON if megatron else PipelineEngine.DEEPSPEED,
        "dp_engine": DpEngine.MEGATRON if mcore else DpEngine.FSDP if fsdp else DpEngine.DEEPSPEED,
        "overlap_param_gather": mcore and stage is ZeroStage.OPTIMIZER,
        # --tp-comm-overlap (the Megatron-Core READMEs' and NeMo's recipes), with SP only
        "tp_comm_overlap": mcore and tp > 1,
        # every source's sharded DP gathers and reduces on one process group (mpu, FSDP's)
        "mpu": True,
        # Megatron-LM's async input-gradient all-reduce came in 2021-08 (cf7efd4): after the
        # 2020-21 README runs; BigScience's fork and DeepSpeed's 2020 Megatron never had it
        "async_tp_allreduce": fw not in ("megatron", "bloom", "deepspeed"),
        # gradient accumulation fusion came in 2022-02 (83b1e42): Megatron-LM's 2020-21 runs
        # left each micro-batch's gradients to autograd's add into .grad
        "grad_accumulation_fusion": fw != "megatron",
        # Composer's FSDP1 gathers and reduce-scatters flat parameters whole
        # (all_gather_into_tensor, reduce_scatter_tensor): none of DeepSpeed's per-rank walks
        "without": frozenset({Mechanism.ZERO3_HOST}) if fw == "mpt" else frozenset(),
    }
