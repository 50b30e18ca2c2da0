"""Megatron-Core's context parallelism (`zsim.workload.context_parallel`) against its source:
TransformerEngine's `AttnFuncWithCPAndKVP2P` with Megatron's load-balanced chunks (each rank
holds chunks i and 2 cp - 1 - i of 2 cp), the keys and values it sends around the ring, and
Megatron's gradient reduction over data x context parallel ranks. Expected values are worked
by hand from those rules, not read from zsim."""

import pytest

from zsim.errors import InputError
from zsim.inputs import presets
from zsim.inputs.scenario import check_layout
from zsim.memory import ledger
from zsim.simulation import simulate
from zsim.step.job import StageJob
from zsim.step.kernels import LayerKernels
from zsim.step.program import Category, Stream
from zsim.workload.layout import layer_passes
from zsim.workload.model import LayerKind, OpKind
from zsim.workload.model_presets import preset, with_overrides
from zsim.workload.parallel import ParallelConfig
from zsim.workload.shapes import Shard, forward_ops

LLAMA = with_overrides(preset("llama-7b"), seq_len=8192, layers=4)
H100 = presets.gpu("h100-sxm")


def _cfg(**kw) -> ParallelConfig:
    base = {
        "dp": 4,
        "cp": 2,
        "zero_stage": 1,
        "precision": "bf16",
        "dp_engine": "megatron",
        "flash_attention": True,
    }
    return ParallelConfig(**(base | kw))


def _block(cp: int, tp: int = 1) -> tuple:
    block = next(x for x in LLAMA.layer_list() if x.kind is LayerKind.BLOCK)
    return forward_ops(LLAMA, block, Shard(1, tp, flash_attention=True, cp=cp))


def _causal_flops(ops) -> float:
    """What the kernels compute: a causal step does half its unmasked FLOPs."""
    attention = [op for op in ops if op.kind is OpKind.ATTENTION]
    return sum(op.flops * (0.5 if op.attention.causal else 1.0) for op in attention)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_each_rank_does_one_cp_th_of_the_causal_attention(cp):
    # the whole causal attention: 4 b s^2 heads hd / 2 (QK^T and PV, the upper half masked)
    s, heads, hd = 8192, 32, 128
    whole = 4 * s * s * heads * hd / 2
    assert _causal_flops(_block(cp)) == pytest.approx(whole / cp)
    # TE's cp steps: the rank's own chunks under the mask, then one step per other rank
    steps = [op for op in _block(cp) if op.kind is OpKind.ATTENTION]
    assert len(steps) == cp
    assert [op.attention.causal for op in steps] == [True] + [False] * (cp - 1)


def test_every_other_op_sees_s_over_cp_tokens():
    def gemm_flops(ops):
        return sum(op.flops for op in ops if op.kind is OpKind.GEMM)

    def memory_bytes(ops):  # TE's merging of the steps' results aside (its own test)
        return sum(
            op.bytes_moved for op in ops if op.kind is OpKind.MEMORY and "cp_" not in op.name
        )

    for cp in (2, 4):
        assert gemm_flops(_block(cp)) == pytest.approx(gemm_flops(_block(1)) / cp)
        assert memory_bytes(_block(cp)) == pytest.approx(memory_bytes(_block(1)) / cp)


def test_world_size_and_batch():
    cfg = _cfg(micro_batch=1, grad_accum=2)
    assert cfg.world_size == 8
    assert cfg.dp_cp == 8
    # the cp ranks of a group share their sequences: the batch counts dp only
    assert cfg.global_batch == 1 * 2 * 4


def test_the_ring_and_the_gradient_reduction_move_what_megatron_sends():
    cfg = _cfg(micro_batch=1, grad_accum=2)
    report = simulate(LLAMA, cfg, presets.topology("1x8-dgx-h100"), H100)
    # one step's keys and values: 2 x 4096 tokens x 32 heads x 128 x 2 bytes; per layer and
    # micro-batch one exchange forward, two backward (keys and values, then their gradients
    # home)
    kv = 2 * 4096 * 32 * 128 * 2
    assert report.traffic_bytes_per_gpu["cp_comm"] == pytest.approx(4 * 2 * 3 * kv)
    # gradients reduce-scattered in fp32 over the 8 data x context parallel ranks: each sends
    # 7/8 of them (Megatron-Core's DDP, bf16 with accumulate_allreduce_grads_in_fp32)
    grads = sum(x.params() for x in LLAMA.layer_list()) * 4
    assert report.traffic_bytes_per_gpu["grad_reduce"] == pytest.approx(grads * 7 / 8, rel=0.01)


