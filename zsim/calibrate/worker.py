"""The calibration worker, one per rank, launched by torchrun: `python -m zsim.calibrate.worker
--plan PLAN.json --out RAW.json`.

Every rank runs every measurement at the same time as the others, so compute is timed under
the placement training has (ranks sharing cores slow each other). Each sample is the time of
one call (small ops: a loop of calls divided by their number), the maximum over ranks, after
warm-up. CPU samples use time.perf_counter; CUDA samples use CUDA events. Rank 0 prints
`@zsim-progress DONE TOTAL LABEL` lines for the launcher and writes the rows.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from zsim.calibrate.plan import (
    PROGRESS,
    RANKS_ON_HOST_ENV,
    Collective,
    Kind,
    Measurement,
    Plan,
    attention_ops,
    layer_kinds,
    merge,
)
from zsim.cluster.device import layer_time_key
from zsim.testbed import torchmodels
from zsim.workload.model import LayerKind, ModelKind, ModelSpec

CONTENDED = 0.9  # a CPU sample whose thread ran less than this share of its wall time
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

Task = tuple[str, Callable[[], list[Measurement]]]


class Bench:
    """Timing on one rank, with the other ranks doing the same thing at the same time."""

    def __init__(self, plan: Plan, device: torch.device) -> None:
        self.plan = plan
        self.device = device
        self.cuda = device.type == "cuda"
        self.dtype = DTYPES[plan.dtype]
        # the all-reduce that takes the max over ranks runs where the backend wants tensors
        self.comm_device = device if self.cuda else torch.device("cpu")
        self.warmup = plan.warmup  # calls before timing: all in the first round, 1 later
        # drop samples during which the rank lost its core: possible to tell on CPU when a
        # rank computes on its calling thread alone (one intra-op thread); not when the ranks
        # outnumber the cores, where sharing a core is the placement being measured
        ranks_here = int(os.environ.get(RANKS_ON_HOST_ENV, os.environ.get("LOCAL_WORLD_SIZE", "1")))
        self.filter = (
            not self.cuda
            and torch.get_num_threads() == 1
            and ranks_here <= len(os.sched_getaffinity(0))
        )
        self.share = 1.0  # thread CPU time / wall time of the last CPU sample
        self.cache_bytes = (
            torch.cuda.get_device_properties(device).L2_cache_size
            if self.cuda
            else _last_level_cache_bytes()
        )

    # ---- timing primitives --------------------------------------------------------------

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def elapsed_s(self, fn: Callable[[], Any], inner: int) -> float:
        """Seconds per call of `fn`, over `inner` back-to-back calls; on CPU, `self.share` is
        then the calling thread's CPU time over that wall time."""
        if self.cuda:
            start, end = _event(), _event()
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            return float(start.elapsed_time(end)) / 1e3 / inner
        t0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(inner):
            fn()
        wall = time.perf_counter() - t0
        self.share = (time.thread_time() - c0) / wall if wall > 0 else 1.0
        return wall / inner

    def max_over_ranks(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.comm_device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [float(f"{v:.6g}") for v in t.cpu().tolist()]  # 6 digits: the file stays small

    def sum_over_ranks(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.float64, device=self.comm_device)
        dist.all_reduce(t)
        return int(t.item())

    def clean_samples(
        self, sample: Callable[[], tuple[float, ...]], wanted: int
    ) -> tuple[list[tuple[float, ...]], int]:
        """`wanted` samples of this rank, dropping those during which the rank lost its core
        (thread CPU time < CONTENDED x wall: another process ran) when the rank computes on
        one thread, up to 4x as many tries; then the least contended of the dropped ones fill
        up. Returns the samples and how many were dropped."""
        kept: list[tuple[float, ...]] = []
        dropped: list[tuple[float, tuple[float, ...]]] = []
        tries = 0
        while len(kept) < wanted and tries < 4 * wanted:
            tries += 1
            values = sample()
            if self.filter and self.share < CONTENDED:
                dropped.append((self.share, values))
            else:
                kept.append(values)
        dropped.sort(key=lambda d: -d[0])
        kept += [v for _, v in dropped[: wanted - len(kept)]]
        return kept, len(dropped)

    def schedule(self, probe_s: float) -> tuple[int, int]:
        """(calls per sample, samples) for an op whose single call took `probe_s` on the
        slowest rank: every rank gets the same answer."""
        (probe_s,) = self.max_over_ranks([probe_s])
        inner = max(1, math.ceil(self.plan.min_sample_s / max(probe_s, 1e-9)))
        budget = int(self.plan.max_row_s / self.plan.rounds / max(probe_s * inner, 1e-9))
        least = math.ceil(self.plan.repeats / self.plan.rounds)
        most = math.ceil(self.plan.max_repeats / self.plan.rounds)
        return inner, max(least, min(most, budget))

    def time_op(
        self, fn: Callable[[], Any], barrier_each: bool = False
    ) -> tuple[list[float], int, int]:
        """Warm up, then samples of seconds per call, calls per sample, samples dropped.

        Collectives (`barrier_each`) run in lockstep: sample i is the same call on every rank
        and the maximum over ranks is taken per call. Compute runs on every rank at once but
        is sampled per rank (contended samples dropped): each rank's samples are sorted and
        the maximum over ranks taken per rank order, the slowest rank's distribution."""
        for _ in range(self.warmup):
            fn()
        self.sync()
        inner, repeats = self.schedule(self.elapsed_s(fn, 1))
        dist.barrier()
        if barrier_each:
            samples = []
            for _ in range(repeats):
                dist.barrier()
                samples.append(self.elapsed_s(fn, inner))
            return self.max_over_ranks(samples), inner, 0
        kept, dropped = self.clean_samples(lambda: (self.elapsed_s(fn, inner),), repeats)
        ordered = sorted(v[0] for v in kept)
        return self.max_over_ranks(ordered), inner, self.sum_over_ranks(dropped)

    # ---- compute ------------------------------------------------------------------------

    def gemm(self, shape: tuple[int, int, int, int]) -> list[Measurement]:
        m, n, k, b = shape
        opts: dict[str, Any] = {"dtype": self.dtype, "device": self.device}
        if b == 1:
            a, w, c = (
                torch.randn(m, k, **opts),
                torch.randn(k, n, **opts),
                torch.empty(m, n, **opts),
            )
            samples, inner, dropped = self.time_op(lambda: torch.mm(a, w, out=c))
        else:
            a, w = torch.randn(b, m, k, **opts), torch.randn(b, k, n, **opts)
            c = torch.empty(b, m, n, **opts)
            samples, inner, dropped = self.time_op(lambda: torch.bmm(a, w, out=c))
        op = "mm" if b == 1 else "bmm"
        flops = 2.0 * m * n * k * b
        return [
            Measurement(
                Kind.GEMM,
                op,
                self.plan.dtype,
                tuple(samples),
                flops=flops,
                shape=shape,
                inner=inner,
                dropped=dropped,
            )
        ]

    def memory(self, size_bytes: int) -> list[Measurement]:
        n = size_bytes // _itemsize(self.dtype)
        opts: dict[str, Any] = {"dtype": self.dtype, "device": self.device}
        a, b, c = torch.randn(n, **opts), torch.randn(n, **opts), torch.empty(n, **opts)
        rows = []
        for op, passes, fn in (
            ("add", 3, lambda: torch.add(a, b, out=c)),
            ("copy", 2, lambda: c.copy_(a)),
        ):
            samples, inner, dropped = self.time_op(fn)
            moved = float(passes * n * _itemsize(self.dtype))
            rows.append(
                Measurement(
                    Kind.MEMORY,
                    op,
                    self.plan.dtype,
                    tuple(samples),
                    size_bytes=moved,
                    inner=inner,
                    dropped=dropped,
                )
            )
        return rows

    def attention(self, model: ModelSpec) -> list[Measurement]:
        rows = []
        for mb, op in attention_ops(model, self.plan.micro_batches, _itemsize(self.dtype)):
            shape = (mb, model.heads, model.seq_len, model.head_dim)
            opts: dict[str, Any] = {"dtype": self.dtype, "device": self.device}
            q, k, v = (torch.randn(*shape, **opts) for _ in range(3))
            sdpa = partial(F.scaled_dot_product_attention, q, k, v, is_causal=True)
            samples, inner, dropped = self.time_op(sdpa)
            rows.append(
                Measurement(
                    Kind.ATTENTION,
                    "sdpa",
                    self.plan.dtype,
                    tuple(samples),
                    flops=op.flops,
                    micro_batch=mb,
                    inner=inner,
                    dropped=dropped,
                )
            )
        return rows

    def layer(self, model: ModelSpec, kind: LayerKind, mb: int) -> list[Measurement]:
        """Forward and backward of one module in training mode, as the training step runs it."""
        module, forward, copies = self._layer_forward(model, kind, mb)
        params = list(module.parameters())

        def step() -> tuple[float, float]:
            for p in params:
                p.grad = None
            f_s, out = self._timed(forward)
            share = self.share
            grad = None if out.dim() == 0 else torch.ones_like(out)
            b_s, _ = self._timed(partial(out.backward, grad))
            self.share = min(share, self.share)
            return f_s, b_s

        def sample() -> tuple[float, ...]:
            f_s, b_s, share = 0.0, 0.0, 1.0
            for _ in range(inner):
                f, b = step()
                f_s, b_s, share = f_s + f, b_s + b, min(share, self.share)
            self.share = share
            return f_s / inner / copies, b_s / inner / copies

        for _ in range(self.warmup):
            step()
        f0, b0 = step()
        inner, repeats = self.schedule(f0 + b0)
        dist.barrier()
        kept, dropped = self.clean_samples(sample, repeats)
        fwd = self.max_over_ranks(sorted(v[0] for v in kept))
        bwd = self.max_over_ranks(sorted(v[1] for v in kept))
        dropped = self.sum_over_ranks(dropped)
        key = layer_time_key(model, kind, mb, self.plan.dtype, 1, self.plan.flash_attention)
        return [
            Measurement(
                Kind.LAYER_FORWARD,
                str(kind),
                self.plan.dtype,
                tuple(fwd),
                layer_key=key,
                micro_batch=mb,
                inner=inner,
                dropped=dropped,
            ),
            Measurement(
                Kind.LAYER_BACKWARD,
                str(kind),
                self.plan.dtype,
                tuple(bwd),
                layer_key=key,
                micro_batch=mb,
                inner=inner,
                dropped=dropped,
            ),
        ]

    def _timed(self, fn: Callable[[], Any]) -> tuple[float, Any]:
        if self.cuda:
            start, end = _event(), _event()
            start.record()
            out = fn()
            end.record()
            end.synchronize()
            return float(start.elapsed_time(end)) / 1e3, out
        t0, c0 = time.perf_counter(), time.thread_time()
        out = fn()
        wall = time.perf_counter() - t0
        self.share = (time.thread_time() - c0) / wall if wall > 0 else 1.0
        return wall, out

    def _layer_forward(
        self, model: ModelSpec, kind: LayerKind, mb: int
    ) -> tuple[nn.Module, Callable[[], torch.Tensor], int]:
        """The module, a closure running its forward on a random micro-batch (the head includes
        the cross-entropy loss, as the simulator's head ops do), and how many layers it chains.

        Training streams distinct layers through the caches, so a repeated layer would time
        cache-warm: layers are chained until their weights overflow the last-level cache
        twice (at most the model's layer count), and the time is per layer."""
        dev, dt = self.device, self.dtype
        tokens = (mb,) if model.kind is ModelKind.MLP else (mb, model.seq_len)
        if kind is LayerKind.EMBEDDING:
            emb: nn.Module = torchmodels.Embedding(model).to(dev, dt).train()
            idx = torch.randint(0, model.vocab, tokens, device=dev)
            return emb, partial(emb, idx), 1
        if kind is LayerKind.HEAD:
            embedding = torchmodels.Embedding(model)
            head = torchmodels.Head(model, embedding)
            both = nn.ModuleDict({"embedding": embedding, "head": head}).to(dev, dt).train()
            x = torch.randn(*tokens, model.hidden, device=dev, dtype=dt, requires_grad=True)
            targets = torch.randint(0, model.vocab, tokens, device=dev)

            def loss() -> torch.Tensor:
                return F.cross_entropy(head(x).flatten(0, 1), targets.flatten())

            return both, loss, 1
        layer = torchmodels.layer_module(model, kind, self.plan.flash_attention)
        layer_bytes = sum(p.numel() for p in layer.parameters()) * _itemsize(self.dtype)
        copies = max(1, min(model.layers, math.ceil(2 * self.cache_bytes / max(layer_bytes, 1))))
        layers = [layer] + [
            torchmodels.layer_module(model, kind, self.plan.flash_attention)
            for _ in range(copies - 1)
        ]
        module = nn.Sequential(*layers).to(dev, dt).train()
        x = torch.randn(*tokens, model.hidden, device=dev, dtype=dt, requires_grad=True)
        return module, lambda: module(x), copies

    # ---- memory traffic -----------------------------------------------------------------

    def host_copy(self, size_bytes: int) -> list[Measurement]:
        """Host <-> device copies. On CPU the two are one memcpy between host buffers."""
        n = size_bytes // 4
        if not self.cuda:
            src, dst = torch.randn(n), torch.empty(n)
            samples, inner, dropped = self.time_op(lambda: dst.copy_(src))
            return [
                Measurement(
                    Kind.HOST_COPY,
                    "memcpy",
                    "fp32",
                    tuple(samples),
                    size_bytes=float(n * 4),
                    inner=inner,
                    dropped=dropped,
                )
            ]
        host = torch.randn(n).pin_memory()
        dev = torch.empty(n, device=self.device)
        rows = []
        for op, fn in (
            ("h2d", lambda: dev.copy_(host, non_blocking=True)),
            ("d2h", lambda: host.copy_(dev, non_blocking=True)),
        ):
            samples, inner, dropped = self.time_op(fn)
            rows.append(
                Measurement(
                    Kind.HOST_COPY, op, "fp32", tuple(samples), size_bytes=float(n * 4), inner=inner
                )
            )
        return rows

    def optimizer(self, params: int) -> list[Measurement]:
        """One AdamW step over one flat fp32 tensor: what DeepSpeed's `{"type": "Adam",
        "params": {"torch_adam": true}}` builds (torch.optim.AdamW, adam_w_mode defaults on),
        over the flat fp32 partition ZeRO keeps. On CUDA the host (offload) rate is timed too."""
        rows = []
        places = [("adamw", self.device)] + (
            [("host_adamw", torch.device("cpu"))] if self.cuda else []
        )
        for op, place in places:
            p = nn.Parameter(torch.zeros(params, device=place))
            p.grad = torch.randn(params, device=place)
            opt = torch.optim.AdamW([p], lr=1e-4, foreach=None, fused=place.type == "cuda" or None)
            samples, inner, dropped = self.time_op(opt.step)
            rows.append(
                Measurement(
                    Kind.OPTIMIZER,
                    op,
                    "fp32",
                    tuple(samples),
                    params=params,
                    inner=inner,
                    dropped=dropped,
                )
            )
        return rows

    # ---- collectives --------------------------------------------------------------------

    def collective(
        self, op: Collective, size_bytes: int, name: str, group: Any, ranks: list[int]
    ) -> list[Measurement]:
        n = len(ranks)
        item = _itemsize(self.dtype)
        per_rank = max(1, size_bytes // item // n)
        count = per_rank * n  # S in elements, a multiple of n
        opts: dict[str, Any] = {"dtype": self.dtype, "device": self.device}
        me = ranks.index(dist.get_rank())
        if op is Collective.ALL_GATHER:
            small, big = torch.ones(per_rank, **opts), torch.empty(count, **opts)
            call = partial(dist.all_gather_into_tensor, big, small, group=group)
        elif op is Collective.REDUCE_SCATTER:
            small, big = torch.empty(per_rank, **opts), torch.ones(count, **opts)
            call = partial(dist.reduce_scatter_tensor, small, big, group=group)
        elif op is Collective.ALL_REDUCE:
            call = partial(dist.all_reduce, torch.ones(count, **opts), group=group)
        elif op is Collective.BROADCAST:
            call = partial(dist.broadcast, torch.ones(count, **opts), src=ranks[0], group=group)
        else:
            out, inp = torch.ones(count, **opts), torch.empty(count, **opts)
            nxt, prv = ranks[(me + 1) % n], ranks[(me - 1) % n]
            call = partial(_sendrecv, out, nxt, inp, prv, group)

        def fn() -> None:
            call()
            self.sync()

        samples, inner, dropped = self.time_op(fn, barrier_each=True)
        return [
            Measurement(
                Kind.COLLECTIVE,
                str(op),
                self.plan.dtype,
                tuple(samples),
                size_bytes=float(count * item),
                group=name,
                ranks=n,
                link_class=self.plan.link_classes.get(name, ""),
                inner=inner,
                dropped=dropped,
            )
        ]


def _event() -> Any:
    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]


def _sendrecv(out: torch.Tensor, dst: int, inp: torch.Tensor, src: int, group: Any) -> None:
    """Send `out` to `dst` while receiving `inp` from `src` (both posted before either waits)."""
    works = [dist.isend(out, dst, group=group), dist.irecv(inp, src, group=group)]
    for work in works:
        if work is not None:
            work.wait()


def _itemsize(dtype: torch.dtype) -> int:
    return int(torch.empty((), dtype=dtype).element_size())


def groups(world: int, local: int) -> list[tuple[str, list[list[int]]]]:
    """The process groups to measure: ranks on one node (intra), one rank per node (inter),
    everyone (full). On one node only intra exists (it is also the full group)."""
    nodes = world // local
    intra = [list(range(i * local, (i + 1) * local)) for i in range(nodes)]
    if nodes == 1:
        return [("intra", intra)] if local > 1 else []
    inter = [list(range(j, world, local)) for j in range(local)]
    out = [("intra", intra)] if local > 1 else []
    return [*out, ("inter", inter), ("full", [list(range(world))])]


def tasks(bench: Bench, plan: Plan, world: int, local: int) -> list[Task]:
    out: list[Task] = []
    out += [(f"gemm {s}", partial(bench.gemm, s)) for s in plan.gemm_shapes]
    out += [(f"memory {s} B", partial(bench.memory, s)) for s in plan.memory_sizes_bytes]
    for model in plan.models:
        if model.kind is ModelKind.TRANSFORMER:
            out.append((f"attention {model.name}", partial(bench.attention, model)))
        for kind in layer_kinds(model):
            out += [
                (f"layer {model.name} {kind} mb{mb}", partial(bench.layer, model, kind, mb))
                for mb in plan.micro_batches
            ]
    out += [(f"host copy {s} B", partial(bench.host_copy, s)) for s in plan.host_copy_sizes_bytes]
    out += [(f"adamw {p} params", partial(bench.optimizer, p)) for p in plan.adam_params]
    me = dist.get_rank()
    for name, members in groups(world, local):
        handles = [dist.new_group(r) for r in members]  # every rank creates every group
        mine = next(i for i, r in enumerate(members) if me in r)
        out += [
            (
                f"{op} {name} {size} B",
                partial(bench.collective, op, size, name, handles[mine], members[mine]),
            )
            for op in plan.collectives
            for size in plan.collective_sizes_bytes
        ]
    return out


def provenance(device: torch.device, world: int, local: int) -> dict[str, Any]:
    """What this worker can tell about the software and the device (rank 0's view)."""

    def version(pkg: str) -> str:
        try:
            return importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    info: dict[str, Any] = {
        "torch": torch.__version__,
        "deepspeed": version("deepspeed"),
        "backend": dist.get_backend(),
        "world_size": world,
        "local_world_size": local,
        "torch_num_threads": torch.get_num_threads(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "rank_rss_bytes": _rss_bytes(),
        "cache_bytes": _last_level_cache_bytes(),
    }
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        info |= {
            "device_name": torch.cuda.get_device_name(device),
            "cuda": torch.version.cuda,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())),  # type: ignore[no-untyped-call]
            "device_memory_bytes": total,
            "device_reserved_bytes": total - free,
            "cache_bytes": torch.cuda.get_device_properties(device).L2_cache_size,
        }
    return info


