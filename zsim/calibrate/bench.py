"""Timing on one rank of a calibration, with the other ranks doing the same thing at the same
time: warm-up, calls per sample and samples per row from a probe, samples in which the rank lost
its core dropped (CPU), and the maximum over ranks. CPU samples use time.perf_counter; CUDA
samples use CUDA events."""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from zsim.calibrate.plan import RANKS_ON_HOST_ENV, Plan

CONTENDED = 0.9  # a CPU sample whose thread ran less than this share of its wall time
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


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
            else last_level_cache_bytes()
        )

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

    def timed(self, fn: Callable[[], Any]) -> tuple[float, Any]:
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


def _event() -> Any:
    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]


def itemsize(dtype: torch.dtype) -> int:
    return int(torch.empty((), dtype=dtype).element_size())


def last_level_cache_bytes() -> int:
    """The CPU's largest cache (Linux sysfs), 0 when unknown."""
    sizes = [0]
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = entry.read_text().strip()
        scale = {"K": 1024, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        with contextlib.suppress(ValueError):
            sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes)
