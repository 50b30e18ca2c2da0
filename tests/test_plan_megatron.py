"""The planner over Megatron-Core's own layouts (`--engine megatron`): its DDP and distributed
optimizer, context parallelism and FP8 as the frameworks allow them, the closed form against
the simulator, and the winner emitted as Megatron-Core's flags."""

from __future__ import annotations

import pytest

from zsim.cli import main
from zsim.inputs import presets
from zsim.plan.agreement import spearman
from zsim.plan.estimate import Estimator
from zsim.plan.space import Space, layouts
from zsim.simulation import simulate
from zsim.workload.model_presets import preset, with_overrides
from zsim.workload.parallel import DpEngine, ZeroStage

LONG = with_overrides(preset("llama-7b"), seq_len=16384, layers=8)


def _megatron(world: int, node: int, batch: int, **space: object) -> list:
    chosen = Space(engines=(DpEngine.MEGATRON,), cps=(1, 2, 4), **space)  # type: ignore[arg-type]
    return list(layouts(LONG, world, node, batch, chosen))


def test_megatron_core_layouts_are_its_ddp_and_distributed_optimizer_with_cp():
    found = _megatron(16, 8, 32, max_micro_batch=2, recomputes=("none",))
    assert found
    assert all(c.dp_engine is DpEngine.MEGATRON for c in found)
    assert {c.zero_stage for c in found} == {ZeroStage.NONE, ZeroStage.OPTIMIZER}
    assert {c.cp for c in found} == {1, 2, 4}
    # every GPU used: dp x tp x pp x cp = 16, the batch counting dp only
    assert all(c.world_size == 16 and c.global_batch == 32 for c in found)
    # --overlap-param-gather only with the distributed optimizer
    assert all(c.overlap_param_gather == (c.zero_stage is ZeroStage.OPTIMIZER) for c in found)
    # without its engine the planner searches no context parallelism
    plain = layouts(LONG, 16, 8, 32, Space(cps=(1, 2, 4), max_micro_batch=2))
    assert all(c.cp == 1 and c.dp_engine is not DpEngine.MEGATRON for c in plain)


@pytest.mark.consistency
def test_the_closed_form_ranks_megatron_layouts_as_the_simulator_does():
    # with and without TP, CP and the distributed optimizer, one node and two
    model, gpu = LONG, presets.gpu("h100-sxm")
    topo = presets.topology("2x8-dgx-h100")
    found = _megatron(16, 8, 32, max_micro_batch=2, recomputes=("full",))
    sample = [c for c in found if c.pp == 1][::3][:10]
    assert {c.cp for c in sample} >= {1, 2}
    estimator = Estimator(model, topo, gpu)
    closed = [estimator.estimate(c).step_s for c in sample]
    simulated = [simulate(model, c, topo, gpu).step_time_s for c in sample]
    assert spearman(closed, simulated) >= 0.9, (closed, simulated)
    assert all(abs(a / b - 1) < 0.15 for a, b in zip(closed, simulated, strict=True))


def test_a_megatron_winner_is_emitted_as_its_flags(capsys, tmp_path):
    argv = "--model llama-7b:seq-len=16384,layers=8 --topology 2x8-dgx-h100 --global-batch 32"
    argv += " --simulate 1 --engine megatron --cp 2 --tp 1 --pp 1 --precision fp8"
    code = main(["plan", *argv.split(), "--emit", str(tmp_path)])
    capsys.readouterr()
    assert code == 0
    assert not (tmp_path / "ds_config.json").exists()  # Megatron-Core takes flags
    launch = (tmp_path / "launch.sh").read_text()
    assert "--context-parallel-size 2" in launch
    assert "--fp8-format hybrid" in launch
    assert "--deepspeed" not in launch


def test_fp8_is_planned_only_under_megatron_core(capsys):
    argv = "--model gpt-125m --topology 1x8-dgx-h100 --global-batch 8 --precision fp8"
    assert main(["plan", *argv.split()]) == 2
    assert "megatron" in capsys.readouterr().err


def test_ddp_steps_every_parameter_and_the_distributed_optimizer_a_shard():
    # Megatron's DDP (ZeRO-0) runs Adam on all of a rank's parameters, its distributed
    # optimizer on 1 / (dp x cp) of them: 16 ranks, so about 16x apart
    topo, gpu = presets.topology("2x8-dgx-h100"), presets.gpu("h100-sxm")
    found = _megatron(16, 8, 32, max_micro_batch=1, recomputes=("none",))
    pick = {c.zero_stage: c for c in found if c.tp == c.pp == c.cp == 1}
    estimator = Estimator(LONG, topo, gpu)
    ddp, dist_opt = (estimator.estimate(pick[s]).optimizer_s for s in ZeroStage if s in pick)
    assert ddp / dist_opt > 10


def test_a_pipeline_send_is_estimated_at_its_cp_share():
    # a stage's activation message holds the rank's s / cp tokens: the send of a cp 4 layout
    # must not reuse the cp 1 layout's estimate
    topo, gpu = presets.topology("2x8-dgx-h100"), presets.gpu("h100-sxm")
    found = _megatron(16, 8, 32, max_micro_batch=1, recomputes=("none",))
    pp2 = {c.cp: c for c in found if c.pp == 2 and c.tp == 1 and c.zero_stage}
    warm = Estimator(LONG, topo, gpu)
    warm.estimate(pp2[1])
    fresh = Estimator(LONG, topo, gpu).estimate(pp2[4]).bubble_s
    assert warm.estimate(pp2[4]).bubble_s == pytest.approx(fresh)


