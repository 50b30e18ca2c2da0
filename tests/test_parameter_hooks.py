"""DeepSpeed's gradient hooks run per parameter (`zsim.step.zero_reduce.ParameterHooks`).

Expected orders and positions come from DeepSpeed 0.19.8's source, not from zsim: stage 2 and
stage 3 register one hook per parameter (`register_grad_hook`), which autograd runs right
after the node that computed the gradient; each hook adds the gradient to the IPG bucket after
the reduction stream waited for the compute stream (`__add_grad_to_ipg_bucket`), and flushes
the bucket first when the gradient would overflow `reduce_bucket_size` (a larger gradient
joins the empty bucket and goes with the next hook). With a bucket of one element every
gradient is its own flush, made by the next gradient's hook: a transformer block's backward
runs fc2, fc1, ln2, proj, qkv, ln1, so fc2's weight gradient, the block's first large one, is
reduced once fc2's kernels have run (the host, ahead, flushes it at fc1's hooks), long before
the block's backward ends. ZeRO-3's throttle on its
reductions (`max_param_reduce_events`) is an `Event.synchronize()`: the host waits, not the
device.
"""

from __future__ import annotations

import dataclasses

from zsim.inputs import presets
from zsim.simulation import _run
from zsim.step.builder import build_program
from zsim.step.program import Stream
from zsim.workload.knobs import ZeroKnobs
from zsim.workload.model_presets import preset
from zsim.workload.parallel import ParallelConfig

GPU = presets.gpu("a100-80gb")
GPT = preset("gpt-125m")
ONE_ELEMENT_BUCKETS = ZeroKnobs(reduce_bucket_size=1)


def _last_block_backward(stage: int) -> tuple[list[tuple[str, float, float]], list[float]]:
    """The last block's backward kernels (name, start, end) and the starts of the reductions
    of its weight gradients that began while they ran, in one step over 2 nodes of 8."""
    cfg = ParallelConfig(dp=16, zero_stage=stage, knobs=ONE_ELEMENT_BUCKETS)
    topo = presets.topology("2x8-dgx-a100")
    _, result = _run(GPT, cfg, topo, GPU, False, {})
    spans = [s for s in result.all_spans() if s.rank == 0]
    block = f"B0c0.block{GPT.layers - 1}."
    kernels = sorted(
        (s.name.removeprefix(block), s.start_s, s.end_s)
        for s in spans
        if s.stream is Stream.COMPUTE and s.name.startswith(block) and ".re." not in s.name
    )
    kernels.sort(key=lambda k: k[1])
    begin, end = kernels[0][1], kernels[-1][2]
    # the block's weight gradients (its biases and norms are small: the head's too)
    reductions = sorted(
        s.start_s
        for s in spans
        if s.name == "grad_reduce" and s.nbytes > 1e6 and begin <= s.start_s < end
    )
    return kernels, reductions


def test_a_submodule_gradient_is_reduced_once_its_kernels_ran() -> None:
    for stage in (2, 3):
        kernels, reductions = _last_block_backward(stage)
        starts = {name.split(".")[-1]: start for name, start, _ in kernels}
        assert reductions
        # fc2's weight gradient, the block's first large one, is flushed by fc1's hooks, which
        # the host reaches ahead of the device; the reduction stream waited for the compute
        # stream when the gradient joined, so it runs once fc2's kernels (those before the
        # activation's backward) have ...
        fc2_end = max(end for _, start, end in kernels if start < starts["activation_bwd"])
        assert reductions[0] >= fc2_end - 1e-12
        # ... not after the block's last kernel, ln1's backward
        assert kernels[-1][0].endswith("ln1_bwd")
        assert reductions[0] < starts["ln1_bwd"]


def test_the_reduction_throttle_holds_the_host() -> None:
    cfg = ParallelConfig(dp=16, zero_stage=3, knobs=ONE_ELEMENT_BUCKETS)
    program = build_program(GPT, cfg, GPU, 0)
    throttles = [t for t in program.tasks if t.name == "reduce_throttle"]
    assert len(throttles) > 100  # every flush past the third of each backward
    assert {t.stream for t in throttles} == {Stream.HOST}
    # it waits for an earlier reduction and the host's own work, not for the kernels at hand
    assert not any(d.stream is Stream.COMPUTE for t in throttles for d in t.deps)


def test_cpu_ranks_throttle_on_no_reduction_events() -> None:
    """On gloo (CPU ranks) DeepSpeed records no reduction events: no throttle at all."""
    cpu = dataclasses.replace(GPU, backend="gloo")
    cfg = ParallelConfig(dp=16, zero_stage=3, knobs=ONE_ELEMENT_BUCKETS)
    program = build_program(GPT, cfg, cpu, 0, gloo=True)
    assert not [t for t in program.tasks if t.name == "reduce_throttle"]