def _last_level_cache_bytes() -> int:
    """The CPU's largest cache (Linux sysfs), 0 when unknown."""
    sizes = [0]
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = entry.read_text().strip()
        scale = {"K": 1024, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        with contextlib.suppress(ValueError):
            sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes)


def _rss_bytes() -> int:
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zsim.calibrate.worker")
    parser.add_argument("--plan", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    plan = Plan.from_dict(json.loads(args.plan.read_text()))
    warnings.filterwarnings("ignore", category=FutureWarning)  # gloo's *_tensor deprecations
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if plan.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group(
        "nccl" if plan.device == "cuda" else "gloo", timeout=timedelta(minutes=10)
    )
    world = dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    torch.manual_seed(dist.get_rank())
    bench = Bench(plan, device)
    info = provenance(device, world, local)
    work = tasks(bench, plan, world, local)
    started = time.time()
    total = len(work) * plan.rounds
    results: list[list[Measurement]] = [[] for _ in work]
    for round_ in range(plan.rounds):
        bench.warmup = plan.warmup if round_ == 0 else min(1, plan.warmup)
        for i, (label, task) in enumerate(work):
            if dist.get_rank() == 0:
                done = round_ * len(work) + i
                print(f"{PROGRESS} {done} {total} round {round_ + 1}: {label}", flush=True)
            dist.barrier()
            results[i] = merge(results[i], task())
    rows = [row for task_rows in results for row in task_rows]
    if dist.get_rank() == 0:
        print(f"{PROGRESS} {total} {total} done", flush=True)
        info["measure_seconds"] = round(time.time() - started, 1)
        payload = {"provenance": info, "measurements": [r.to_dict() for r in rows]}
        args.out.write_text(json.dumps(payload))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
