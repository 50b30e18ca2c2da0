"""Running real DeepSpeed training for each validation case and collecting what was measured.

A case is one ZeRO stage of one model on one cluster. Locally it is one torchrun; on an emulated
cluster (`emulate.EmulatedCluster`) it is one torchrun per node namespace, joined by a static
rendezvous on node 0's address. Every process is started tagged (`procs`), so whatever happens
(a rank raises, runs out of memory, a launcher dies, the case times out, Ctrl-C) the case ends
with nothing of it left running, and the next case still runs. A case that fails is reported
with its status and the reason; it never stops the others.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

from zsim.calibrate import speed
from zsim.errors import positive_int, require
from zsim.testbed import procs, torchrun
from zsim.testbed.emulate import NODE_DEV, EmulatedCluster, LinkEmulation
from zsim.testbed.emulation_plan import EmulationPlan, emulated
from zsim.validate.phase_split import measured_phases, median_over_launches
from zsim.workload.ds_config import to_training_ds_config
from zsim.workload.model import ModelKind, ModelSpec
from zsim.workload.parallel import DpEngine, ParallelConfig, Precision

WORKER = ("-m", "zsim.validate.train_worker")
# node 0's namespace is this run's own: nothing else listens there
_EMULATED_PORTS = iter(range(29500, 60000))
Progress = Callable[[str], None]


class Status(StrEnum):
    OK = "ok"
    FAILED = "failed"  # a rank raised, or a launcher exited non-zero
    OOM = "oom"  # a rank ran out of memory
    TIMEOUT = "timeout"  # the case ran past its time limit and was stopped
    LAUNCH_ERROR = "launch_error"  # the processes could not be started


@dataclass(frozen=True)
class Case:
    """One real run: a model, a layout (dp = every rank), a cluster shape, how long to measure."""

    name: str
    model: ModelSpec
    parallel: ParallelConfig
    topology: str  # the cluster the run really ran on (emulated: its scaled name), for predict
    nodes: int = 1
    ranks_per_node: int = 2
    device: str = "cpu"
    steps: int = 5
    warmup: int = 2
    timeout_s: float = 600.0
    launches: int = 1  # separate launches; the step time is the median of their medians

    def __post_init__(self) -> None:
        positive_int("launches", self.launches)
        positive_int("nodes", self.nodes)
        positive_int("ranks_per_node", self.ranks_per_node)
        positive_int("steps", self.steps)
        require(self.warmup >= 0, "warmup", self.warmup, "0 or more warm-up steps")
        require(self.device in ("cpu", "cuda"), "device", self.device, "cpu or cuda")
        require(
            self.parallel.world_size == self.world,
            "dp",
            self.parallel.dp,
            f"dp x tp x pp = the {self.world} ranks of {self.nodes} x {self.ranks_per_node}",
        )
        reason = unsupported_layout(self.model, self.parallel)
        require(not reason, "tp/pp", (self.parallel.tp, self.parallel.pp), reason)

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node


@dataclass(frozen=True)
class Measurement:
    """What the real run gave; the numbers are None unless `status` is OK."""

    case: Case
    status: Status
    detail: str = ""
    step_time_s: float | None = None
    step_times_s: tuple[float, ...] = ()
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    held_bytes: dict[str, int] | None = None  # engine-held tensors, peak of each category
    held_peak_total_bytes: int | None = None  # the largest snapshot's total
    activations_bytes: int | None = None  # saved for backward, one micro-batch
    peak_rss_bytes: int | None = None  # the largest rank's
    max_memory_allocated_bytes: int | None = None  # GPU only
    wall_s: float = 0.0
    raw: dict[str, Any] | None = None
    phases: dict[str, float] | None = None  # rank 0's phases (`phase_split.measured_phases`)
    # bytes per timed step every node's interface received and sent, summed (emulated nodes)
    nic_bytes_per_step: float | None = None
    drifted: bool = False  # launched while the machine was off its calibration's speed


def unsupported_layout(model: ModelSpec, cfg: ParallelConfig) -> str:
    """What validation's workers cannot train in this layout ("" when they can): Megatron-style
    TP of a transformer (`tp_layers`), DeepSpeed's PipelineEngine of the seeds' Linear stack
    (ParallelConfig already keeps it to ZeRO 0-1), not both at once."""
    tp, pp = cfg.tp, cfg.pp
    if cfg.dp_engine is DpEngine.MEGATRON:
        return "dp_engine deepspeed or fsdp: the workers do not run Megatron-Core's DDP"
    if cfg.dp_engine is DpEngine.FSDP and tp > 1:
        return "tp 1 with FSDP: the workers run FSDP data parallel only"
    if tp > 1 and pp > 1:
        return "tp 1 or pp 1: the workers run TP or a pipeline, not both"
    if tp > 1 and model.kind is not ModelKind.TRANSFORMER:
        return "tp 1 for this model: the workers split only transformers by Megatron's rules"
    if tp > 1 and cfg.sequence_parallel:
        return "no sequence parallelism: the workers' TP layers do not split the sequence"
    if pp > 1 and model.kind is not ModelKind.MLP:
        return "pp 1 for this model: the workers pipeline only the seeds' Linear stack (toy-mlp)"
    return ""


def ds_config(cfg: ParallelConfig) -> dict[str, Any]:
    """The DeepSpeed config a case trains with (`to_training_ds_config`)."""
    return to_training_ds_config(cfg)


def worker_input(case: Case, collective_timeout_s: float) -> dict[str, Any]:
    """What the worker reads: the model's fields, the DeepSpeed config, the schedule."""
    return {
        "name": case.name,
        "model": asdict(case.model),
        "ds_config": ds_config(case.parallel),
        "tp": case.parallel.tp,
        "pp": case.parallel.pp,
        "fsdp": _fsdp(case.parallel),
        "steps": case.steps,
        "warmup": case.warmup,
        "device": case.device,
        "collective_timeout_s": collective_timeout_s,
    }


