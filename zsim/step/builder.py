"""The program of one training step on one pipeline rank, with DeepSpeed's and Megatron's
semantics: the parts of the step, each a module of its own, put together in issue order.

- `pipeline`: the order of forwards and backwards, and the sends between stages;
- `kernels` (with `tensor_parallel`): each layer's compute, split at Megatron's TP collectives;
- `zero3`: the parameter gathers of DeepSpeed's ZeRO-3 coordinator, before a module's use;
- `zero_reduce`: the gradient reductions of ZeRO stages 0-3, in the hooks or at the boundary;
- `megatron_dp`, `fsdp`: Megatron-Core's and PyTorch FSDP's instead of DeepSpeed's;
- `optimizer`: the gradient norm, the Adam step (or offloaded), the post-step gathers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from zsim.cluster.device import DeviceProfile
from zsim.network.collective import CollectiveOp
from zsim.step.fsdp import FsdpReduce, FsdpUnshard
from zsim.step.job import StageJob
from zsim.step.kernels import Ended, LayerKernels
from zsim.step.megatron_dp import MegatronGradSync, MegatronParamSync
from zsim.step.optimizer import grad_norm, optimizer_step, post_step_gather
from zsim.step.pipeline import (
    Work,
    accumulates_in_fp32,
    accumulates_in_grad,
    deepspeed_schedule,
    megatron_schedule,
    tied_embedding_reduce,
)
from zsim.step.program import Category, Comm, Group, Program, ProgramWriter, Task
from zsim.step.zero3 import ParameterGathers
from zsim.step.zero_reduce import GradientReducer, ParameterHooks, Reducer
from zsim.workload.fp8 import AMAX_KERNELS, amax_bytes
from zsim.workload.mechanisms import Mechanism
from zsim.workload.model import ComputeOp, Layer, ModelSpec
from zsim.workload.parallel import DpEngine, ParallelConfig, PipelineEngine, Precision, ZeroStage

ENGINE_STEP_HOST = "engine_step_host"


class Gathers(Protocol):
    """Parameter gathers of a sharded engine: DeepSpeed's per submodule use, FSDP's per unit."""

    def start(self, layers: Sequence[Layer]) -> None: ...
    def enter(self, layer: Layer, forward: bool, last: list[Task], tag: str) -> list[Task]: ...
    def use(self, layer: Layer, op: ComputeOp, last: list[Task], tag: str) -> list[Task]: ...


class _Passes:
    """One forward or backward of one model chunk, with ZeRO's hooks and gathers inside."""

    def __init__(
        self, job: StageJob, writer: ProgramWriter, tp_time: Callable[[Comm], float] | None
    ) -> None:
        self.job = job
        self.writer = writer
        self.kernels = LayerKernels(job, tp_time)
        engine = job.cfg.dp_engine
        reducers: dict[DpEngine, Callable[[StageJob, ProgramWriter], Reducer]] = {
            DpEngine.MEGATRON: MegatronGradSync,
            DpEngine.FSDP: FsdpReduce,
        }
        self.reducer = reducers.get(engine, GradientReducer)(job, writer)
        fsdp = engine is DpEngine.FSDP
        self.gathers: Gathers = FsdpUnshard(job, writer) if fsdp else ParameterGathers(job, writer)
        self.param_sync = MegatronParamSync(job, writer)
        self.host = self.gathers.host if isinstance(self.gathers, ParameterGathers) else None
        if isinstance(self.reducer, GradientReducer):
            self.reducer.host = self.host  # one host thread walks for both
        self._previous: list[Task] = []  # the last work's end (ZeRO-3: one stage, in order)
        self._host_s = {f: job.engine_host_s("forward" if f else "backward") for f in (True, False)}
        self._reversed = [tuple(reversed(chunk)) for chunk in job.chunks]  # backward order

    def run(self, work: Work, deps: list[Task], tag: str) -> Task:
        cfg, writer = self.job.cfg, self.writer
        layers = self.job.chunks[work.chunk]
        zero3 = cfg.zero_stage is ZeroStage.PARAMETERS
        if work.forward and zero3:
            self.gathers.start(layers)  # ZeRO-3 runs without pipelining: F then B per micro-step
        if zero3:  # the host issues a micro-step's gathers after the last backward returned
            deps = [*deps, *self._previous]
            if self.job.gloo:  # ... and on gloo that backward returned after its reductions
                deps = [*deps, *self.reducer.pending()]
            if self.host is not None:
                self.host.sync(deps)
        host = self._host_s[work.forward]
        if host > 0:  # the engine's own Python before the pass's first kernel (CPU ranks)
            category = Category.FORWARD if work.forward else Category.BACKWARD
            deps = [writer.compute(f"{tag}.engine_host", host, category, deps)]
        boundary = work.micro_batch == cfg.grad_accum - 1
        hooks = not work.forward and self.reducer.start_backward(boundary)
        accumulating = not work.forward and accumulates_in_grad(cfg, work.micro_batch)
        order = layers if work.forward else self._reversed[work.chunk]
        done = deps
        # the first forward waits for the distributed optimizer's overlapped gathers
        synced = work.forward and work.micro_batch == 0 and self.param_sync.active
        if self.kernels.can_fuse and not hooks and not zero3 and not synced:
            fused = self.kernels.fused_pass
            done = [fused(writer, work.chunk, order, work.forward, done, tag, accumulating)]
        else:
            for layer in order:
                if synced:
                    done = [*done, *self.param_sync.wait(layer, done)]
                done = [
                    self._layer(
                        layer, work.forward, done, f"{tag}.{layer.name}", hooks, accumulating
                    )
                ]
        done = self._amax_reduce(layers, work.forward, done, tag)
        if hooks:
            self.reducer.flush()  # the backward epilogue reduces what is left in the bucket
            done = self._epilogue(done, tag)
        if not work.forward:
            done = self._accumulate(layers, accumulating, done)
        self._previous = done
        return done[0]

    def _layer(
        self, layer: Layer, forward: bool, done: list[Task], tag: str, hooks: bool, adds: bool
    ) -> Task:
        """One layer's pass, its gathers waited for and (`hooks`) its gradients reduced as its
        backward produces them, per submodule with DeepSpeed's (`adds`: into `.grad`)."""
        done = [*done, *self.gathers.enter(layer, forward, done, tag)]

        def gather(op: ComputeOp, last: list[Task], ended: Ended) -> list[Task]:  # noqa: ARG001
            return self.gathers.use(layer, op, last, tag)

        grads = None  # DeepSpeed's and Megatron-Core's hooks are per parameter, FSDP's per unit
        if hooks and isinstance(self.reducer, GradientReducer | MegatronGradSync):
            grads = ParameterHooks(self.reducer, layer, gather)
        task = self.kernels.layer_pass(self.writer, layer, forward, done, tag, gather, adds, grads)
        if hooks:
            task = self.reducer.grads_ready(grads.rest() if grads else layer, task) or task
        return task

    def _epilogue(self, done: list[Task], tag: str) -> list[Task]:
        """What a backward with reduction hooks waits for before the host goes on."""
        cfg, writer = self.job.cfg, self.writer
        if cfg.dp_engine is DpEngine.MEGATRON and cfg.pp > 1 and cfg.models(Mechanism.SEND_QUEUE):
            # the chunk's send, issued once its backward returned, waits for what its hooks
            # queued on the compute stream (the buckets' grad scaling): PyTorch's NCCL stream
            # waits on the current stream when a call is issued
            return [writer.compute(f"{tag}.queued", 0.0, Category.BACKWARD, done)]
        if (
            cfg.overlap_comm
            and cfg.pp == 1
            and not self.job.gloo
            and cfg.models(Mechanism.EPILOGUE_WAIT)
            and cfg.dp_engine is DpEngine.DEEPSPEED  # Megatron waits at finish_grad_sync
        ):
            # ... and DeepSpeed's engine waits for every reduction before the host issues more
            # (stage3.py `independent_gradient_partition_epilogue`: the reduction stream's
            # synchronize(); stage_1_and_2.py: synchronize() with overlap_comm). Pipelines
            # reduce after their schedule (DeepSpeed) or wait once at its end (Megatron).
            waits = [*done, *self.reducer.pending()]
            return [writer.compute("backward_epilogue_sync", 0.0, Category.BACKWARD, waits)]
        return done

    def _amax_reduce(
        self, layers: Sequence[Layer], forward: bool, done: list[Task], tag: str
    ) -> list[Task]:
        """TransformerEngine's delayed scaling at the end of the chunk's FP8 region: its amaxes
        concatenated, all-reduced over the stage's ranks (blocking the compute stream), and
        the scales updated (`workload.fp8.amax_bytes`)."""
        job, writer = self.job, self.writer
        if job.cfg.precision is not Precision.FP8 or not job.cfg.models(Mechanism.FP8_AMAX):
            return done
        nbytes, category = amax_bytes(layers, forward), Category.FP8_AMAX
        if not nbytes:  # a chunk without blocks (an embedding or head alone) has no region
            return done
        if job.cfg.dp_cp * job.cfg.tp > 1:  # TE skips a one-rank group's reduction
            comm = Comm(CollectiveOp.ALL_REDUCE, nbytes, Group.STAGE)
            done = [writer.comm(f"{tag}.amax_reduce", comm, category, done)]
        seconds = AMAX_KERNELS * job.device.copy_time_s(nbytes, job.dtype)
        return [writer.compute(f"{tag}.amax_update", seconds, category, done)]

    def _accumulate(
        self, layers: Sequence[Layer], accumulating: bool, done: list[Task]
    ) -> list[Task]:
        """A backward's gradients added to the earlier micro-batches' outside its layers."""
        job, writer = self.job, self.writer
        if accumulates_in_fp32(job.cfg):
            return [writer.memory_pass("fp32_grad_accumulate", 5.0 * job.params(), done)]
        if not accumulating:
            return done
        # layers timed adding into .grad did so inside their backward; the rest add here
        added = sum(x.params(job.cfg.tp) for x in layers if not self.kernels.accumulates_in_pass(x))
        if not added:
            return done
        nbytes = 1.5 * job.element_bytes * added  # read two tensors, write one: 1.5 copies
        return [writer.memory_pass("grad_accumulate", nbytes, done)]


