"""The loss over the vocabulary as Megatron's model code computes it, pass by pass.

Megatron-LM, Megatron-DeepSpeed and Megatron-Core (its default, unfused
`tensor_parallel.vocab_parallel_cross_entropy`; megatron/core/tensor_parallel/
cross_entropy.py) compute the loss on the rank's [tokens, vocab / tp] logits in separate
PyTorch ops. Forward: `.float()` (read the logits' dtype, write fp32; nothing when they are
fp32), the max (read), the max subtracted in place (read, write), `exp` in place (read,
write), the sum (read), the division to the softmax it keeps (read, write). Backward: the
softmax times the loss's gradient in place (read, write), then autograd's cast back to the
logits' dtype (read fp32, write). The target's gather and masking touch one value per token.

zsim takes a layout to run Megatron's model code where it launches one with Megatron's
`pretrain_gpt.py` (`megatron_model`: Megatron-Core's DDP, tensor parallelism, or Megatron's
pipeline schedules); elsewhere (PyTorch's `cross_entropy`, FSDP's and DeepSpeed's own
models) one softmax pass over fp32 logits is charged, as before.
"""

from __future__ import annotations

from zsim.workload.parallel import DpEngine, ParallelConfig, PipelineEngine

FP32 = 4


def megatron_model(cfg: ParallelConfig) -> bool:
    """Whether the layout runs Megatron's model code (`plan.emit` launches pretrain_gpt.py)."""
    megatron_pipeline = cfg.pp > 1 and cfg.pipeline_engine is PipelineEngine.MEGATRON
    return cfg.dp_engine is DpEngine.MEGATRON or cfg.tp > 1 or megatron_pipeline


def megatron_loss_bytes(dtype_bytes: int) -> tuple[tuple[float, int], tuple[float, int]]:
    """(bytes read and written per logit, kernels) of the forward and of the backward."""
    cast = dtype_bytes + FP32 if dtype_bytes < FP32 else 0
    reductions = 2 * FP32  # the max and the sum: a read each
    in_place = 3 * 2 * FP32  # subtract, exp, divide: a read and a write each
    forward = (cast + reductions + in_place, 5 + (1 if cast else 0))
    backward = (2 * FP32 + cast, 1 + (1 if cast else 0))
    return forward, backward
