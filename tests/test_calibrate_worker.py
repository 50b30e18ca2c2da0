"""The calibration worker's timing set-up (no process group needed): layers are timed in a
chain that streams through the last-level cache as training does, and samples in which a rank
lost its core are kept when the host's ranks outnumber its cores."""

import os

import pytest

pytest.importorskip("torch", reason="torch is in the calibrate extra")

import torch

from zsim.calibrate.bench import Bench
from zsim.calibrate.micro import _layer_forward
from zsim.calibrate.plan import RANKS_ON_HOST_ENV, Plan
from zsim.workload.model import LayerKind
from zsim.workload.model_presets import preset, with_overrides


def _bench(monkeypatch: pytest.MonkeyPatch, ranks_on_host: int) -> Bench:
    monkeypatch.setenv(RANKS_ON_HOST_ENV, str(ranks_on_host))
    return Bench(Plan(device="cpu", dtype="fp32"), torch.device("cpu"))


def test_layers_chain_until_twice_the_cache_at_most_the_models_layers(monkeypatch):
    bench = _bench(monkeypatch, 1)
    bench.cache_bytes = 32 * 2**20
    model = with_overrides(preset("toy-mlp"), hidden=1024, layers=8)
    module, forward, copies = _layer_forward(bench, model, LayerKind.LINEAR, 4)
    # a Linear(1024) holds 4 MiB of fp32 weights: 16 would fill 64 MiB, the model has 8
    assert copies == 8
    assert sum(p.numel() for p in module.parameters()) == 8 * (1024 * 1024 + 1024)
    assert forward().shape == (4, 1024)
    bench.cache_bytes = 6 * 2**20  # 12 MiB: three layers of 4 MiB
    assert _layer_forward(bench, model, LayerKind.LINEAR, 4)[2] == 3


def test_lost_core_samples_are_dropped_only_without_oversubscription(monkeypatch):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the filter needs a rank computing on its calling thread alone
    try:
        cores = len(os.sched_getaffinity(0))
        assert _bench(monkeypatch, cores).filter
        assert not _bench(monkeypatch, cores + 1).filter
    finally:
        torch.set_num_threads(threads)
