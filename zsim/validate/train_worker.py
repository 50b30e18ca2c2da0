"""One rank of a real DeepSpeed training run, measured (run under torchrun by the runner).

    python -m torch.distributed.run --nproc_per_node N -m zsim.validate.train_worker CASE OUT

CASE is the JSON the runner writes (`runner.worker_input`): the model's fields, the DeepSpeed
config, steps, warm-up steps, device. Each rank writes OUT/rank<r>.json; rank 0 also writes
OUT/result.json with what all ranks measured:

- step time: a barrier, then the wall time of one optimizer step (grad_accum micro-batches,
  forward, backward, engine.step; synchronised on GPU) on each rank; a step takes as long as its
  slowest rank; the result is the median over the steps after the warm-up.
- memory, on one more step that is not timed: GPU `max_memory_allocated`; the tensors the
  engine holds by category at several points of the step (`held.engine_inventory`), the peak of
  each; the activations autograd saved for backward of one micro-batch; peak RSS.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import resource
import statistics
import sys
import time
import traceback
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any

import deepspeed  # the runner sets DS_ACCELERATOR (cpu or cuda) before this is imported
import torch
from deepspeed import comm as dist
from deepspeed.comm import comm as ds_comm

from zsim.testbed import nic, torchmodels
from zsim.testbed.fsdp_engine import FsdpEngine
from zsim.testbed.phase_clock import PhaseClock, median_phases
from zsim.validate.held import CATEGORIES, SavedTensors, engine_inventory, fsdp_in_flight
from zsim.validate.layouts import Trainer
from zsim.workload.model import ModelKind, ModelSpec


def model_from(fields: dict[str, Any]) -> ModelSpec:
    return ModelSpec(**(fields | {"kind": ModelKind(fields["kind"])}))


class MemoryProbe:
    """Snapshots of the engine's tensors at the points where its holdings peak."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.active = False
        self.snapshots: dict[str, dict[str, int]] = {}
        self.category_max: dict[str, int] = {}
        self.largest: dict[str, list[dict[str, Any]]] = {}
        if isinstance(engine, FsdpEngine):
            self._snap_inside_fsdp()
        else:
            self._snap_inside_zero()
        if getattr(engine, "basic_optimizer", None) is not None:
            engine.basic_optimizer.register_step_pre_hook(lambda *_: self.snap("optimizer_pre"))
            engine.basic_optimizer.register_step_post_hook(lambda *_: self.snap("optimizer_post"))

    def _snap_inside_zero(self) -> None:
        """ZeRO's end of backward, where the last reduce bucket is still full; for stage 1,
        also before `reduce_gradients`, while every full gradient is still held."""
        opt = self.engine.optimizer
        for method, label in (
            ("independent_gradient_partition_epilogue", "backward_end"),
            ("reduce_gradients", "before_reduce"),
        ):
            original = getattr(opt, method, None)
            if original is not None:
                setattr(opt, method, self._snapping(original, label))

    def _snap_inside_fsdp(self) -> None:
        """FSDP2's backward (torch 2.13 `_fsdp_param_group`): each unit's post-backward as it
        starts (its unsharded gradients all computed, the next unit prefetched, the earlier
        unit's reduce-scatter input still kept) and as its `foreach_reduce` returns (the unit
        resharded, its unsharded gradients and their fp32 reduce-scatter input alive):
        buffers no hook outside FSDP reaches (`held.fsdp_in_flight`)."""
        fsdp_group: Any = importlib.import_module(
            "torch.distributed.fsdp._fully_shard._fsdp_param_group"
        )

        post_backward = fsdp_group.FSDPParamGroup.post_backward

        def entered(group: Any, *args: Any, **kwargs: Any) -> Any:
            self.snap("post_backward", fsdp_in_flight(self.engine))
            return post_backward(group, *args, **kwargs)

        foreach_reduce = fsdp_group.foreach_reduce

        def reduced(params: Any, grads: list[Any], *args: Any, **kwargs: Any) -> Any:
            out = foreach_reduce(params, grads, *args, **kwargs)
            extra = [(g, "fsdp.unsharded_grad") for g in grads] + fsdp_in_flight(self.engine)
            self.snap("reduce_scatter", [*extra, (out[0], "fsdp.reduce_scatter_input")])
            return out

        fsdp_group.FSDPParamGroup.post_backward = entered  # this worker process only
        fsdp_group.foreach_reduce = reduced

    def _snapping(self, original: Any, label: str) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            self.snap(label)
            return original(*args, **kwargs)

        return wrapped

    def snap(self, label: str, extra: list[tuple[Any, str]] | None = None) -> None:
        """The engine's holdings now, with `extra` (tensor, name) pairs it does not reach;
        a label taken more than once keeps its largest total; each category's largest is
        kept over every snapshot."""
        if not self.active:
            return
        inv = engine_inventory(self.engine)
        for tensor, name in extra or []:
            inv.walk(tensor, name)
        totals = inv.by_category()
        for category, held in totals.items():
            self.category_max[category] = max(self.category_max.get(category, 0), held)
        if sum(totals.values()) < sum(self.snapshots.get(label, {}).values()):
            return
        self.snapshots[label] = totals
        self.largest[label] = inv.largest()

    def peak(self) -> dict[str, Any]:
        totals = {k: sum(v.values()) for k, v in self.snapshots.items()}
        at = max(totals, key=lambda k: totals[k])
        return {
            "peak_at": at,
            "at_peak": self.snapshots[at],
            "category_max": {c: self.category_max.get(c, 0) for c in CATEGORIES},
            "snapshots": self.snapshots,
            "largest_at_peak": self.largest[at],
        }


