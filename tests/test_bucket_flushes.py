"""DeepSpeed's IPG bucket flushes (`zsim.step.zero_reduce.flush_sizes`) and the calls the
planner's closed form charges for them and for ZeRO-3's prefetches, one latency each.

Expected values are worked by hand from DeepSpeed 0.19.8's rules, not from zsim: a gradient
that would overflow `reduce_bucket_size` flushes the bucket before it joins; a larger one
joins the empty bucket and goes with the next (stage3.py and stage_1_and_2.py
`reduce_independent_p_g_buckets_and_remove_grads`); the backward's epilogue flushes the rest.
The coordinator prefetches, after each module's fetch, parameters until the prefetch bucket
is reached, at least one (`fetch_sub_module`).
"""

from __future__ import annotations

import pytest

from zsim.inputs import presets
from zsim.plan.zero3_terms import GatherSums
from zsim.step.builder import build_program
from zsim.step.zero_reduce import flush_sizes
from zsim.workload.knobs import ZeroKnobs
from zsim.workload.layout import rank_chunks
from zsim.workload.model import ModelKind, ModelSpec
from zsim.workload.model_presets import preset
from zsim.workload.parallel import ParallelConfig

MLP = ModelSpec("toy-mlp", ModelKind.MLP, layers=8, hidden=1024)  # the seeds' 8 x Linear
WEIGHT, BIAS = 1024 * 1024, 1024
GPT = preset("gpt-125m")


def test_a_bucket_flushes_before_the_gradient_that_overflows_it() -> None:
    # bucket of 10: 3 + 4 = 7; 5 overflows it (flush 7); 20 overflows 5 (flush 5) and joins
    # alone; 1 flushes the 20; 1 + 2 = 3 goes with the epilogue
    assert flush_sizes([3, 4, 5, 20, 1, 2], 10) == [7, 5, 20, 3]
    assert flush_sizes([20], 10) == [20]
    assert flush_sizes([], 10) == []


def test_one_element_buckets_flush_every_gradient_alone() -> None:
    # the MLP's backward: linear7.bias, linear7.weight, linear6.bias, ... each its own flush
    sizes = flush_sizes([n for _ in range(8) for n in (BIAS, WEIGHT)], 1)
    assert sizes == [BIAS, WEIGHT] * 8


def test_the_closed_form_counts_deepspeeds_calls() -> None:
    dp = 4
    knobs = ZeroKnobs(reduce_bucket_size=1, prefetch_bucket_size=1)
    sums = GatherSums(MLP).of(ParallelConfig(dp=dp, zero_stage=3, knobs=knobs), 0)
    # the biases stay gathered (1,024 elements, under the persistence threshold); the first
    # weight is fetched and waited for, each module's fetch prefetches the next weight
    assert sums.forward_blocking == (WEIGHT,)
    assert sums.forward_prefetches == ((WEIGHT, 7),)
    assert sums.backward_prefetches == ()  # kept gathered into the backward (reuse distance)
    assert dict(sums.flushes) == {BIAS: 8, WEIGHT: 8}  # both divide by dp: no padding


@pytest.mark.consistency
def test_the_simulation_reduces_the_flushes_the_rule_gives() -> None:
    """The step's reduce-scatters against `flush_sizes` over the same order (both tiers)."""
    dp, bucket = 16, 2_000_000
    cfg = ParallelConfig(dp=dp, zero_stage=3, knobs=ZeroKnobs(reduce_bucket_size=bucket))
    program = build_program(GPT, cfg, presets.gpu("a100-80gb"), 0)
    bf16 = 2
    reduced = [t.comm.nbytes / bf16 for t in program.tasks if t.name == "grad_reduce" and t.comm]
    layers = rank_chunks(GPT, cfg, 0)[0]
    order = [t.per_rank(1) for layer in reversed(layers) for t in reversed(layer.tensors)]
    assert reduced == [-(-n // dp) * dp for n in flush_sizes(order, bucket)]