def test_activations_split_by_cp_states_by_dp_cp():
    one, two = ledger(LLAMA, _cfg(cp=1, dp=8)), ledger(LLAMA, _cfg())
    assert two.activations == pytest.approx(one.activations / 2)
    # the distributed optimizer shards over dp x cp = 8 ranks either way
    assert two.optimizer_states == pytest.approx(one.optimizer_states)


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"dp_engine": "deepspeed"}, "dp_engine"),
        ({"flash_attention": False}, "flash_attention"),
    ],
)
def test_refused_outside_megatron_core_with_fused_attention(kw, field):
    with pytest.raises(InputError, match=field):
        _cfg(**kw)


def test_a_sequence_that_does_not_split_into_2_cp_chunks_is_refused():
    odd = with_overrides(LLAMA, seq_len=8190)
    with pytest.raises(InputError, match="cp"):
        check_layout(odd, _cfg(cp=4, dp=2))


class _Recorder:
    """An emitter that keeps each task's name, stream, bytes and dependencies."""

    def __init__(self):
        self.tasks = []

    def compute(self, name, _seconds, _category, deps, stream=Stream.COMPUTE, **_kwargs):
        return self._add(name, stream, 0.0, deps)

    def comm(self, name, comm, _category, deps, stream=Stream.COMPUTE):
        return self._add(name, stream, comm.nbytes, deps)

    def _add(self, name, stream, nbytes, deps):
        self.tasks.append((name, stream, nbytes, tuple(deps)))
        return len(self.tasks) - 1


def _backward_tasks(cp: int) -> list:
    cfg = _cfg(cp=cp, dp=8 // cp, micro_batch=1)
    job = StageJob.of(LLAMA, cfg, H100, 0, False)
    block = next(x for x in LLAMA.layer_list() if x.kind is LayerKind.BLOCK)
    rec = _Recorder()
    backward = layer_passes(LLAMA, cfg, block).backward
    end = LayerKernels(job, None).run_ops(rec, block, backward, False, Category.BACKWARD, [], "b")
    return rec.tasks, end


def test_the_backward_ring_follows_te():
    # TE's backward (AttnFuncWithCPAndKVP2P): each exchange after the first carries the keys
    # and values and the gradients of the step before, so it waits for that step; beside the
    # last step only those gradients go home, on the ring's stream, and the layer waits for them
    tasks, end = _backward_tasks(4)
    kv = 2 * 2048 * 32 * 128 * 2  # s / cp = 2048 tokens of k and v, 32 heads of 128, bf16
    steps = [i for i, t in enumerate(tasks) if "attention" in t[0]]
    rings = [i for i, t in enumerate(tasks) if t[0].endswith("cp_exchange")]
    assert len(steps) == 4
    assert len(rings) == 4  # cp - 1 exchanges ahead and the gradients home
    ring_bytes = [tasks[i][2] * 3 / 4 for i in rings]  # each rank sends (cp - 1) / cp of it
    assert ring_bytes == pytest.approx([kv, 2 * kv, 2 * kv, kv])
    assert all(tasks[i][1] is Stream.CP for i in rings)
    for ring in rings[1:]:  # after the step before it
        assert any(d in steps and d < ring for d in tasks[ring][3])
    assert _waits_for(tasks, end, rings[-1])


def _waits_for(tasks, task, target) -> bool:
    return target in tasks[task][3] or any(_waits_for(tasks, d, target) for d in tasks[task][3])


def test_the_optimizer_shards_over_dp_x_cp():
    # Megatron's distributed optimizer shards over data x context parallel ranks
    for cp in (1, 2, 4):
        assert _cfg(cp=cp, dp=8 // cp).shard_ranks == 8


@pytest.mark.parametrize("cp", [2, 4])
def test_te_merges_the_steps_results(cp):
    # forward (flash_attn_fwd_out_correction_init, then ..._correction per step): the first
    # step's output copied (bf16: 2 + 2 bytes), each later one added in place (2 + 2 + 2);
    # backward the same for dq and for dk, dv (the kv heads) on the slowest rank
    tokens, heads, kv_heads, hd = 8192 // cp, 32, 32, 128
    q, kv = tokens * heads * hd, 2 * tokens * kv_heads * hd
    merge = next(op for op in _block(cp) if op.name == "cp_merge")
    assert merge.bytes_moved == (4 + 6 * (cp - 1)) * q
    assert merge.grad[0] == (4 + 6 * (cp - 1)) * (q + kv)
