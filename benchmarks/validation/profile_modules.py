"""Diagnosis only: each top-level module's forward and backward inside DeepSpeed's training
step, beside the calibration's own microbenchmark of the same layers, in one spell.

    torchrun --nproc_per_node 2 benchmarks/validation/profile_modules.py CASE OUT

CASE: a validation case.json without pipeline stages (e.g. benchmarks/validation/cpu-1x2-gpt/
launch0/runs/z0/case.json; with tp > 1 each rank's Megatron shard, and the TP layers'
all-reduces timed per phase). Each rank trains the case's engine (the validation worker's
`Trainer`) for 3 steps, then times 6 more with forward and full-backward hooks on the model's
top-level modules (a transformer's blocks one by one), then runs `zsim.calibrate.micro.layer`
for its blocks at the case's micro-batch in the same processes, and writes OUT/rank<r>.json. The
engine's forward and backward beyond their modules' (the loss, the tied weights' accumulation)
is what the hooks do not see; its gradient all-reduce (`engine.allreduce_gradients`, with its
copies) is timed by itself, and its flatten of the gradients into a fresh buffer against the
same copy into a kept one. It runs under the testbed's allocator settings
(`zsim.testbed.procs.CPU_ALLOCATOR_ENV`, re-executing itself with them), as calibration and
validation do: without them glibc maps every block above 32 MiB anew and the step pays page
faults a validation run does not. Nothing here feeds a profile or a default: what it finds
is then measured by a microbenchmark.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed
import torch
from deepspeed import comm as dist
from torch import nn

from zsim.calibrate import micro
from zsim.calibrate.bench import Bench
from zsim.calibrate.plan import Plan
from zsim.calibrate.speed import median_s
from zsim.testbed import tp_layers
from zsim.testbed.procs import CPU_ALLOCATOR_ENV
from zsim.testbed.torchmodels import flush_subnormals
from zsim.validate.layouts import Trainer
from zsim.validate.train_worker import model_from
from zsim.workload.model import LayerKind

WARMUP, TIMED = 3, 6


def _modules(model: nn.Module) -> dict[str, nn.Module]:
    """The top-level modules, a module list's members one by one."""
    found: dict[str, nn.Module] = {}
    for name, module in model.named_children():
        if isinstance(module, nn.ModuleList):
            found |= {f"{name}.{i}": m for i, m in enumerate(module)}
        else:
            found[name] = module
    return found


def _hooked(modules: dict[str, nn.Module]) -> dict[str, list[float]]:
    """Seconds of each module's forward (`name`) and backward (`name.backward`), per call."""
    times: dict[str, list[float]] = {}

    def start(key: str) -> Any:
        return lambda *_: times.setdefault(key, []).append(-time.perf_counter())

    def stop(key: str) -> Any:
        def done(*_: Any) -> None:
            times[key][-1] += time.perf_counter()

        return done

    for name, m in modules.items():
        m.register_forward_pre_hook(start(name))
        m.register_forward_hook(stop(name))
        m.register_full_backward_pre_hook(start(f"{name}.backward"))
        m.register_full_backward_hook(stop(f"{name}.backward"))
    return times


def _timed(engine: Any, method: str, times: dict[str, list[float]]) -> None:
    """The engine's own `method`, timed per call under `engine.<method>`."""
    run = getattr(engine, method, None)
    if run is None:
        return

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return run(*args, **kwargs)
        finally:
            times.setdefault(f"engine.{method}", []).append(time.perf_counter() - start)

    setattr(engine, method, timed)


class _CommClock:
    """Seconds inside the TP layers' all-reduces (a call, or the wait of an async one) per
    engine phase: the hooks' module times hold them, the microbenchmark's do not."""

    def __init__(self) -> None:
        self.phase = "other"
        self.seconds: dict[str, float] = {}
        self._all_reduce = torch.distributed.all_reduce
        setattr(tp_layers, "dist", self)  # noqa: B010  # the module's `dist`, not torch's
        self.ReduceOp = torch.distributed.ReduceOp

    def _add(self, start: float) -> None:
        key = f"comm.{self.phase}"
        self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - start

    def all_reduce(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        work = self._all_reduce(*args, **kwargs)
        self._add(start)
        if work is None:
            return None
        clock, wait = self, work.wait

        class _Timed:
            def wait(self) -> Any:
                begin = time.perf_counter()
                try:
                    return wait()
                finally:
                    clock._add(begin)

        return _Timed()


def _flatten_s(grads: list[torch.Tensor]) -> dict[str, float]:
    """DeepSpeed's flatten of the gradients (`allreduce_bucket`: torch.cat into a new buffer)
    against the same copy into a buffer kept from the call before: the difference is what
    first touching a fresh allocation costs (glibc maps one above its mmap threshold anew)."""
    flat = [g.reshape(-1) for g in grads]
    kept = torch.empty(sum(g.numel() for g in flat), dtype=flat[0].dtype)

    dist.barrier()
    fresh = median_s(lambda: torch.cat(flat), TIMED)
    into = median_s(lambda: torch.cat(flat, out=kept), TIMED)
    return {"flatten_fresh_s": fresh, "flatten_into_kept_s": into, "bytes": kept.nbytes}


def main(argv: list[str]) -> int:
    if any(os.environ.get(k) != v for k, v in CPU_ALLOCATOR_ENV.items()):
        # glibc reads its tunables at start-up: run again with them (torchrun's env kept)
        os.execve(sys.executable, [sys.executable, *sys.argv], os.environ | CPU_ALLOCATOR_ENV)
    case = json.loads(Path(argv[0]).read_text())
    out = Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    flush_subnormals("cpu")  # as the training worker does
    deepspeed.init_distributed(dist_backend="gloo")
    spec = model_from(case["model"])
    tp = int(case.get("tp", 1))
    trainer = Trainer(spec, case["ds_config"], (tp, 1, 1234))
    engine, (x, y) = trainer.engine, trainer.batch
    times = _hooked(_modules(engine.module))
    _timed(engine, "allreduce_gradients", times)  # ZeRO-0/1's all-reduce after the backward
    comm = _CommClock()
    phases: list[tuple[float, float, float]] = []
    for i in range(WARMUP + TIMED):
        if i == WARMUP:
            times.clear()
            phases.clear()
            comm.seconds.clear()
            dist.barrier()
        t0 = time.perf_counter()
        comm.phase = "forward"
        loss = engine(x, y)
        t1 = time.perf_counter()
        comm.phase = "backward"
        engine.backward(loss)
        t2 = time.perf_counter()
        comm.phase = "step"
        engine.step()
        phases.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
    micro_batch = int(case["ds_config"]["train_micro_batch_size_per_gpu"])
    bench = Bench(Plan(device="cpu", dtype="fp32", models=(spec,)), torch.device("cpu"))
    rows = micro.layer(bench, spec, LayerKind.BLOCK, micro_batch, tp)
    grads = [torch.ones_like(p) for p in engine.module.parameters()]  # the gradients' shapes
    result = {
        "flatten": _flatten_s(grads),
        "engine_forward_backward_step_s": [statistics.median(p) for p in zip(*phases, strict=True)],
        "inside_s": {k: statistics.median(v) for k, v in times.items()},
        "tp_comm_s_per_step": {k: v / TIMED for k, v in comm.seconds.items()},
        "microbenchmark_block_s": {str(r.kind): statistics.median(r.samples_s) for r in rows},
    }
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(result, indent=2) + "\n")
    dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
