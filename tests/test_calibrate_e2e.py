"""`zsim calibrate --quick` for real: two gloo ranks on this CPU, a tiny model, a valid profile."""

import json

import pytest

pytest.importorskip("torch", reason="calibration needs torch (the calibrate extra)")

from zsim.calibrate.measurement import Kind
from zsim.calibrate.profile import load_calibration, load_profile
from zsim.cli import main
from zsim.cluster.device import layer_time_key
from zsim.workload.model import LayerKind
from zsim.workload.model_presets import preset, with_overrides

TINY = "gpt-125m:layers=1,hidden=64,heads=2,seq-len=32,vocab=256"


@pytest.mark.e2e
def test_quick_calibration_on_two_cpu_ranks(tmp_path, capsys):
    out = tmp_path / "calibration" / "quick.json"
    argv = ["calibrate", "--quick", "--nproc", "2", "--model", TINY, "--micro-batches", "1"]
    argv += ["--launches", "2"]  # two worker processes, their samples merged
    assert main([*argv, "--out", str(out), "--no-progress"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert {p.name for p in out.parent.iterdir()} == {"quick.json", "quick.csv", "quick-fit.png"}

    profile = load_profile(out)
    cal = load_calibration(out)
    assert profile.backend == "gloo"
    assert cal.provenance["world_size"] == 2
    assert cal.provenance["launches"] == 2
    assert cal.provenance["torch_num_threads"] >= 1
    assert cal.provenance["topology"] == "1x2-cpu"
    rates = profile.rates["fp32"]
    assert 1e8 < rates.gemm_flops_per_s < 1e13  # a CPU core, give or take
    assert 1e8 < rates.memory_bytes_per_s < 1e12
    assert profile.optimizer_bytes_per_s > 0
    assert profile.host_link_bytes_per_s > 0
    # every layer of the model at the measured micro-batch, under the simulator's key
    model = with_overrides(preset("gpt-125m"), layers=1, hidden=64, heads=2, seq_len=32, vocab=256)
    for kind in (LayerKind.EMBEDDING, LayerKind.BLOCK, LayerKind.HEAD):
        time = profile.layer_time(layer_time_key(model, kind, 1, "fp32"))
        assert time is not None
        assert time.forward_s > 0
        assert time.backward_s > 0
    # the loopback link class and the per-call latency were fitted from the collectives
    assert set(profile.links) == {"loopback"}
    assert profile.call_latency_s is not None
    ops = {r.op for r in cal.measurements if r.kind is Kind.COLLECTIVE}
    assert ops == {
        "all_gather_into_tensor",
        "reduce_scatter_tensor",
        "all_reduce",
        "broadcast",
        "sendrecv",
    }
    raw = json.loads(out.read_text())
    # each launch measured its share (3 of the quick plan's 5 samples at least)
    assert all(len(r["samples_s"]) >= 6 for r in raw["measurements"])
    assert {"kind", "op", "fitted", "median_rel_err", "worst_rel_err"} <= set(
        raw["fit"]["residuals"][0]
    )
