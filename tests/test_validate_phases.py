"""The phase clock of the validation worker and the phase cut of a simulated step, on
hand-made inputs whose phases are known."""

import itertools
from typing import ClassVar

import pytest

from zsim.step.phases import simulated_phases, simulated_pipeline_phases
from zsim.step.program import Stream
from zsim.step.spans import Span
from zsim.testbed import phase_clock as phases
from zsim.validate.phase_split import measured_phases


class FakeWork:
    def __init__(self, log):
        self.log = log

    def wait(self):
        self.log.append("wait")

    def is_completed(self):
        return len(self.log)


class FakeBackend:
    """deepspeed.comm's backend object: a blocking all_reduce, an async all-gather that calls
    the backend's own all_gather inside (counted once)."""

    def __init__(self):
        self.log = []

    def all_reduce(self, *_args, **_kwargs):
        self.log.append("all_reduce")

    def all_gather(self, *_args, **_kwargs):
        self.log.append("all_gather")

    def all_gather_into_tensor(self, out, x, async_op=False):
        self.all_gather(out, x)
        return FakeWork(self.log) if async_op else None


@pytest.fixture
def ticking(monkeypatch):
    """perf_counter advancing 1 s per call: every timed interval is a known count of calls."""
    counter = itertools.count()
    monkeypatch.setattr(phases.time, "perf_counter", lambda: float(next(counter)))


@pytest.mark.usefixtures("ticking")
def test_collectives_are_timed_in_the_phase_that_calls_or_waits():
    backend = FakeBackend()
    clock = phases.PhaseClock()
    clock.instrument(backend)
    clock.start_step()
    with clock.phase("forward"):
        work = backend.all_gather_into_tensor(None, None, async_op=True)
    with clock.phase("backward"):
        backend.all_reduce(None)
        work.wait()
    clock.end_step()
    (step,) = clock.steps
    assert backend.log == ["all_gather", "all_reduce", "wait"]
    assert work.is_completed() == 3  # the wrapped handle still answers what the real one does
    # the inner all_gather is inside the outer call: one call of all_gather_into_tensor
    assert step["comm_calls"] == {
        "forward.all_gather_into_tensor": 1,
        "backward.all_reduce": 1,
        "backward.all_gather_into_tensor": 0,  # a wait, not a call
    }
    # a clock reading per tick: the outer call reads at 1 and 3, the inner one's start at 2
    # (an inner call's end is not read); the phase at 0 and 4
    assert step["comm_s"]["forward.all_gather_into_tensor"] == 2.0
    assert step["comm_s"]["backward.all_reduce"] == 1.0
    assert step["forward"] == 4.0
    assert step["step"] == 0.0


class FakeTorchDistributed:
    """torch.distributed as the TP layers call it (and deepspeed.comm's backend calls it)."""

    def __init__(self, log):
        self.log = log

    def all_reduce(self, *_args, **_kwargs):
        self.log.append("torch.all_reduce")


@pytest.mark.usefixtures("ticking")
def test_torch_distributed_calls_are_timed_once_whoever_calls_them():
    """A TP layer's torch.distributed call counts to its own op; deepspeed.comm's, which goes
    through torch.distributed, counts once, to deepspeed.comm's op."""
    backend = FakeBackend()
    torch_dist = FakeTorchDistributed(backend.log)
    backend.all_reduce = lambda *a, **k: torch_dist.all_reduce(*a, **k)
    clock = phases.PhaseClock()
    clock.instrument(backend)
    clock.instrument(torch_dist)
    clock.start_step()
    with clock.phase("forward"):
        torch_dist.all_reduce(None)  # the TP layer
        backend.all_reduce(None)  # DeepSpeed
    clock.end_step()
    (step,) = clock.steps
    assert backend.log == ["torch.all_reduce", "torch.all_reduce"]
    assert step["comm_calls"] == {"forward.all_reduce": 2}


def test_median_phases_take_each_phase_and_op_over_steps():
    steps = [
        {"forward": f, "backward": 2.0, "step": 1.0, "comm_s": c, "comm_calls": {}}
        for f, c in ((1.0, {"backward.all_reduce": 0.5}), (3.0, {}), (2.0, {}))
    ]
    out = phases.median_phases(steps)
    assert out["forward"] == 2.0
    assert out["comm_s"] == {"backward.all_reduce": 0.0}  # absent in two steps of three


def span(stream, name, category, start, end):
    return Span(0, stream, name, category, start, end)


def test_a_simulated_step_is_cut_where_deepspeed_calls_cut_it():
    spans = [
        span(Stream.COMPUTE, "F0.linear", "forward", 0.0, 3.0),
        span(Stream.GATHER, "F0.gather", "param_gather", 0.0, 2.0),
        span(Stream.TP, "F0.tp_all_reduce", "tp_comm", 2.0, 2.5),  # a TP collective is comm
        span(Stream.COMPUTE, "F0.gather_copy_out", "param_gather", 2.0, 2.5),
        span(Stream.COMPUTE, "B0.linear", "backward", 3.0, 10.0),
        span(Stream.COMPUTE, "grad_reduce", "grad_reduce", 10.0, 14.0),
        span(Stream.COMPUTE, "grad_norm", "grad_reduce", 14.0, 15.0),
        span(Stream.COMPUTE, "optimizer_step", "optimizer", 15.0, 18.0),
        span(Stream.COMPUTE, "param_allgather", "param_gather", 18.0, 20.0),
        Span(1, Stream.COMPUTE, "B0.linear", "backward", 1.0, 2.0),  # another rank
    ]
    out = simulated_phases(spans, 0, 20.0)
    assert (out["forward"], out["backward"], out["step"]) == (3.0, 11.0, 6.0)
    assert (out["forward_comm"], out["backward_comm"], out["step_comm"]) == (2.5, 4.0, 2.0)