def one_step(
    trainer: Trainer, probe: MemoryProbe, clock: PhaseClock, saved: SavedTensors | None = None
) -> None:
    """One optimizer step: `gradient_accumulation_steps` forwards and backwards, then the
    engine's step (a pipeline's train_batch does all of it); `saved` records what autograd
    keeps for backward (of the first micro-batch; of all of them in a pipeline)."""
    engine = trainer.engine
    if trainer.pipelined:
        with saved or contextlib.nullcontext():
            engine.train_batch(trainer.data())
        probe.snap("step_end")
        return
    x, y = trainer.batch
    for micro_step in range(int(engine.gradient_accumulation_steps())):
        with clock.phase("forward"):
            if saved is not None and micro_step == 0:
                with saved:
                    loss = engine(x, y)
                    probe.snap("forward_end")
            else:
                loss = engine(x, y)
        with clock.phase("backward"):
            engine.backward(loss)
        with clock.phase("step"):
            engine.step()
    probe.snap("step_end")


def train(case: dict[str, Any]) -> dict[str, Any]:
    spec = model_from(case["model"])
    device = case["device"]
    layout = (case.get("tp", 1), case.get("pp", 1), case.get("seed", 1234))
    trainer = Trainer(spec, case["ds_config"], layout, case.get("fsdp"))
    engine, dtype = trainer.engine, trainer.dtype
    probe = MemoryProbe(engine)
    clock = PhaseClock()
    # on CUDA wall clocks around kernels and collectives mean nothing
    if device == "cpu":
        if trainer.pipelined:
            clock.instrument_pipeline(engine)
        clock.instrument(ds_comm.cdb)
        # the TP layers call torch.distributed as Megatron does (a DeepSpeed call through it
        # is counted once, to deepspeed.comm's op)
        clock.instrument(torch.distributed)

    def step(saved: SavedTensors | None = None) -> None:
        one_step(trainer, probe, clock, saved)

    times = []
    counter = _node_counter()
    before = None
    for i in range(case["warmup"] + case["steps"]):
        dist.barrier()
        if i == case["warmup"]:
            before = counter()
        clock.start_step()
        start = time.perf_counter()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        clock.end_step()
    dist.barrier()  # every node's last bytes of the timed steps have arrived
    after = counter()
    nic_bytes = None if before is None or after is None else after - before

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    probe.active = True
    saved = SavedTensors(engine.module)
    step(saved)
    probe.active = False
    return {
        "step_times_s": times[case["warmup"] :],
        "warmup_times_s": times[: case["warmup"]],
        "phases": clock.steps[case["warmup"] :],
        "held": probe.peak(),
        "activations_bytes": saved.total_bytes,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "max_memory_allocated_bytes": (
            torch.cuda.max_memory_allocated() if device == "cuda" else None
        ),
        "engine": _engine_kind(engine, dtype),
        "nic_bytes": None if nic_bytes is None else asdict(nic_bytes),
    }


