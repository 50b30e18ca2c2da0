"""Diagnosis: does autograd hold a tied embedding's head gradient from the backward's start?

    PYTHONPATH=. python benchmarks/validation/diagnosis/tied_gradient.py

The ledger counts the FSDP2 root unit's fp32 gradient from the backward's start; the
validation's probe, which walks the module, does not see it at the first block's
post-backward (`README.md`, 2026-12-05 21:20). With the word embedding tied to the LM head,
the head's weight gradient waits in the input buffer of the weight's `AccumulateGrad` until
the lookup's backward adds its own: no module or optimizer holds it.

Two gloo ranks on this CPU run the validation's GPT (`gpt-125m:layers=2,seq-len=128,
vocab=8192`, fp32, micro-batch 4) under FSDP2 FULL_SHARD, tied and untied (the untied head
a weight of its own). After two steps (FSDP's lazy init, Adam's state), the third runs under
torch.profiler with `profile_memory=True`: its CPU memory events give the tensor bytes
allocated since the step began and still alive ("Total Allocated"), read at a marker placed
at the first unit's post-backward; the probe (`held.fsdp_inventory` + `fsdp_in_flight`)
counts what it reaches at the same moment and just before the step. Tensors alive but not
reached = allocated growth - probe growth (activations and autograd's own buffers among
them, alike in both models but for the tied gradient). Tied minus untied should be the tied
weight's gradient, 8192 x 768 x 4 bytes = 25.17 MB, if autograd holds it. Writes
tied_gradient.json beside itself.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.profiler import ProfilerActivity, profile, record_function

OUT = Path(__file__).with_name("tied_gradient.json")
SHAPE = {"layers": 2, "seq_len": 128, "vocab": 8192}
MARK = "zsim.first_post_backward"


def _probe(engine: Any) -> int:
    from zsim.validate.held import engine_inventory, fsdp_in_flight

    inventory = engine_inventory(engine)
    for tensor, name in fsdp_in_flight(engine):
        inventory.walk(tensor, name)
    return sum(inventory.by_category().values())


def _allocated_at(trace: Path) -> int:
    """ "Total Allocated" of the last CPU memory event before the marker."""
    events = json.loads(trace.read_text())["traceEvents"]
    mark = next(e for e in events if e.get("name") == MARK)["ts"]
    memory = [e for e in events if e.get("name") == "[memory]" and e["ts"] <= mark]
    last = max(memory, key=lambda e: (e["ts"], e["args"].get("Ev Idx", 0)))
    return int(last["args"]["Total Allocated"])


def _rank(rank: int, tied: bool, store: str, queue: Any) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=2, store=dist.FileStore(store, 2))
    from zsim.testbed import torchmodels
    from zsim.testbed.fsdp_engine import FsdpEngine
    from zsim.workload.model_presets import preset, with_overrides

    spec = replace(with_overrides(preset("gpt-125m"), **SHAPE), tied_embeddings=tied)
    torch.manual_seed(0)
    engine = FsdpEngine(torchmodels.build(spec), {"sharding": "full"}, 1, torch.float32)
    batch = torchmodels.batch(spec, 4)
    for _ in range(2):
        engine.backward(engine(*batch))
        engine.step()
    group = importlib.import_module("torch.distributed.fsdp._fully_shard._fsdp_param_group")
    post_backward = group.FSDPParamGroup.post_backward
    probed: list[int] = []

    def first(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not probed:
            with record_function(MARK):
                probed.append(_probe(engine))
        return post_backward(self, *args, **kwargs)

    group.FSDPParamGroup.post_backward = first
    before = _probe(engine)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        engine.backward(engine(*batch))
        engine.step()
    if rank == 0:
        trace = Path(store).with_suffix(".trace.json")
        prof.export_chrome_trace(str(trace))
        allocated = _allocated_at(trace)
        queue.put({"allocated_growth": allocated, "probe_growth": probed[0] - before})
    dist.destroy_process_group()


def main() -> int:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    out: dict[str, dict[str, int]] = {}
    scratch = Path(os.environ.get("TMPDIR", "/tmp"))
    for tied in (True, False):
        label = "tied" if tied else "untied"
        store = scratch / f"zsim-tied-gradient-{os.getpid()}-{label}"
        queue = mp.get_context("spawn").SimpleQueue()
        mp.spawn(_rank, args=(tied, str(store), queue), nprocs=2)
        row = queue.get()
        row["not_reached"] = row["allocated_growth"] - row["probe_growth"]
        out[label] = row
        print(label, {k: f"{v / 1e6:.2f} MB" for k, v in row.items()}, flush=True)
        for leftover in (store, store.with_suffix(".trace.json")):
            leftover.unlink(missing_ok=True)
    held = out["tied"]["not_reached"] - out["untied"]["not_reached"]
    print(f"tied minus untied, not reached: {held / 1e6:.2f} MB (the tied gradient: 25.17 MB)")
    OUT.write_text(json.dumps(out | {"tied_minus_untied_not_reached": held}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
