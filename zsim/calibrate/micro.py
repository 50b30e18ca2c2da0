"""The microbenchmarks a calibration times on every rank at once (`Bench`): GEMMs, memory-bound
kernels, fused attention, whole layers (forward and backward, chained through the cache as
training streams them), host copies, the AdamW step and collectives. Each returns its rows."""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from zsim.calibrate.bench import Bench, itemsize
from zsim.calibrate.measurement import Collective, Kind, Measurement
from zsim.calibrate.plan import attention_ops
from zsim.cluster.device import layer_time_key
from zsim.testbed import torchmodels
from zsim.workload.model import LayerKind, ModelKind, ModelSpec


def gemm(bench: Bench, shape: tuple[int, int, int, int]) -> list[Measurement]:
    m, n, k, b = shape
    opts: dict[str, Any] = {"dtype": bench.dtype, "device": bench.device}
    if b == 1:
        a, w, c = (
            torch.randn(m, k, **opts),
            torch.randn(k, n, **opts),
            torch.empty(m, n, **opts),
        )
        samples, inner, dropped = bench.time_op(lambda: torch.mm(a, w, out=c))
    else:
        a, w = torch.randn(b, m, k, **opts), torch.randn(b, k, n, **opts)
        c = torch.empty(b, m, n, **opts)
        samples, inner, dropped = bench.time_op(lambda: torch.bmm(a, w, out=c))
    op = "mm" if b == 1 else "bmm"
    flops = 2.0 * m * n * k * b
    return [
        Measurement(
            Kind.GEMM,
            op,
            bench.plan.dtype,
            tuple(samples),
            flops=flops,
            shape=shape,
            inner=inner,
            dropped=dropped,
        )
    ]


def memory(bench: Bench, size_bytes: int) -> list[Measurement]:
    n = size_bytes // itemsize(bench.dtype)
    opts: dict[str, Any] = {"dtype": bench.dtype, "device": bench.device}
    a, b, c = torch.randn(n, **opts), torch.randn(n, **opts), torch.empty(n, **opts)
    rows = []
    for op, passes, fn in (
        ("add", 3, lambda: torch.add(a, b, out=c)),
        ("copy", 2, lambda: c.copy_(a)),
    ):
        samples, inner, dropped = bench.time_op(fn)
        moved = float(passes * n * itemsize(bench.dtype))
        rows.append(
            Measurement(
                Kind.MEMORY,
                op,
                bench.plan.dtype,
                tuple(samples),
                size_bytes=moved,
                inner=inner,
                dropped=dropped,
            )
        )
    return rows


def attention(bench: Bench, model: ModelSpec) -> list[Measurement]:
    rows = []
    for mb, op in attention_ops(model, bench.plan.micro_batches, itemsize(bench.dtype)):
        shape = (mb, model.heads, model.seq_len, model.head_dim)
        opts: dict[str, Any] = {"dtype": bench.dtype, "device": bench.device}
        q, k, v = (torch.randn(*shape, **opts) for _ in range(3))
        sdpa = partial(F.scaled_dot_product_attention, q, k, v, is_causal=True)
        samples, inner, dropped = bench.time_op(sdpa)
        rows.append(
            Measurement(
                Kind.ATTENTION,
                "sdpa",
                bench.plan.dtype,
                tuple(samples),
                flops=op.flops,
                micro_batch=mb,
                inner=inner,
                dropped=dropped,
            )
        )
    return rows


def layer(
    bench: Bench, model: ModelSpec, kind: LayerKind, mb: int, tp: int = 1
) -> list[Measurement]:
    """Forward and backward of one module in training mode, as the training step runs it,
    and its backward again with the gradients kept (a later micro-batch's, which autograd
    adds into `.grad` inside the pass); at tp > 1 one rank's Megatron shard of it, compute
    only (its collectives are timed as collectives)."""
    module, forward, copies = _layer_forward(bench, model, kind, mb, tp)
    params = list(module.parameters())

    def backward_of(out: torch.Tensor) -> float:
        grad = None if out.dim() == 0 else torch.ones_like(out)
        return bench.timed(partial(out.backward, grad))[0]

    def step() -> tuple[float, float, float]:
        for p in params:
            p.grad = None
        f_s, out = bench.timed(forward)
        share = bench.share
        b_s = backward_of(out)
        share = min(share, bench.share)
        a_s = backward_of(forward())  # the gradients of the first are still in .grad
        bench.share = min(share, bench.share)
        return f_s, b_s, a_s

    def sample() -> tuple[float, ...]:
        sums, share = [0.0, 0.0, 0.0], 1.0
        for _ in range(inner):
            sums = [s + t for s, t in zip(sums, step(), strict=True)]
            share = min(share, bench.share)
        bench.share = share
        return tuple(s / inner / copies for s in sums)

    for _ in range(bench.warmup):
        step()
    inner, repeats = bench.schedule(sum(step()))
    dist.barrier()
    kept, dropped = bench.clean_samples(sample, repeats)
    dropped = bench.sum_over_ranks(dropped)
    key = layer_time_key(model, kind, mb, bench.plan.dtype, tp, bench.plan.flash_attention)
    kinds = (Kind.LAYER_FORWARD, Kind.LAYER_BACKWARD, Kind.LAYER_ACCUMULATE)
    return [
        Measurement(
            row_kind,
            str(kind),
            bench.plan.dtype,
            tuple(bench.max_over_ranks(sorted(v[i] for v in kept))),
            layer_key=key,
            micro_batch=mb,
            inner=inner,
            dropped=dropped,
        )
        for i, row_kind in enumerate(kinds)
    ]