def _fsdp(cfg: ParallelConfig) -> dict[str, Any] | None:
    """How the worker wraps the model in FSDP2, or None for DeepSpeed's engine."""
    if cfg.dp_engine is not DpEngine.FSDP:
        return None
    return {"sharding": str(cfg.fsdp_sharding), "shard_size": cfg.shard_ranks}


def _env(case: Case, ifname: str, tmp: Path) -> dict[str, str]:
    threads = max(1, (os.cpu_count() or 1) // case.world)
    allocator = procs.CPU_ALLOCATOR_ENV if case.device == "cpu" else {}
    return (
        dict(os.environ)
        | allocator
        | {
            "DS_ACCELERATOR": case.device,
            "OMP_NUM_THREADS": str(threads),
            "GLOO_SOCKET_IFNAME": ifname,
            "PYTHONUNBUFFERED": "1",
            "TMPDIR": str(tmp),
            "PYTHONWARNINGS": "ignore::FutureWarning",
        }
    )


def run_case(
    case: Case,
    out_dir: Path,
    cluster: EmulatedCluster | None = None,
    worker: Sequence[str] = WORKER,
    progress: Progress | None = None,
) -> Measurement:
    """Run one case for real; never raises for a failure of the run itself."""
    require(
        cluster is not None or case.nodes == 1,
        "topology",
        f"{case.nodes} nodes",
        "one node, or --emulate to emulate several on this machine",
    )
    run_dir = out_dir / "runs" / case.name
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    case_file = run_dir / "case.json"
    case_file.write_text(json.dumps(worker_input(case, case.timeout_s), indent=1))
    logs = [run_dir / f"node{node}.log" for node in range(case.nodes)]
    program = (*worker, str(case_file), str(run_dir))
    master = "127.0.0.1" if cluster is None else cluster.address(0)
    port = 0 if cluster is None else next(_EMULATED_PORTS)
    job = torchrun.Torchrun(program, case.nodes, case.ranks_per_node, master, port)
    begin = time.monotonic()
    tick = None if progress is None else (lambda: progress(case.name))
    with tempfile.TemporaryDirectory(prefix="zsim-validate-") as tmp:
        env = _env(case, "lo" if cluster is None else NODE_DEV, Path(tmp))
        try:
            ended = torchrun.run(
                job,
                env,
                logs,
                node_ranks=range(case.nodes),
                cluster=cluster,
                timeout_s=case.timeout_s,
                on_tick=tick,
            )
            status, detail = _status(ended, case.timeout_s)
        except OSError as exc:
            status, detail = Status.LAUNCH_ERROR, f"{type(exc).__name__}: {exc}"
    return collect(case, run_dir, status, detail, time.monotonic() - begin)


def _status(ended: torchrun.Ended, timeout_s: float) -> tuple[Status, str]:
    failure = ended.failure
    if failure is not None:
        return Status.FAILED, f"launcher on node {failure[0]} exited with {failure[1]}"
    if ended.timed_out:
        return Status.TIMEOUT, f"stopped after {timeout_s:.0f} s"
    return Status.OK, ""


def collect(case: Case, run_dir: Path, status: Status, detail: str, wall_s: float) -> Measurement:
    """The result rank 0 wrote, or the reason there is none."""
    ranks = _rank_records(run_dir)
    errors = [r for r in ranks if not r.get("ok", False)]
    if errors:
        first = min(errors, key=lambda r: int(r.get("rank", 0)))
        oom = any(r.get("oom") for r in errors)
        status = Status.OOM if oom else (status if status is not Status.OK else Status.FAILED)
        detail = f"rank {first.get('rank')}: {first.get('error', '?')}".splitlines()[0][:300]
    result_file = run_dir / "result.json"
    if status is Status.FAILED and ranks and not errors and result_file.exists():
        # every rank finished and reported: a crash on the way out loses nothing measured
        status, detail = Status.OK, f"{detail} after every rank had written its results"
    if status is Status.OK and not result_file.exists():
        status, detail = Status.FAILED, "no result.json from rank 0"
    if status is not Status.OK:
        if not detail or detail.startswith("launcher"):
            tail = torchrun.log_tail(sorted(run_dir.glob("node*.log")))
            text = " | ".join(t.strip()[:200] for t in tail) or "no output"
            detail = (detail + "; " if detail else "") + text
        if status is Status.FAILED and not errors and _killed(run_dir):
            detail = "a rank was killed by SIGKILL (the kernel's OOM killer?); " + detail
        return Measurement(case, status, detail, wall_s=wall_s)
    raw = json.loads(result_file.read_text())
    held = raw["memory_rank0"]["held"]
    return Measurement(
        case,
        Status.OK,
        detail,
        step_time_s=float(raw["step_time_s"]),
        step_times_s=tuple(raw["step_times_s"]),
        samples_per_s=float(raw["samples_per_s"]),
        tokens_per_s=float(raw["tokens_per_s"]),
        held_bytes={k: int(v) for k, v in held["category_max"].items()},
        held_peak_total_bytes=int(sum(held["at_peak"].values())),
        activations_bytes=int(raw["memory_rank0"]["activations_bytes"]),
        peak_rss_bytes=max(raw["peak_rss_bytes"]),
        max_memory_allocated_bytes=_max_or_none(raw["max_memory_allocated_bytes"]),
        wall_s=wall_s,
        raw=raw,
        phases=measured_phases(raw.get("phases_per_rank", [])) or None,
        nic_bytes_per_step=_nic_total(raw.get("nic_bytes_per_step")),
    )


def _nic_total(counted: dict[str, float] | None) -> float | None:
    return None if counted is None else float(counted["rx"] + counted["tx"])


def _max_or_none(values: Sequence[int | None]) -> int | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def _rank_records(run_dir: Path) -> list[dict[str, Any]]:
    records = []
    for path in sorted(run_dir.glob("rank*.json")):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    return records


def _killed(run_dir: Path) -> bool:
    """torchrun reports a worker that died of SIGKILL (what the OOM killer sends)."""
    return any("SIGKILL" in log.read_text(errors="replace") for log in run_dir.glob("node*.log"))


def default_precision(device: str) -> Precision:
    """fp32 on CPU (DeepSpeed's fused 16-bit paths are GPU kernels), fp16 on GPU."""
    return Precision.FP32 if device == "cpu" else Precision.FP16


def run_all(
    cases: Sequence[Case],
    out_dir: Path,
    emulation: EmulationPlan | None = None,
    worker: Sequence[str] = WORKER,
    progress: Callable[[str, Measurement | None], None] | None = None,
    reference: speed.Probe | None = None,
) -> tuple[list[Measurement], LinkEmulation | None]:
    """Every case in turn (one emulated cluster for all of them); the link as applied and
    measured. `reference`: the machine's speed when the profile was calibrated."""
    with procs.terminate_raises(), emulated(emulation) as cluster:
        if cluster is not None and cluster.nodes > 1:
            if progress is not None:
                progress("measuring the emulated link", None)
            cluster.measure_rate_bps(0, 1, nbytes=_probe_bytes(cluster.applied_rate_bps))
        measured = _in_rounds(cases, out_dir, cluster, worker, progress, reference)
        return measured, None if cluster is None else cluster.emulation


def _probe_bytes(rate_bps: float) -> int:
    """About two seconds of traffic, at least 2 MB."""
    return int(max(2e6, min(2 * rate_bps, 200e6)))


def _in_rounds(
    cases: Sequence[Case],
    out_dir: Path,
    cluster: EmulatedCluster | None,
    worker: Sequence[str],
    progress: Callable[[str, Measurement | None], None] | None,
    reference: speed.Probe | None,
) -> list[Measurement]:
    """Each case's launches, in rounds (launch 0 of every case, then launch 1, ...), so that a
    slow spell of a shared host falls on one launch of several cases rather than on all of
    one's; on CPU ranks each round is probed against `reference` first (`speed.settled_round`:
    one that starts off it is marked drifted). A case that fails is not launched again."""

    def tick(name: str) -> None:
        if progress is not None:
            progress(name, None)

    runs: list[list[Measurement]] = [[] for _ in cases]
    rounds = max((c.launches for c in cases), default=0)
    ranks = max((c.nodes * c.ranks_per_node for c in cases), default=1)
    for launch in range(rounds):
        settled = True
        if rounds > 1 and all(c.device == "cpu" for c in cases):  # the machine's drift
            tick(f"probing the machine's speed before round {launch + 1}")
            settled = speed.settled_round(out_dir, launch, ranks, reference)
        for case, done in zip(cases, runs, strict=True):
            if launch >= case.launches or (done and done[-1].status is not Status.OK):
                continue
            folder = out_dir / f"launch{launch}" if case.launches > 1 else out_dir
            done.append(replace(run_case(case, folder, cluster, worker, tick), drifted=not settled))
            if progress is not None and len(done) == case.launches:
                progress(case.name, combine_launches(done))
    measured = [combine_launches(done) for done in runs]
    if progress is not None:
        for case, done, m in zip(cases, runs, measured, strict=True):
            if len(done) < case.launches:  # stopped early by a failure
                progress(case.name, m)
    return measured


def combine_launches(launched: Sequence[Measurement]) -> Measurement:
    """One measurement from separate launches of a case: the median of their step medians
    (a launch's process placement on a small shared host shifts all of its steps together),
    over the launches that were not drifted where there are any (`speed`'s rule). The first
    failure, if any, stands for the case."""
    failed = next((r for r in launched if r.status is not Status.OK), None)
    if failed is not None or len(launched) == 1:
        return failed or launched[0]
    runs = [r for r in launched if not r.drifted] or list(launched)
    medians = [r.step_time_s for r in runs if r.step_time_s is not None]
    step = float(statistics.median(medians))
    first = runs[0]
    left = len(launched) - len(runs)
    why = f" ({left} launched off the calibration's speed left out)" if left else ""
    why = " (all launched off the calibration's speed)" if runs[0].drifted else why
    scale = first.step_time_s / step if first.step_time_s else 1.0
    return replace(
        first,
        step_time_s=step,
        step_times_s=tuple(t for r in runs for t in r.step_times_s),
        samples_per_s=(first.samples_per_s or 0.0) * scale,
        tokens_per_s=(first.tokens_per_s or 0.0) * scale,
        detail=f"median of {len(runs)} launches: "
        + ", ".join(f"{m * 1e3:.1f}" for m in medians)
        + " ms"
        + why,
        wall_s=sum(r.wall_s for r in launched),
        phases=median_over_launches([r.phases for r in runs if r.phases]) or None,
        nic_bytes_per_step=_median_or_none([r.nic_bytes_per_step for r in runs]),
    )


def _median_or_none(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return float(statistics.median(present)) if present else None
