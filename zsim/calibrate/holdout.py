"""Every fit scored on rows it did not see: k-fold over sizes and shapes.

The distinct sizes (a GEMM's shape, a kernel's or a collective's bytes, an Adam step's
parameters) of each kind of row are dealt round-robin into `FOLDS` folds, so each fold holds
out every fifth size of every kind: some inside the fitted range, the smallest or largest
outside it. The profile is fitted again without a fold (`fit_profile`, all its rules) and
the held-out rows are predicted by the simulator's own functions (`replay.simulated_s`). A
kind measured at one size only is never held out (nothing would be left to fit), nor are the
layer rows (a layer's time is its own measurement, not a model's), the ping-pong rows
(floors, not fitted) or ZeRO-3's host rows (a slope, read off directly).

The held-out residuals sit beside the fitted ones in the profile (`Residual.held_out`): a fit
that is good only on its own rows shows it there.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from zsim.calibrate.fit import Residual, fit_profile, residuals
from zsim.calibrate.measurement import LAYER_FIELDS, Kind, Measurement
from zsim.calibrate.replay import simulated_s
from zsim.cluster.calibrated import apply_profile
from zsim.errors import InputError
from zsim.inputs import presets

FOLDS = 5
UNSCORED = (*LAYER_FIELDS, Kind.PINGPONG, Kind.ENGINE_HOST)


def size_of(row: Measurement) -> tuple[float, ...]:
    """What a fold holds out together: the rows of one kind and size (every op and group)."""
    if row.kind is Kind.GEMM:
        return tuple(float(x) for x in row.shape)
    if row.kind is Kind.OPTIMIZER:
        return (float(row.params),)
    if row.kind is Kind.ATTENTION:
        return (row.flops,)
    return (row.size_bytes,)


def folds(rows: Sequence[Measurement], k: int = FOLDS) -> list[set[int]]:
    """Row indices of each fold (non-empty folds only)."""
    out: list[set[int]] = [set() for _ in range(k)]
    for kind in Kind:
        if kind in UNSCORED:
            continue
        sizes = sorted({size_of(r) for r in rows if r.kind is kind})
        if len(sizes) < 2:
            continue
        fold_of = {s: j % k for j, s in enumerate(sizes)}
        for i, r in enumerate(rows):
            if r.kind is kind:
                out[fold_of[size_of(r)]].add(i)
    return [f for f in out if f]


def held_out_predictions(
    name: str, rows: Sequence[Measurement], info: Mapping[str, Any], k: int = FOLDS
) -> dict[int, float]:
    """Each scored row's time under the profile fitted without its fold."""
    out: dict[int, float] = {}
    topology = info.get("topology")
    for fold in folds(rows, k):
        train = [r for i, r in enumerate(rows) if i not in fold]
        try:
            profile = fit_profile(name, train, info, diagnostics=False).profile
        except InputError:
            continue  # the fold took a kind's last rows a fit needs: no score from it
        topo = apply_profile(presets.topology(str(topology)), profile) if topology else None
        for i in fold:
            try:
                out[i] = simulated_s(profile, topo, rows[i])
            except (KeyError, ValueError):
                continue  # a row the refitted profile has no rate for, or no topology
    return out


def held_out_residuals(
    name: str, rows: Sequence[Measurement], info: Mapping[str, Any], fitted: frozenset[int]
) -> tuple[Residual, ...]:
    """The residuals of the rows the full fit used, each predicted without its fold."""
    held = {i: p for i, p in held_out_predictions(name, rows, info).items() if i in fitted}
    return tuple(replace(r, held_out=True) for r in residuals(rows, held, fitted))