def test_every_micro_batchs_forward_counts_to_the_forward():
    # two micro-batches: engine(x), backward, engine(x), backward, then the step
    spans = [
        span(Stream.COMPUTE, "F0.engine_host", "forward", 0.0, 1.0),
        span(Stream.COMPUTE, "F0.L0.gather", "param_gather", 1.0, 2.0),  # in its forward
        span(Stream.COMPUTE, "F0.L0.linear", "forward", 2.0, 4.0),
        span(Stream.COMPUTE, "B0.L0.linear", "backward", 4.0, 8.0),
        span(Stream.COMPUTE, "grad_reduce", "grad_reduce", 8.0, 9.0),
        span(Stream.COMPUTE, "F1.engine_host", "forward", 9.0, 10.0),
        span(Stream.COMPUTE, "F1.L0.linear", "forward", 10.0, 12.0),
        span(Stream.COMPUTE, "B1.L0.re.linear", "recompute", 12.0, 14.0),
        span(Stream.COMPUTE, "B1.L0.linear", "backward", 14.0, 18.0),
        span(Stream.COMPUTE, "optimizer_step", "optimizer", 18.0, 20.0),
    ]
    out = simulated_phases(spans, 0, 20.0)
    assert (out["forward"], out["backward"], out["step"]) == (7.0, 11.0, 2.0)
    assert (out["forward_comm"], out["backward_comm"]) == (1.0, 1.0)


def test_a_simulated_pipeline_step_is_cut_where_its_instructions_cut_it():
    spans = [
        span(Stream.COMPUTE, "F0.mb0.linear", "forward", 0.0, 2.0),
        span(Stream.TP, "F0.mb0.tp_all_reduce", "tp_comm", 2.0, 2.5),  # inside the forward
        span(Stream.P2P, "send.F0.mb0", "pp_comm", 2.5, 3.0),  # between passes: no phase
        span(Stream.COMPUTE, "F0.mb1.linear", "forward", 3.0, 5.0),
        span(Stream.COMPUTE, "B0.mb0.linear", "backward", 8.0, 12.0),  # after a bubble
        span(Stream.TP, "B0.mb0.tp_all_reduce", "tp_comm", 12.0, 13.0),
        span(Stream.COMPUTE, "B0.mb1.linear", "backward", 13.0, 17.0),
        span(Stream.COMPUTE, "grad_reduce", "grad_reduce", 17.0, 19.0),
        span(Stream.COMPUTE, "optimizer_step", "optimizer", 19.0, 21.0),
        Span(1, Stream.COMPUTE, "F0.mb0.linear", "forward", 2.0, 4.0),  # another rank
    ]
    out = simulated_pipeline_phases(spans, 0, 21.0)
    assert (out["forward"], out["backward"], out["step"]) == (4.5, 9.0, 4.0)
    assert (out["forward_comm"], out["backward_comm"], out["step_comm"]) == (0.5, 1.0, 2.0)


class ForwardPass: ...


class SendActivation: ...


class FakePipelineEngine:
    """DeepSpeed's PipelineEngine: a class-level map from instruction type to method."""

    def _exec_forward(self):
        pass

    def _exec_send(self):
        pass

    _INSTRUCTION_MAP: ClassVar = {ForwardPass: _exec_forward, SendActivation: _exec_send}

    def run(self, kind):
        self._INSTRUCTION_MAP[kind](self)


@pytest.mark.usefixtures("ticking")
def test_a_pipeline_instruction_is_timed_to_its_phase_and_a_send_to_none():
    engine, clock = FakePipelineEngine(), phases.PhaseClock()
    clock.instrument_pipeline(engine)
    clock.start_step()
    engine.run(ForwardPass)
    engine.run(SendActivation)
    engine.run(ForwardPass)
    clock.end_step()
    step = clock.steps[0]
    assert (step["forward"], step["backward"], step["step"]) == (2.0, 0.0, 0.0)
    assert FakePipelineEngine._INSTRUCTION_MAP[ForwardPass] is FakePipelineEngine._exec_forward


def test_measured_phases_sum_each_phase_collectives():
    per_rank = [
        {
            "forward": 0.01,
            "backward": 0.05,
            "step": 0.02,
            "comm_s": {"backward.all_reduce": 0.03, "backward.broadcast": 0.001},
        }
    ]
    out = measured_phases(per_rank)
    assert out["backward_comm"] == pytest.approx(0.031)
    assert out["forward_comm"] == 0.0


def test_concurrent_collectives_block_the_thread_once():
    # a prefetched gather beside a reduce-scatter: the wall clock sees 3 s blocked, not 4
    spans = [
        span(Stream.COMPUTE, "B0.linear", "backward", 0.0, 5.0),
        span(Stream.GATHER, "B0.gather", "param_gather", 1.0, 3.0),
        span(Stream.REDUCE, "B0.reduce_scatter", "grad_reduce", 2.0, 4.0),
    ]
    out = simulated_phases(spans, 0, 5.0)
    assert out["backward"] == 5.0
    assert out["backward_comm"] == pytest.approx(3.0)