def _flags(lines: list[str]) -> dict[str, str]:
    """The launch script's `--flag [value]` pairs (a switch maps to "")."""
    words = " ".join(line.strip().rstrip("\\") for line in lines).split()
    found: dict[str, str] = {}
    for i, word in enumerate(words):
        if word.startswith("--"):
            nxt = words[i + 1] if i + 1 < len(words) else "--"
            found[word] = "" if nxt.startswith("--") else nxt
    return found


def _megatron_params(f: dict[str, str], vocab: int) -> int:
    """A dense GPT's parameters from its flags, as Megatron-LM's
    `training/theoretical_memory_usage.compute_weight_and_optimizer_memory` counts them."""
    h, heads = int(f["--hidden-size"]), int(f["--num-attention-heads"])
    groups = int(f["--num-query-groups"]) if "--group-query-attention" in f else heads
    gated = 3 / 2 if "--swiglu" in f else 1
    norm = 1 if f.get("--normalization") == "RMSNorm" else 2
    attention = 2 * h * h * (1 + groups / heads)
    mlp = 2 * h * int(f["--ffn-hidden-size"]) * gated
    layer = attention + mlp + 2 * h * norm
    embeddings = (2 if "--untie-embeddings-and-output-weights" in f else 1) * h * vocab
    return int(int(f["--num-layers"]) * layer + embeddings + norm * h)


def test_megatron_cores_flags_build_the_planned_model():
    # Llama 2 70B: Meta's count (HF config, vocab 32,000) 68,976,648,192 parameters; the
    # flags must describe that model to Megatron-LM (GQA, SwiGLU, RMSNorm, untied head)
    from zsim.plan.emit import launch_lines
    from zsim.workload.parallel import ParallelConfig, PipelineEngine, Precision, Recompute

    model = preset("llama-70b")
    cfg = ParallelConfig(
        dp=2,
        tp=8,
        pp=4,
        dp_engine=DpEngine.MEGATRON,
        pipeline_engine=PipelineEngine.MEGATRON,
        zero_stage=ZeroStage.OPTIMIZER,
        precision=Precision.BF16,
        recompute=Recompute.FULL,
        micro_batch=1,
        grad_accum=8,
    )
    flags = _flags(launch_lines(model, cfg, nodes=8, gpus_per_node=8))
    assert _megatron_params(flags, vocab=32000) == 68_976_648_192
    assert flags["--position-embedding-type"] == "rope"
    assert flags["--attention-dropout"] == flags["--hidden-dropout"] == "0"
    assert "--disable-bias-linear" in flags
    # Megatron-Core raises on full recompute without a layer count (TransformerConfig)
    assert flags["--recompute-num-layers"] == "1"


def test_megatron_deepspeeds_flags_name_the_same_model_its_way():
    # deepspeedai/Megatron-DeepSpeed's arguments.py: --num-key-value-heads, lower-case norm
    from zsim.plan.emit import launch_lines
    from zsim.workload.parallel import ParallelConfig, Precision

    cfg = ParallelConfig(dp=8, tp=8, zero_stage=ZeroStage.OPTIMIZER, precision=Precision.BF16)
    flags = _flags(launch_lines(preset("llama-70b"), cfg, nodes=8, gpus_per_node=8))
    assert flags["--num-key-value-heads"] == "8"
    assert flags["--normalization"] == "rmsnorm"
    assert "--use-rotary-position-embeddings" in flags
    assert "--group-query-attention" not in flags
    assert flags["--deepspeed_config"] == "ds_config.json"


@pytest.mark.consistency
def test_the_closed_form_charges_fp8_amax_reductions_as_the_simulator_does():
    # 2 x micro-batches x chunks blocking all-reduces over the stage's 8 ranks (2 nodes):
    # what they add to the step in the closed form and in the simulation, within 25 %
    from dataclasses import replace

    from zsim.workload.parallel import ParallelConfig, PipelineEngine

    model = with_overrides(preset("llama-7b"), layers=8, seq_len=2048)
    topo, gpu = presets.topology("2x8-dgx-h100"), presets.gpu("h100-sxm")
    cfg = ParallelConfig(
        dp=4,
        tp=2,
        pp=2,
        zero_stage=ZeroStage.OPTIMIZER,
        precision="fp8",
        dp_engine=DpEngine.MEGATRON,
        pipeline_engine=PipelineEngine.MEGATRON,
        pp_schedule="interleaved",
        virtual_stages=2,
        grad_accum=8,
        flash_attention=True,
        sequence_parallel=True,
    )
    off = replace(cfg, without=frozenset({"fp8-amax"}))
    closed = Estimator(model, topo, gpu).estimate(cfg).step_s
    closed -= Estimator(model, topo, gpu).estimate(off).step_s
    simulated = simulate(model, cfg, topo, gpu).step_time_s
    simulated -= simulate(model, off, topo, gpu).step_time_s
    assert simulated > 0
    assert closed == pytest.approx(simulated, rel=0.25)