def _layer_forward(
    bench: Bench, model: ModelSpec, kind: LayerKind, mb: int, tp: int = 1
) -> tuple[nn.Module, Callable[[], torch.Tensor], int]:
    """The module, a closure running its forward on a random micro-batch (the head includes
    the cross-entropy loss, as the simulator's head ops do), and how many layers it chains.

    Training streams distinct layers through the caches, so a repeated layer would time
    cache-warm: layers are chained until their weights overflow the last-level cache
    twice (at most the model's layer count), and the time is per layer."""
    dev, dt = bench.device, bench.dtype
    tokens = (mb,) if model.kind is ModelKind.MLP else (mb, model.seq_len)
    if kind is LayerKind.EMBEDDING:
        emb = torchmodels.embedding_shard(model, tp).to(dev, dt).train()
        idx = torch.randint(0, model.vocab, tokens, device=dev)
        return emb, partial(emb, idx), 1
    if kind is LayerKind.HEAD:
        both, head = torchmodels.head_shard(model, tp)
        both = both.to(dev, dt).train()
        x = torch.randn(*tokens, model.hidden, device=dev, dtype=dt, requires_grad=True)
        targets = torch.randint(0, model.vocab, tokens, device=dev)
        return both, partial(head, x, targets), 1
    flash = bench.plan.flash_attention
    layer = torchmodels.layer_module(model, kind, flash, tp)
    layer_bytes = sum(p.numel() for p in layer.parameters()) * itemsize(bench.dtype)
    copies = max(1, min(model.layers, math.ceil(2 * bench.cache_bytes / max(layer_bytes, 1))))
    layers = [layer] + [torchmodels.layer_module(model, kind, flash, tp) for _ in range(copies - 1)]
    module = nn.Sequential(*layers).to(dev, dt).train()
    x = torch.randn(*tokens, model.hidden, device=dev, dtype=dt, requires_grad=True)
    return module, lambda: module(x), copies


def host_copy(bench: Bench, size_bytes: int) -> list[Measurement]:
    """Host <-> device copies. On CPU the two are one memcpy between host buffers."""
    n = size_bytes // 4
    if not bench.cuda:
        src, dst = torch.randn(n), torch.empty(n)
        samples, inner, dropped = bench.time_op(lambda: dst.copy_(src))
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
    dev = torch.empty(n, device=bench.device)
    rows = []
    for op, fn in (
        ("h2d", lambda: dev.copy_(host, non_blocking=True)),
        ("d2h", lambda: host.copy_(dev, non_blocking=True)),
    ):
        samples, inner, dropped = bench.time_op(fn)
        rows.append(
            Measurement(
                Kind.HOST_COPY, op, "fp32", tuple(samples), size_bytes=float(n * 4), inner=inner
            )
        )
    return rows


def optimizer(bench: Bench, params: int) -> list[Measurement]:
    """One AdamW step over one flat fp32 tensor: what DeepSpeed's `{"type": "Adam",
    "params": {"torch_adam": true}}` builds (torch.optim.AdamW, adam_w_mode defaults on),
    over the flat fp32 partition ZeRO keeps. On CUDA the host (offload) rate is timed too."""
    rows = []
    places = [("adamw", bench.device)] + (
        [("host_adamw", torch.device("cpu"))] if bench.cuda else []
    )
    for op, place in places:
        p = nn.Parameter(torch.zeros(params, device=place))
        p.grad = torch.randn(params, device=place)
        opt = torch.optim.AdamW([p], lr=1e-4, foreach=None, fused=place.type == "cuda" or None)
        samples, inner, dropped = bench.time_op(opt.step)
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


def collective(
    bench: Bench, op: Collective, size_bytes: int, name: str, group: Any, ranks: list[int]
) -> list[Measurement]:
    n = len(ranks)
    item = itemsize(bench.dtype)
    per_rank = max(1, size_bytes // item // n)
    count = per_rank * n  # S in elements, a multiple of n
    opts: dict[str, Any] = {"dtype": bench.dtype, "device": bench.device}
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
        bench.sync()

    samples, inner, dropped = bench.time_op(fn, barrier_each=True)
    return [
        Measurement(
            Kind.COLLECTIVE,
            str(op),
            bench.plan.dtype,
            tuple(samples),
            size_bytes=float(count * item),
            group=name,
            ranks=n,
            link_class=bench.plan.link_classes.get(name, ""),
            inner=inner,
            dropped=dropped,
        )
    ]


def _sendrecv(out: torch.Tensor, dst: int, inp: torch.Tensor, src: int, group: Any) -> None:
    """Send `out` to `dst` while receiving `inp` from `src` (both posted before either waits)."""
    works = [dist.isend(out, dst, group=group), dist.irecv(inp, src, group=group)]
    for work in works:
        if work is not None:
            work.wait()
