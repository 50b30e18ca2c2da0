"""torchtitan's layer-level selective activation checkpointing, against its source.

torchtitan `checkpoint_wrapper` (torchtitan/parallelisms/parallelize_llama.py at 395a526,
2024-04): with `selective_ac_option` a number n (its config_manager default "2", "checkpoint
every other layer") it counts the blocks from 1 as it wraps them, in model order, and wraps a
block in PyTorch's full activation checkpointing when `count % n == 0`; the other blocks
"store activations". Expected values below are written from that.
"""

import pytest

from zsim.errors import InputError
from zsim.memory import activation_bytes
from zsim.plan.emit import fsdp_config
from zsim.simulation import step_flops
from zsim.workload.layout import layer_passes
from zsim.workload.model import LayerKind
from zsim.workload.model_presets import preset, with_overrides
from zsim.workload.parallel import DpEngine, ParallelConfig, Recompute
from zsim.workload.shapes import Shard, forward_flops, layer_input_bytes
from zsim.workload.shapes import activation_bytes as block_activation_bytes

MODEL = with_overrides(preset("llama-13b"), layers=6)


def _cfg(recompute: str) -> ParallelConfig:
    return ParallelConfig(
        dp=8, zero_stage=3, dp_engine=DpEngine.FSDP, flash_attention=True, recompute=recompute
    )


def _blocks():  # type: ignore[no-untyped-def]
    return [x for x in MODEL.layer_list() if x.kind is LayerKind.BLOCK]


def test_every_second_block_counted_from_one_replays_its_forward():
    cfg = _cfg("selective-layer")
    replays = [bool(layer_passes(MODEL, cfg, b).replay) for b in _blocks()]
    assert replays == [count % 2 == 0 for count in range(1, 7)]  # blocks 2, 4, 6
    second = _blocks()[1]
    assert layer_passes(MODEL, cfg, second).replay == layer_passes(MODEL, cfg, second).forward


def test_checkpointed_blocks_keep_their_input_and_the_others_everything():
    cfg = _cfg("selective-layer")
    shard = Shard.of(cfg)
    full_block = block_activation_bytes(MODEL, _blocks()[0], shard)
    kept = layer_input_bytes(MODEL, shard)
    others = sum(
        block_activation_bytes(MODEL, x, shard)
        for x in MODEL.layer_list()
        if x.kind is not LayerKind.BLOCK
    )
    # 3 blocks whole, 3 holding their input; one checkpointed block replayed at a time
    expected = 3 * full_block + 3 * kept + others + full_block
    assert activation_bytes(MODEL, cfg) == pytest.approx(expected)


def test_hardware_flops_count_half_the_blocks_forward_again():
    model_flops, hardware = step_flops(MODEL, _cfg("selective-layer"))
    _, full = step_flops(MODEL, _cfg("full"))
    block = next(iter(_blocks()))
    per_block = sum(op.flops for op in layer_passes(MODEL, _cfg("none"), block).forward) * 8  # dp
    assert hardware - model_flops == pytest.approx(3 * per_block, rel=1e-9)
    assert full - model_flops == pytest.approx(forward_flops(MODEL) * 8)


@pytest.mark.parametrize(("field", "value"), [("pp", 2), ("dp_engine", DpEngine.DEEPSPEED)])
def test_outside_torchtitans_fsdp_without_a_pipeline_it_is_refused(field, value):
    kw = {"dp": 8, "zero_stage": 3, "dp_engine": DpEngine.FSDP, "recompute": "selective-layer"}
    with pytest.raises(InputError, match=field):
        ParallelConfig(**(kw | {field: value}))


def test_a_plan_emits_torchtitans_layer_ac_section():
    section = fsdp_config(_cfg("selective-layer"))["activation_checkpointing"]
    assert section == {"mode": "selective", "selective_ac_option": "2"}
    assert Recompute("selective-layer") is Recompute.SELECTIVE_LAYER
