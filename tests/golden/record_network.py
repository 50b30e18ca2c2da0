"""Record `network_outputs.json` (see network_scenarios.py) with the flow-by-flow network:
`python -m tests.golden.record_network` from the repository root. Only for a change meant to
move these numbers: say which moved and why."""

from __future__ import annotations

import json
import sys
from typing import Any

import simpy

from tests.golden.network_scenarios import CAL, SCENARIOS, NetScenario
from zsim.calibrate.profile import load_profile
from zsim.cluster.calibrated import apply_profile
from zsim.cluster.device import DeviceProfile
from zsim.cluster.fabric import Backend
from zsim.cluster.grid import RankGrid
from zsim.inputs import presets
from zsim.network.communicator import Communicator
from zsim.simulation import simulate
from zsim.step.builder import build_program
from zsim.step.engine import Engine
from zsim.workload.model import ModelSpec
from zsim.workload.model_presets import preset, with_overrides
from zsim.workload.parallel import ParallelConfig, ZeroKnobs

OUTPUTS = __import__("pathlib").Path(__file__).parent / "network_outputs.json"


def inputs(s: NetScenario) -> tuple[ModelSpec, ParallelConfig, Any, DeviceProfile]:
    model = with_overrides(preset(s.model), **s.model_overrides)
    layout = dict(s.layout)
    knobs = ZeroKnobs(**layout.pop("knobs", {}))
    cfg = ParallelConfig(**layout, knobs=knobs)
    topo = presets.topology(s.topology)
    device = load_profile(CAL / f"{s.profile}.json") if s.profile else presets.gpu(topo.gpu_model)
    return model, cfg, topo, device


def flow_by_flow_link_bytes(s: NetScenario) -> dict[str, float]:
    """Every rank simulated, every collective's flows on the network (no fused passes)."""
    model, cfg, topo, device = inputs(s)
    topo = apply_profile(topo, device)
    grid = RankGrid(dp=cfg.dp, pp=cfg.pp, tp=cfg.tp)
    gloo = topo.fabric.backend is Backend.GLOO
    comms = Communicator(simpy.Environment(), topo)
    programs = [build_program(model, cfg, device, p, gloo, None) for p in range(cfg.pp)]
    Engine(programs, grid, comms, full=True, slowdown=s.stragglers or None).run()
    return {str(k): v for k, v in sorted(comms.network.bytes_by_link_class().items()) if v}


def record(name: str) -> dict[str, Any]:
    s = SCENARIOS[name]
    model, cfg, topo, device = inputs(s)
    report = simulate(model, cfg, topo, device, full=s.full, stragglers=s.stragglers or None)
    return {"step_time_s": report.step_time_s, "link_bytes": flow_by_flow_link_bytes(s)}


def main(names: list[str]) -> int:
    recorded = json.loads(OUTPUTS.read_text()) if OUTPUTS.exists() else {}
    for name in names or SCENARIOS:
        print(name, file=sys.stderr, flush=True)
        recorded[name] = record(name)
    recorded = {k: recorded[k] for k in SCENARIOS if k in recorded}
    OUTPUTS.write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
