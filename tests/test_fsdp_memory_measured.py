"""FSDP2's comm buffers in the ledger against the real engine's, measured inside its backward.

`benchmarks/validation/memory/` holds `zsim validate --engine fsdp` runs (2026-12-05, torch
2.13 on this CPU: 1x2, 1x4 and the emulated 2x2 with hybrid sharding) whose memory probe
snapshots each unit's post-backward and each `foreach_reduce` with the buffers FSDP keeps
outside the module (`validate.held.fsdp_in_flight`). The expected bytes are those the real
engine held; the ledger (`step.fsdp.buffer_bytes`) must give them to the byte."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from zsim.memory import ledger
from zsim.validate.committed import case_of

RUNS = Path(__file__).parent.parent / "benchmarks" / "validation" / "memory"
MEASURED = [
    (folder.name, row)
    for folder in sorted(RUNS.iterdir())
    for row in csv.DictReader((folder / "predicted_vs_measured.csv").open())
]


def test_every_sharding_was_measured() -> None:
    assert {row["case"] for _, row in MEASURED} == {"fsdp-full", "fsdp-grad-op", "fsdp-hybrid"}
    assert len(MEASURED) == 7  # full and grad-op on 1x2, 1x4, 2x2; hybrid on 2x2


@pytest.mark.parametrize(
    "row", [r for _, r in MEASURED], ids=[f"{f}-{r['case']}" for f, r in MEASURED]
)
def test_the_ledger_holds_what_fsdp2_held(row: dict[str, str]) -> None:
    case = case_of(row)
    held = ledger(case.model, case.parallel)
    assert held.comm_buffers == pytest.approx(float(row["measured_comm_buffers_bytes"]), rel=1e-9)
    assert held.gradients == pytest.approx(float(row["measured_gradients_bytes"]), rel=1e-9)
    assert held.parameters == pytest.approx(float(row["measured_parameters_bytes"]), rel=1e-9)
