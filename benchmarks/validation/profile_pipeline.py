"""Diagnosis only: where a pipeline stage's backward spends its time, by torch.profiler.

    torchrun --nproc_per_node 2 benchmarks/validation/profile_pipeline.py CASE OUT

CASE: a validation case.json (e.g. benchmarks/validation/cpu-1x2-pp2/launch0/runs/z0-pp2/).
Each rank trains the case's PipelineEngine (the validation worker's `Trainer`) for its warm-up
steps, then profiles 3 steps and writes OUT/rank<r>.txt: the CPU ops by self time, the ops
inside DeepSpeed's BackwardPass instruction alone (`record_function` around it) and their
call counts. Nothing here feeds a profile or a default: what it finds is then measured by a
microbenchmark.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed
from deepspeed import comm as dist
from torch.profiler import ProfilerActivity, profile, record_function

from zsim.validate.layouts import Trainer
from zsim.validate.train_worker import model_from

PROFILED_STEPS = 3


def _labelled(engine: Any) -> None:
    """Each instruction of DeepSpeed's TrainSchedule under its own label (the instance's
    own instruction map, as the worker's PhaseClock does)."""

    def labelled(run: Any, name: str) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            with record_function(f"ds::{name}"):
                return run(*args, **kwargs)

        return timed

    engine._INSTRUCTION_MAP = {
        kind: labelled(run, kind.__name__) for kind, run in type(engine)._INSTRUCTION_MAP.items()
    }


def main(argv: list[str]) -> int:
    case = json.loads(Path(argv[0]).read_text())
    out = Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    deepspeed.init_distributed(dist_backend="gloo")
    trainer = Trainer(model_from(case["model"]), case["ds_config"], (1, case["pp"], 1234))
    engine = trainer.engine
    _labelled(engine)
    for _ in range(case["warmup"]):
        engine.train_batch(trainer.data())
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(PROFILED_STEPS):
            engine.train_batch(trainer.data())
    rank = dist.get_rank()
    averages = prof.key_averages(group_by_input_shape=True)
    text = averages.table(sort_by="self_cpu_time_total", row_limit=40)
    (out / f"rank{rank}.txt").write_text(text)
    prof.export_chrome_trace(str(out / f"rank{rank}.trace.json"))
    dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
