"""Megatron's vocab-parallel cross-entropy pass by pass (`zsim.workload.cross_entropy`),
each byte counted by hand from megatron/core/tensor_parallel/cross_entropy.py (NVIDIA/
Megatron-LM d98e8a6): not from zsim's outputs."""

import pytest

from zsim.workload.cross_entropy import megatron_loss_bytes, megatron_model
from zsim.workload.layout import layer_passes
from zsim.workload.model import LayerKind
from zsim.workload.model_presets import preset
from zsim.workload.parallel import ParallelConfig


def test_bf16_logits_cost_38_bytes_forward_and_14_backward():
    # forward: .float() 2 + 4, max 4, sub_ 4 + 4, exp 4 + 4, sum 4, div_ 4 + 4 = 38 bytes,
    # 6 kernels; backward: mul_ 4 + 4, the cast back 4 + 2 = 14 bytes, 2 kernels
    assert megatron_loss_bytes(2) == ((38, 6), (14, 2))
    # fp32 logits: .float() and the cast back are no-ops
    assert megatron_loss_bytes(4) == ((32, 5), (8, 1))


@pytest.mark.parametrize(
    ("layout", "megatron"),
    [
        ({"dp": 8}, False),  # DeepSpeed's engine on the user's own model
        ({"dp": 4, "tp": 2}, True),  # Megatron-DeepSpeed's layers
        ({"dp": 8, "dp_engine": "megatron", "zero_stage": 1}, True),
        ({"dp": 8, "dp_engine": "fsdp", "zero_stage": 3}, False),  # PyTorch's cross_entropy
    ],
)
def test_the_head_charges_megatrons_passes_where_its_model_code_runs(layout, megatron):
    model = preset("gpt-125m")
    cfg = ParallelConfig(precision="bf16", **layout)
    assert megatron_model(cfg) is megatron
    head = next(x for x in model.layer_list() if x.kind is LayerKind.HEAD)
    passes = layer_passes(model, cfg, head)
    forward = next(op for op in passes.forward if op.name == "cross_entropy")
    backward = next(op for op in passes.backward if op.name.startswith("cross_entropy"))
    logits = 2048 * -(-model.vocab // cfg.tp)  # one sequence of 2,048 tokens
    expected = (38, 14) if megatron else (12, 18)  # else one softmax pass, 1.5x backward
    assert forward.bytes_moved == pytest.approx(expected[0] * logits)
    assert backward.bytes_moved == pytest.approx(expected[1] * logits)
