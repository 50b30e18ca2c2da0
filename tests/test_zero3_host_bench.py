"""The microbenchmark behind ZeRO-3's host walks (`zsim.calibrate.zero3_host`) runs DeepSpeed's
own code: the handle's wait assembles each parameter from one piece per rank, and
`reduce_scatter_coalesced` hands its (replaced) collective one interleaved buffer of every
rank's pieces. The fit recovers a known cost per rank from rows made with it."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("deepspeed", reason="deepspeed is in the calibrate extra")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from zsim.calibrate import zero3_host


def test_the_wait_assembles_every_parameter_from_every_rank(monkeypatch) -> None:
    seen = []
    real = zero3_host._inflight_params

    def spy(world: int, tensors: int):
        params = real(world, tensors)
        seen.extend(params)
        return params

    monkeypatch.setattr(zero3_host, "_inflight_params", spy)
    monkeypatch.setattr(zero3_host, "REPEATS", 1)
    zero3_host.gather_wait_s(16, 3)
    assert len(seen) == 3
    assert all(p.data.numel() == 16 * zero3_host.PIECE for p in seen)  # one piece per rank


def test_the_reduce_scatter_interleaves_every_rank(monkeypatch) -> None:
    sizes = []
    monkeypatch.setattr(zero3_host, "REPEATS", 1)
    zero3_host.reduce_s(32, 2, lambda flat, *_, **__: sizes.append(flat.numel()))
    assert sizes == [32 * zero3_host.PIECE * 2]  # two gradients, padded to 8 a rank


def test_the_fit_recovers_a_cost_per_rank() -> None:
    rows = [
        {
            "cost": cost,
            "world": w,
            "tensors": t,
            "s": 1e-4 + 3e-6 * w * (1 if cost == "gather_issue" else t),
        }
        for cost in zero3_host.COSTS
        for w in zero3_host.WORLDS
        for t in zero3_host.TENSORS
    ]
    for fitted in zero3_host.fit(rows).values():
        assert fitted["per_rank_s"] == pytest.approx(3e-6)
        assert fitted["intercept_s"] == pytest.approx(1e-4)
