"""A simulated step cut where DeepSpeed's calls cut a real one: `engine(x)` (forward),
`engine.backward` (backward and every gradient reduction), `engine.step` (the norm, the
optimizer, ZeRO-1/2's parameter all-gather). The cuts fall at the first backward kernel and at
the optimizer's first task; "comm" is the time within each phase covered by collectives' spans
(on a CPU rank every collective blocks the thread that calls it, or its wait does). Read by
the validation's phase table (`zsim.validate.phase_split`) and by calibration's engine host
time (`zsim.calibrate.engine_fit`)."""

from __future__ import annotations

from collections.abc import Iterable

from zsim.step.builder import ENGINE_STEP_HOST
from zsim.step.spans import Span

PHASES = ("forward", "backward", "step")  # DeepSpeed's calls: engine(x), .backward, .step
STEP_STARTS = (ENGINE_STEP_HOST, "grad_norm", "step_prepare", "optimizer_step")
COMM_CATEGORIES = ("grad_reduce", "param_gather", "tp_comm")


def simulated_phases(spans: Iterable[Span], rank: int, end_s: float) -> dict[str, float]:
    """forward/backward/step seconds and `<phase>_comm` seconds of `rank`'s simulated step:
    each micro-batch's forward from its first forward task (its engine host time, a gather
    before its first kernel), its backward from its first backward or recompute task, the
    step from the optimizer's first task on."""
    mine = sorted((s for s in spans if s.rank == rank), key=lambda s: s.start_s)
    cuts = [("forward", 0.0)]
    for span in mine:
        phase = _phase_of(span)
        if phase is not None and phase != cuts[-1][0]:
            cuts.append((phase, span.start_s))
    out = dict.fromkeys((*PHASES, *(f"{p}_comm" for p in PHASES)), 0.0)
    transfers = [(s.start_s, s.end_s) for s in mine if _is_transfer(s)]
    for (phase, lo), (_, hi) in zip(cuts, [*cuts[1:], ("", end_s)], strict=True):
        out[phase] += hi - lo
        out[f"{phase}_comm"] += covered(transfers, lo, hi)
    return out


def covered(intervals: Iterable[tuple[float, float]], lo: float, hi: float) -> float:
    """Seconds of [lo, hi) inside at least one interval: a thread blocked in two collectives
    at once (a gather prefetched beside a reduction) is blocked once, as a wall clock sees it."""
    clipped = sorted((max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi)
    total, reach = 0.0, lo
    for a, b in clipped:
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


def _phase_of(span: Span) -> str | None:
    """The DeepSpeed call a task opens, if it opens one (a collective or copy belongs to the
    call that is running)."""
    if span.name in STEP_STARTS:
        return "step"
    if span.category == "forward":
        return "forward"
    if span.category in ("backward", "recompute"):
        return "backward"
    return None


def _is_transfer(span: Span) -> bool:
    """A collective's own span: not the norm kernel of the reduction category, nor a copy
    around a gather (ZeRO-3's and FSDP's copy-out into the parameters, FSDP's copy-in)."""
    in_comm = span.category in COMM_CATEGORIES
    copy = span.name.endswith(("copy_out", "copy_in"))
    return in_comm and span.name != "grad_norm" and not copy


PIPE_INSTRUCTIONS = {  # DeepSpeed TrainSchedule instruction -> the phase it belongs to
    "ForwardPass": "forward",
    "BackwardPass": "backward",
    "ReduceTiedGrads": "step",
    "ReduceGrads": "step",
    "OptimizerStep": "step",
}
PASS_CATEGORIES = ("forward", "backward", "pp_comm")


def simulated_pipeline_phases(spans: Iterable[Span], rank: int, end_s: float) -> dict[str, float]:
    """A pipeline rank's seconds in its forward passes, its backward passes and its step (from
    its last pass or transfer to the step's end), as DeepSpeed's instructions cut them (sends,
    receives and the bubble in none); `<phase>_comm` the collectives inside: a TP collective
    belongs to the pass whose kernel ran last before it."""
    mine = sorted((s for s in spans if s.rank == rank), key=lambda s: s.start_s)
    passes_end = max((s.end_s for s in mine if s.category in PASS_CATEGORIES), default=0.0)
    out = dict.fromkeys(("forward", "backward", "forward_comm", "backward_comm"), 0.0)
    current = "forward"
    for span in mine:
        if span.category in ("forward", "backward"):
            current = span.category
            out[current] += span.end_s - span.start_s
        elif span.category == "tp_comm" and _is_transfer(span):
            out[current] += span.end_s - span.start_s
            out[f"{current}_comm"] += span.end_s - span.start_s
    out["step"] = end_s - passes_end
    out["step_comm"] = sum(
        max(0.0, s.end_s - max(s.start_s, passes_end)) for s in mine if _is_transfer(s)
    )
    return out
