"""torchtitan's op-level selective activation checkpointing, against its source.

torchtitan `_apply_ac_to_transformer_block` (torchtitan/parallelisms/parallelize_llama.py at
b19456a, 2024-10; the same policy at 395a526, 2024-04): the outputs of `aten.mm`, SDPA's
flash / efficient kernels and `reduce_scatter_tensor` are saved "except every second mm"
(a per-block count from 1, forward and recompute counted apart); everything else is
recomputed. Its Llama block calls wq, wk, wv, (SDPA), wo, then `w2(silu(w1(x)) * w3(x))`:
mm 2, 4 and 6 (wk, wo, w3) are replayed. Expected values below are written from that.
"""

import pytest

from zsim.errors import InputError
from zsim.memory import activation_bytes
from zsim.plan.emit import fsdp_config
from zsim.simulation import step_flops
from zsim.workload.layout import layer_passes
from zsim.workload.model import LayerKind, OpKind
from zsim.workload.model_presets import preset
from zsim.workload.parallel import DpEngine, ParallelConfig, Recompute
from zsim.workload.shapes import Shard, sac_kept_bytes

LLAMA2_13B, LLAMA_70B = preset("llama-13b"), preset("llama-70b")


def _cfg(**kw) -> ParallelConfig:
    base = {"dp": 8, "zero_stage": 3, "dp_engine": DpEngine.FSDP, "flash_attention": True}
    return ParallelConfig(**(base | kw))


def _replay(model, cfg):
    block = next(x for x in model.layer_list() if x.kind is LayerKind.BLOCK)
    return layer_passes(model, cfg, block).replay


def test_the_replayed_matmuls_are_wk_wo_and_w3():
    model, mb = LLAMA2_13B, 2
    tokens, h, f = mb * model.seq_len, 5120, 13824
    gemms = list(_replay(model, _cfg(micro_batch=mb, recompute="selective-op")))
    gemms = [op for op in gemms if op.kind is OpKind.GEMM]
    assert [op.name for op in gemms] == ["wk_replay", "wo_replay", "w3_replay"]
    assert sum(op.flops for op in gemms) == 2 * tokens * (h * h + h * h + h * f)


def test_grouped_query_attention_replays_a_narrow_wk():
    # Llama 2 70B: 8 KV heads of 128 -> wk is h x 1024
    gemms = list(_replay(LLAMA_70B, _cfg(recompute="selective-op")))
    wk = next(op for op in gemms if op.name == "wk_replay")
    assert wk.gemm_shape == (4096, 8 * 128, 8192)


def test_the_attention_kernel_is_saved_and_the_bandwidth_bound_ops_replayed():
    replay = _replay(LLAMA2_13B, _cfg(recompute="selective-op"))
    assert not any(op.kind is OpKind.ATTENTION for op in replay)
    names = {op.name for op in replay if op.kind is OpKind.MEMORY}
    assert {"ln1", "ln2", "activation"} <= names


def test_a_block_keeps_its_input_and_the_saved_outputs():
    """Per block and micro-batch: the input, wq, wv, SDPA's output and logsumexp, w1, w2
    (bf16; fp32 statistics); the rest is freed after the forward."""
    model, mb = LLAMA2_13B, 1
    s, h, f, heads = model.seq_len, 5120, 13824, 40
    kept = 2 * mb * s * (h + h + h + h + f + h) + 4 * mb * heads * s
    assert sac_kept_bytes(model, Shard(mb, dtype_bytes=2)) == kept


def test_its_activations_lie_between_full_recompute_and_none():
    acts = {
        r: activation_bytes(LLAMA2_13B, _cfg(recompute=r)) for r in ("full", "selective-op", "none")
    }
    assert acts["full"] < acts["selective-op"] < acts["none"]


def test_hardware_flops_count_the_replayed_matmuls():
    model, cfg = LLAMA2_13B, _cfg(micro_batch=1, recompute="selective-op")
    tokens, h, f = model.seq_len, 5120, 13824
    model_flops, hardware = step_flops(model, cfg)
    replayed = 2 * tokens * (2 * h * h + h * f) * model.layers * cfg.dp
    assert hardware - model_flops == pytest.approx(replayed)


@pytest.mark.parametrize(("field", "value"), [("tp", 2), ("flash_attention", False)])
def test_op_level_ac_is_modelled_without_tp_and_with_sdpa(field, value):
    with pytest.raises(InputError, match=field):
        _cfg(recompute="selective-op", **{field: value})


def test_a_plan_emits_torchtitans_op_ac_section():
    section = fsdp_config(_cfg(recompute=Recompute.SELECTIVE_OP))["activation_checkpointing"]
    assert section == {"mode": "selective", "selective_ac_option": "op"}
