"""FSDP2's comm buffers in the ledger against the real engine's, measured inside its backward.

`benchmarks/validation/memory/` holds `zsim validate --engine fsdp` runs (2026-12-05, torch
2.13 on this CPU: 1x2, 1x4 and the emulated 2x2 with hybrid sharding) whose memory probe
snapshots each unit's post-backward and each `foreach_reduce` with the buffers FSDP keeps
outside the module (`validate.held.fsdp_in_flight`). The expected bytes are those the real
engine held; the ledger (`step.fsdp.buffer_bytes`) must give them to the byte.

`fsdp-llama-*` (2026-12-06, 2 steps): an untied Llama-shaped model (2 layers, h 256, vocab
8192), whose root holds an input embedding and an LM head: FSDP2 peaks at the root's
post-backward, every root gradient made and the first block's reduce-scatter input kept."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from zsim.inputs.scenario import parse_model
from zsim.memory import ledger
from zsim.step.fsdp import early_root_numel
from zsim.validate.committed import case_of

RUNS = Path(__file__).parent.parent / "benchmarks" / "validation" / "memory"
MEASURED = [
    (folder.name, row)
    for folder in sorted(RUNS.iterdir())
    for row in csv.DictReader((folder / "predicted_vs_measured.csv").open())
]


def test_every_sharding_was_measured() -> None:
    assert {row["case"] for _, row in MEASURED} == {"fsdp-full", "fsdp-grad-op", "fsdp-hybrid"}
    # the MLP: full and grad-op on 1x2, 1x4, 2x2, hybrid on 2x2; the Llama: full and grad-op
    # on 1x2, full and hybrid (shard groups of 2) on 1x4
    assert len(MEASURED) == 11
    roots = [r for _, r in MEASURED if case_of(r).model.vocab]  # embeddings and a head
    assert len(roots) == 4
    assert not case_of(roots[0]).model.tied_embeddings


@pytest.mark.parametrize(
    "row", [r for _, r in MEASURED], ids=[f"{f}-{r['case']}" for f, r in MEASURED]
)
def test_the_ledger_holds_what_fsdp2_held(row: dict[str, str]) -> None:
    case = case_of(row)
    held = ledger(case.model, case.parallel)
    assert held.comm_buffers == pytest.approx(float(row["measured_comm_buffers_bytes"]), rel=1e-9)
    assert held.gradients == pytest.approx(float(row["measured_gradients_bytes"]), rel=1e-9)
    assert held.parameters == pytest.approx(float(row["measured_parameters_bytes"]), rel=1e-9)


def test_the_root_gradients_autograd_makes_at_the_backward_start() -> None:
    """The head's (final norm, LM head) and a tied word embedding's, which autograd holds
    from the head's backward (`benchmarks/validation/diagnosis/tied_gradient.json`: tied
    minus untied unreached bytes = 8192 x 768 x 4); not the position embedding's or an
    untied word embedding's, made by the lookups at the backward's end."""
    shape = "layers=2,hidden=256,heads=4,seq-len=128,vocab=8192"
    gpt = parse_model(f"gpt-125m:{shape}")  # tied, learned positions, LayerNorm with bias
    llama = parse_model(f"llama-7b:{shape},ffn-hidden=688")  # untied, RMSNorm
    assert early_root_numel(gpt.layer_list(), 1, gpt.tied_embeddings) == 8192 * 256 + 2 * 256
    assert early_root_numel(llama.layer_list(), 1, llama.tied_embeddings) == 8192 * 256 + 256
    assert early_root_numel(gpt.layer_list(), 2, True) == 8192 * 256 // 2 + 2 * 256