def build_program(
    model: ModelSpec,
    cfg: ParallelConfig,
    device: DeviceProfile,
    stage: int,
    gloo: bool = False,
    tp_time: Callable[[Comm], float] | None = None,
    node_gpus: int = 1,
) -> Program:
    """The program of every rank of pipeline stage `stage` (they are identical).

    `gloo`: the CPU backend, where DeepSpeed's streams are no-ops and its calls block.
    `tp_time`: when tensor-parallel collectives take a fixed time (their links carry nothing
    else), passes without other communication are fused into one task each.
    `node_gpus`: the GPUs of a node (ZeRO++'s qgZ groups by them).
    """
    job = StageJob.of(model, cfg, device, stage, gloo, node_gpus)
    writer = ProgramWriter(stage, device, job.dtype, gloo)
    passes = _Passes(job, writer, tp_time)
    if cfg.pp > 1 and cfg.pipeline_engine is PipelineEngine.DEEPSPEED:
        ready = deepspeed_schedule(job, writer, passes.run, tp_time)
    else:
        ready = megatron_schedule(job, writer, passes.run)
    deps = [t for k, t in ready.items() if k.startswith("B")]
    deps += passes.reducer.pending()
    deps = tied_embedding_reduce(job, writer, deps)
    deps = passes.reducer.boundary_reduce(deps)
    step_host = job.engine_host_s("step")
    if step_host > 0:  # engine.step's own Python before the optimizer's first task (CPU ranks)
        deps = [writer.compute(ENGINE_STEP_HOST, step_host, Category.OPTIMIZER, deps)]
    deps = grad_norm(job, writer, deps)
    deps = optimizer_step(job, writer, deps)
    if cfg.dp_engine is DpEngine.MEGATRON:
        passes.param_sync.after_step(deps)
    elif cfg.dp_engine is DpEngine.DEEPSPEED:  # FSDP's next forward gathers the new shards
        post_step_gather(job, writer, deps)
    return writer.program


def iter_comm(program: Program) -> Iterator[Task]:
    return (t for t in program.tasks if t.comm is not None)