def _node_counter() -> Any:
    """Reads this node's interface between nodes (an emulated node's veth), on the node's
    first rank only; a reader of nothing elsewhere (on loopback every rank is one node)."""
    interface = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
    if interface == "lo" or os.environ.get("LOCAL_RANK", "0") != "0":
        return lambda: None
    return lambda: nic.read(interface)


def _engine_kind(engine: Any, dtype: torch.dtype) -> dict[str, Any]:
    """Which optimizer classes the engine chose, and its dtype."""
    basic = engine.basic_optimizer
    return {
        "optimizer": type(engine.optimizer).__name__,
        "basic_optimizer": type(basic).__name__ if basic is not None else None,
        "dtype": str(dtype).removeprefix("torch."),
    }


def aggregate(case: dict[str, Any], ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """A step takes as long as its slowest rank; the median over the timed steps."""
    spec = model_from(case["model"])
    ds = case["ds_config"]
    per_step = [max(r["step_times_s"][i] for r in ranks) for i in range(case["steps"])]
    step_s = statistics.median(per_step)
    samples = int(ds["train_batch_size"])
    return {
        "ok": True,
        "world": len(ranks),
        "step_time_s": step_s,
        "step_times_s": per_step,
        "samples_per_s": samples / step_s,
        "tokens_per_s": samples * spec.seq_len / step_s,
        "memory_rank0": {k: ranks[0][k] for k in ("held", "activations_bytes")},
        "peak_rss_bytes": [r["peak_rss_bytes"] for r in ranks],
        "max_memory_allocated_bytes": [r["max_memory_allocated_bytes"] for r in ranks],
        "engine": ranks[0]["engine"],
        "phases_per_rank": [median_phases(r.get("phases", [])) for r in ranks],
        "nic_bytes_per_step": _nic_per_step(ranks, case["steps"]),
        "versions": {"torch": torch.__version__, "deepspeed": deepspeed.__version__},
        "threads": torch.get_num_threads(),
    }


def _nic_per_step(ranks: list[dict[str, Any]], steps: int) -> dict[str, float] | None:
    """Bytes every node's interface received and sent per timed step, summed over the nodes
    (None on one node)."""
    counted = [r["nic_bytes"] for r in ranks if r.get("nic_bytes") is not None]
    if not counted:
        return None
    return {k: sum(c[k] for c in counted) / steps for k in ("rx", "tx")} | {"nodes": len(counted)}


def main(argv: list[str]) -> int:
    case = json.loads(Path(argv[0]).read_text())
    out = Path(argv[1])
    backend = "nccl" if case["device"] == "cuda" else "gloo"
    if case["device"] == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torchmodels.flush_subnormals(case["device"])
    deepspeed.init_distributed(
        dist_backend=backend, timeout=timedelta(seconds=case["collective_timeout_s"])
    )
    rank = dist.get_rank()
    record: dict[str, Any] = {"rank": rank, "ok": False}
    try:
        record |= train(case) | {"ok": True}
    except BaseException as exc:
        oom = isinstance(exc, MemoryError | torch.OutOfMemoryError)
        record |= {
            "error": f"{type(exc).__name__}: {exc}"[:2000],
            "oom": oom or "out of memory" in str(exc).lower(),
            "traceback": traceback.format_exc()[-4000:],
        }
        raise
    finally:
        (out / f"rank{rank}.json").write_text(json.dumps(record, indent=1))
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, record)
    if rank == 0:
        result = aggregate(case, gathered)
        (out / "result.json").write_text(json.dumps(result, indent=1))
    dist.barrier()
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    # leave without the interpreter's teardown: there gloo's threads abort the process
    # ("terminate called without an active exception") after the results are written, even
    # after destroy_process_group (seen in 1 of 12 launches)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
