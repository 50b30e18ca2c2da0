"""A sweep: a grid of models x clusters x layouts (or a plan per model and cluster), each point
simulated on its own, so that a pool of processes or a Dask cluster can run them in any order.

A spec (YAML or JSON):

    models: [gpt-1.3b, gpt-13b]          # presets or PRESET:key=value
    topologies: [1x8-nvlink, 2x4-ethernet, 4x8-dgx-a100]
    gpu: a100-80gb                       # optional: else each cluster's own GPU
    mode: layouts                        # or plan: the planner's winner per model and cluster
    layouts:                             # every combination; a scalar is a list of one
      stage: [0, 1, 2, 3]
      tp: [1, 2]
      global_batch: 64
      micro_batch: [1, 2]

Layout keys are `zsim run`'s flags (underscores); dp is what the cluster leaves
(GPUs / (tp x pp x cp)). In plan mode the keys are `global_batch`, `seq_len`, `objective`.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from zsim.errors import InputError, require

LAYOUT_KEYS = (
    "stage", "tp", "pp", "cp", "micro_batch", "grad_accum", "global_batch", "precision",
    "recompute", "offload", "pp_schedule", "pipeline_engine", "virtual_stages", "dp_engine",
    "sequence_parallel",
    "flash_attention", "attention_kernel", "elementwise", "overlap_comm", "reduce_bucket_size",
    "prefetch_bucket_size",
)  # fmt: skip
PLAN_KEYS = ("global_batch", "seq_len", "objective")
SPEC_KEYS = ("models", "topologies", "gpu", "mode", "layouts")
MODES = ("layouts", "plan")


@dataclass(frozen=True)
class Point:
    """One simulation of the sweep."""

    model: str
    topology: str
    gpu: str | None
    mode: str
    settings: tuple[tuple[str, Any], ...]

    @property
    def key(self) -> str:
        """What identifies the point across runs (the resume key)."""
        return json.dumps([self.model, self.topology, self.gpu, self.mode, self.settings])


def points(spec: Mapping[str, Any], source: str = "spec") -> list[Point]:
    """Every point of a spec, validated: one clear error naming the field otherwise."""
    require(isinstance(spec, Mapping), source, type(spec).__name__, "a mapping of " + _keys())
    unknown = sorted(set(spec) - set(SPEC_KEYS))
    require(not unknown, f"{source}:{unknown[0] if unknown else ''}", "unknown", _keys())
    models = _names(spec, "models", source)
    topologies = _names(spec, "topologies", source)
    mode = spec.get("mode", "layouts")
    require(mode in MODES, f"{source}:mode", mode, "layouts or plan")
    gpu = spec.get("gpu")
    require(gpu is None or isinstance(gpu, str), f"{source}:gpu", gpu, "a GPU preset name")
    grid = spec.get("layouts") or {}
    require(isinstance(grid, Mapping), f"{source}:layouts", grid, "a mapping of key: values")
    allowed = LAYOUT_KEYS if mode == "layouts" else PLAN_KEYS
    for key in grid:
        require(key in allowed, f"{source}:layouts.{key}", "unknown", ", ".join(allowed))
    axes = [[(k, v) for v in _values(grid[k], f"{source}:layouts.{k}")] for k in sorted(grid)]
    out = []
    for model, topology in itertools.product(models, topologies):
        for combo in itertools.product(*axes):
            out.append(Point(model, topology, gpu, mode, tuple(combo)))
    return out


def _keys() -> str:
    return "models, topologies (lists) and optionally gpu, mode, layouts"


def _names(spec: Mapping[str, Any], key: str, source: str) -> list[str]:
    value = spec.get(key)
    ok = isinstance(value, list) and value and all(isinstance(v, str) for v in value)
    require(bool(ok), f"{source}:{key}", value, "a non-empty list of names")
    return [str(v) for v in value or ()]


def _values(value: Any, field: str) -> list[Any]:
    values = value if isinstance(value, list) else [value]
    require(bool(values), field, value, "a value or a non-empty list")
    for v in values:
        ok = isinstance(v, str | int | float | bool)
        require(ok, field, v, "numbers, names or true/false")
    return values


def run_point(point: Point) -> dict[str, Any]:
    """Simulate one point: its row (the point's settings, then the results, or why not)."""
    row: dict[str, Any] = {"key": point.key, "model": point.model, "topology": point.topology}
    row.update({"gpu": point.gpu or "", "mode": point.mode, **dict(point.settings)})
    try:
        row.update(_plan(point) if point.mode == "plan" else _simulate(point))
    except InputError as exc:
        row.update(status="invalid", reason=str(exc))
    return row


def _context(point: Point) -> tuple[Any, Any, Any]:
    from zsim.inputs import presets
    from zsim.inputs.scenario import parse_model

    topo = presets.topology(point.topology)
    gpu = point.gpu or topo.gpu_model
    require(gpu is not None, "gpu", None, "a GPU preset for a cluster without one")
    return parse_model(point.model), topo, presets.gpu(str(gpu))


def _simulate(point: Point) -> dict[str, Any]:
    from zsim.inputs.scenario import build_parallel, check_layout, dp_left, parse_int
    from zsim.simulation import simulate

    model, topo, device = _context(point)
    flags = dict(point.settings)
    tp, pp, cp = (parse_int(k, flags.get(k)) or 1 for k in ("tp", "pp", "cp"))
    dp = dp_left(topo.world_size, topo.name, tp, pp, cp)
    cfg, _ = build_parallel(dp=dp, hidden=model.hidden, **flags)
    check_layout(model, cfg)
    report = simulate(model, cfg, topo, device)
    return _results(report, topo.world_size, cfg)


def _plan(point: Point) -> dict[str, Any]:
    from zsim.plan.advice import describe
    from zsim.plan.planner import Objective, plan

    model, topo, device = _context(point)
    flags = dict(point.settings)
    require("global_batch" in flags, "layouts.global_batch", None, "a global batch (plan mode)")
    if "seq_len" in flags:
        from zsim.workload.model_presets import with_overrides

        model = with_overrides(model, seq_len=int(flags["seq_len"]))
    objective = flags.get("objective", "throughput")
    allowed = ", ".join(o.value for o in Objective)
    require(objective in [o.value for o in Objective], "layouts.objective", objective, allowed)
    result = plan(model, topo, device, int(flags["global_batch"]), Objective(objective), 1)
    if not result.ranked:
        return {"status": "nothing fits", "gpus": topo.world_size}
    best = result.ranked[0]
    report = best.report
    out = _results(report, topo.world_size, best.cfg) if report else {"status": "ok"}
    return out | {"layout": describe(best.cfg)}


def _results(report: Any, gpus: int, cfg: Any) -> dict[str, Any]:
    return {
        "status": "ok" if report.fits else "does not fit",
        "gpus": gpus,
        "dp": cfg.dp,
        "step_s": round(report.step_time_s, 6),
        "tokens_per_s": round(report.tokens_per_s, 1),
        "tokens_per_s_per_gpu": round(report.tokens_per_s / gpus, 2),
        "model_tflops_per_gpu": round(report.model_tflops_per_gpu, 2),
        "mfu": round(report.mfu, 4),
        "memory_gb": round(report.memory.device_total / 1e9, 2),
        "exposed_comm_s": round(report.exposed_comm_s, 6),
    }


def fieldnames(rows: Sequence[Mapping[str, Any]], first: Sequence[str] = ()) -> list[str]:
    """Every column of `rows`, in first-seen order after `first`."""
    names = list(first)
    for r in rows:
        names += [k for k in r if k not in names]
    return names
