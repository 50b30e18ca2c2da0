"""The phases of a real training step, timed on the rank's own thread: by the validation
worker (diagnosis only: nothing it records reaches a profile or a default) and by
calibration's tiny engine steps (`calibrate.engine_host`: the host's time outside collectives).

Per step and rank: wall time of the forward (`engine(x)`), the backward (`engine.backward`,
with its hooks: ZeRO's reductions, stage 3's gathers and releases) and the step
(`engine.step`: the optimizer, ZeRO-1/2's parameter all-gather); and inside them the time the
rank's thread spent in each collective `deepspeed.comm` sent to torch (its backend's methods,
wrapped), keyed "phase.op", with an async call's `wait()` counted to its op in the phase
that waits. A pipeline's `train_batch` runs DeepSpeed's TrainSchedule instructions: each
pass, and the step's reductions and optimizer, is timed to its phase (`PIPE_INSTRUCTIONS`);
sends, receives and the waits between them fall outside every phase. On CPU the gloo and
shared-memory collectives block the calling thread or are waited for on it, so a phase minus
its collectives is the host's own work: compute and Python.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from zsim.step.phases import PHASES, PIPE_INSTRUCTIONS

TIMED_OPS = (
    "all_reduce",
    "inference_all_reduce",
    "all_reduce_coalesced",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",  # torch 2.13: what all_gather_into_tensor calls, and FSDP2
    "all_gather_coalesced",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "broadcast",
    "all_to_all_single",
    "send",
    "recv",
    "isend",
    "irecv",
)


class _TimedWork:
    """An async collective's handle whose `wait()` is timed to its op."""

    def __init__(self, work: Any, clock: PhaseClock, op: str) -> None:
        self._work, self._clock, self._op = work, clock, op

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        with self._clock.collective(self._op, call=False):
            return self._work.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class PhaseClock:
    """Accumulates the phases and collectives of the current step (`start_step`/`end_step`)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self._current: dict[str, Any] | None = None
        self._depth = 0  # a backend method that calls another is counted once
        self._phase = "other"
        self._wrapped: list[tuple[Any, str, Any]] = []

    def instrument(self, backend: Any) -> None:
        """Wrap `backend`'s collective methods (deepspeed.comm's `cdb`) on the instance."""
        for op in TIMED_OPS:
            method = getattr(backend, op, None)
            if callable(method):
                self._wrapped.append((backend, op, method))
                setattr(backend, op, self._timed(op, method))

    def restore(self) -> None:
        """Put back every method `instrument` wrapped, in reverse order."""
        while self._wrapped:
            backend, op, method = self._wrapped.pop()
            setattr(backend, op, method)

    def instrument_pipeline(self, engine: Any) -> None:
        """Run each of a PipelineEngine's phase instructions inside its phase (the instance's
        own instruction map: the class's stays as it was)."""

        def in_phase(run: Any, phase: str) -> Any:
            def timed(*args: Any, **kwargs: Any) -> Any:
                with self.phase(phase):
                    return run(*args, **kwargs)

            return timed

        engine._INSTRUCTION_MAP = {
            kind: in_phase(run, PIPE_INSTRUCTIONS[kind.__name__])
            if kind.__name__ in PIPE_INSTRUCTIONS
            else run
            for kind, run in type(engine)._INSTRUCTION_MAP.items()
        }

    def _timed(self, op: str, method: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.collective(op):
                out = method(*args, **kwargs)
            return _TimedWork(out, self, op) if hasattr(out, "wait") else out

        return timed

    @contextmanager
    def collective(self, op: str, call: bool = True) -> Iterator[None]:
        """Time spent inside a collective (`call`: a call, else the wait of an async one)."""
        outer = self._depth == 0
        self._depth += 1
        start = time.perf_counter()
        try:
            yield
        finally:
            self._depth -= 1
            if outer and self._current is not None:
                key = f"{self._phase}.{op}"
                self._current["comm_s"][key] += time.perf_counter() - start
                self._current["comm_calls"][key] += int(call)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        self._phase = name
        try:
            yield
        finally:
            self._phase = "other"
            if self._current is not None:
                self._current[name] += time.perf_counter() - start

    def start_step(self) -> None:
        self._current = dict.fromkeys(PHASES, 0.0) | {
            "comm_s": defaultdict(float),
            "comm_calls": defaultdict(int),
        }

    def end_step(self) -> None:
        assert self._current is not None
        done = self._current
        done["comm_s"], done["comm_calls"] = dict(done["comm_s"]), dict(done["comm_calls"])
        self.steps.append(done)
        self._current = None


def median_phases(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """One rank's phases, each the median over its timed steps (ms-level noise on CPU: a
    median, not a mean); a collective a step did not call counts 0 in it."""
    if not steps:
        return {}
    ops = sorted({op for s in steps for op in s["comm_s"]})
    return {p: statistics.median([s[p] for s in steps]) for p in PHASES} | {
        "comm_s": {op: statistics.median([s["comm_s"].get(op, 0.0) for s in steps]) for op in ops},
        "comm_calls": {op: max(s["comm_calls"].get(op, 0) for s in steps) for op in ops},
    }
