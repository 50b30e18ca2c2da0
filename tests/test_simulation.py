"""The step simulator against closed forms, the seeds' traffic table and its own two modes."""

import dataclasses
from pathlib import Path

import pytest

from zsim.cluster.device import ComputeRates, DeviceProfile
from zsim.cluster.fabric import fabric_from_mapping
from zsim.cluster.topology import Topology, build_topology
from zsim.errors import InputError
from zsim.inputs import presets
from zsim.inputs.files import load_mapping
from zsim.inputs.presets import gpu_names
from zsim.simulation import simulate
from zsim.workload.model_presets import preset, with_overrides
from zsim.workload.parallel import (
    ParallelConfig,
    PipelineEngine,
    PipelineSchedule,
    Precision,
    ZeroKnobs,
    ZeroStage,
)
from zsim.workload.shapes import forward_flops

IDEAL_FILE = Path(__file__).parent / "data" / "ideal-8.yaml"
IDEAL = presets.topology(str(IDEAL_FILE))


def ideal(gpus: int) -> Topology:
    """The ideal switch of ideal-8.yaml with `gpus` GPUs on its one node (a job must fill its
    cluster)."""
    data = load_mapping(IDEAL_FILE, "topology")
    data.pop("nodes")
    data["gpus_per_node"] = gpus
    return build_topology(f"ideal-{gpus}", fabric_from_mapping(data, "ideal", gpu_names()), 1, gpus)


def flat_device(optimizer_bytes_per_s: float = 1e30) -> DeviceProfile:
    """A device whose kernel time is exactly FLOPs / 1e12 (no overheads, no memory term)."""
    rates = ComputeRates(1e12, 0.0, 1e12, 1e30, 0.0)
    return DeviceProfile(
        "flat", 80e9, 0.0, {"fp16": 1e12}, {"fp16": rates}, 1e30, optimizer_bytes_per_s
    )


MLP = with_overrides(preset("toy-mlp"), layers=16, hidden=1024)


def ideal_step(cfg: ParallelConfig) -> float:
    """m micro-batches, each forward + backward (3x forward FLOPs) of 1/p of the model."""
    return cfg.grad_accum * 3 * forward_flops(MLP, cfg.micro_batch) / cfg.pp / 1e12


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (4, 4), (8, 16)])
@pytest.mark.parametrize("schedule", [PipelineSchedule.GPIPE, PipelineSchedule.ONE_F_ONE_B])
def test_pipeline_bubble_matches_closed_form(p, m, schedule):
    # GPipe and 1F1B both idle (p-1)/(m+p-1) of the step (Narayanan et al. 2021, sec. 2.2)
    cfg = ParallelConfig(
        pp=p,
        grad_accum=m,
        micro_batch=2,
        pp_schedule=schedule,
        pipeline_engine=PipelineEngine.MEGATRON,
    )
    step = simulate(MLP, cfg, ideal(cfg.world_size), flat_device()).step_time_s
    bubble = (step - ideal_step(cfg)) / step
    assert bubble == pytest.approx((p - 1) / (m + p - 1), rel=1e-3)


@pytest.mark.parametrize(("p", "m", "v"), [(2, 4, 2), (4, 8, 2), (4, 8, 4)])
def test_interleaving_shrinks_bubble_by_v(p, m, v):
    # interleaved 1F1B: bubble time / ideal = (p-1)/(v m) (Narayanan et al. 2021, sec. 2.2.2)
    cfg = ParallelConfig(
        pp=p,
        grad_accum=m,
        micro_batch=2,
        virtual_stages=v,
        pp_schedule=PipelineSchedule.INTERLEAVED,
        pipeline_engine=PipelineEngine.MEGATRON,
    )
    step = simulate(MLP, cfg, ideal(cfg.world_size), flat_device()).step_time_s
    best = ideal_step(cfg)
    assert (step - best) / best == pytest.approx((p - 1) / (v * m), rel=1e-3)


def slow_switch(gpus: int, gbytes_per_s: float) -> Topology:
    """The ideal switch with a finite NVSwitch rate: a send of n bytes takes n / rate."""
    data = load_mapping(IDEAL_FILE, "topology")
    data.pop("nodes")
    data["gpus_per_node"] = gpus
    data["nvswitch"]["bandwidth_GBps"] = gbytes_per_s
    return build_topology("slow", fabric_from_mapping(data, "slow", gpu_names()), 1, gpus)


@pytest.mark.parametrize("blocking", [True, False])
def test_megatron_1f1b_sends_block_the_schedule(blocking):
    """Megatron's `_communicate` waits on its batched isend/irecv and calls
    torch.cuda.synchronize() (non-interleaved schedules). pp 2, 2 micro-batches, forward f,
    backward 2f, a send S < f, worked by hand: stage 0 runs F0, sends, F1, sends, then B0 at
    grad0's arrival and B1 at grad1's; stage 1 runs F0 at act0's arrival, B0, and, blocking,
    sends grad0 before F1, then B1 and sends grad1: 9f + 3S. Sends beside compute: 9f + 2S."""
    cfg = ParallelConfig(pp=2, grad_accum=2, micro_batch=2, pipeline_engine=PipelineEngine.MEGATRON)
    cfg = cfg if blocking else dataclasses.replace(cfg, without=frozenset({"blocking-p2p"}))
    f = forward_flops(MLP, cfg.micro_batch) / cfg.pp / 1e12
    send = cfg.micro_batch * MLP.hidden * 2 / 0.25e9  # one fp16 activation at 0.25 GB/s
    step = simulate(MLP, cfg, slow_switch(2, 0.25), flat_device()).step_time_s
    assert step == pytest.approx(9 * f + (3 if blocking else 2) * send, rel=1e-6)


def traffic_in_params(stage, knobs=None, dp=8):
    # the seeds count data bytes: NCCL forced to Simple (NCCL_PROTO=Simple), whose wire bytes
    # are its data (LL, picked for small calls, sends a 4-byte flag with every 4 data bytes)
    model = preset("gpt-350m")
    nvlink = presets.topology("1x8-nvlink")
    topo = dataclasses.replace(nvlink, fabric=dataclasses.replace(nvlink.fabric, protocol="simple"))
    cfg = ParallelConfig(dp=dp, zero_stage=stage, knobs=knobs or ZeroKnobs())
    report = simulate(model, cfg, topo, presets.gpu("a100-80gb"))
    param_bytes = model.total_params() * 2
    return sum(report.traffic_bytes_per_gpu.values()) / param_bytes


def test_traffic_plain_dp_is_2_psi():
    # a ring all-reduce sends 2(n-1)/n of the buffer from every GPU (the seeds' 2Ψ)
    assert traffic_in_params(ZeroStage.NONE) == pytest.approx(2 * 7 / 8, rel=0.01)


@pytest.mark.parametrize("stage", [ZeroStage.OPTIMIZER, ZeroStage.GRADIENTS])
def test_traffic_zero12_reduce_to_owner_is_2_psi(stage):
    # with reduce-to-owner buckets (use_multi_rank_bucket_allreduce=false) ZeRO-1/2 move the
    # seeds' 2Ψ: a reduce-scatter's worth of reduces plus one all-gather, (n-1)/n each
    knobs = ZeroKnobs(use_multi_rank_bucket_allreduce=False)
    assert traffic_in_params(stage, knobs) == pytest.approx(2 * 7 / 8, rel=0.02)


@pytest.mark.parametrize("stage", [ZeroStage.OPTIMIZER, ZeroStage.GRADIENTS])
def test_traffic_zero12_deepspeed_default_all_reduces(stage):
    # DeepSpeed 0.19's default all-reduces each bucket whole, then all-gathers: 3Ψ (n-1)/n
    assert traffic_in_params(stage) == pytest.approx(3 * 7 / 8, rel=0.01)


def test_traffic_zero3_is_3_psi_when_released():
    # seeds: forward all-gather Ψ + backward all-gather Ψ + reduce-scatter Ψ, when every
    # parameter is released after its forward use and nothing is prefetched, as DeepSpeed
    # does with stage3_max_reuse_distance = stage3_max_live_parameters = 0 (traced)
    knobs = ZeroKnobs(max_reuse_distance=0, max_live_parameters=0, param_persistence_threshold=0)
    assert traffic_in_params(ZeroStage.PARAMETERS, knobs) == pytest.approx(3 * 7 / 8, rel=0.01)


def test_traffic_zero3_reuse_distance_skips_backward_gathers():
    # with a reuse window larger than the model nothing is released before backward: 2Ψ
    knobs = ZeroKnobs(max_reuse_distance=10**12, param_persistence_threshold=0)
    assert traffic_in_params(ZeroStage.PARAMETERS, knobs) == pytest.approx(2 * 7 / 8, rel=0.01)


@pytest.mark.consistency
@pytest.mark.parametrize(
    ("topology", "cfg"),
    [
        ("1x8-nvlink", ParallelConfig(dp=4, tp=2, zero_stage=ZeroStage.PARAMETERS)),
        ("2x4-ib", ParallelConfig(dp=2, tp=2, pp=2, grad_accum=4, zero_stage=ZeroStage.OPTIMIZER)),
        ("2x4-ethernet", ParallelConfig(dp=8, zero_stage=ZeroStage.GRADIENTS, grad_accum=2)),
    ],
)
def test_symmetric_and_full_modes_agree(topology, cfg):
    model = with_overrides(preset("gpt-125m"), layers=4, seq_len=512)
    topo = presets.topology(topology)
    device = presets.gpu(topo.gpu_model or "a100-80gb")
    fast = simulate(model, cfg, topo, device)
    full = simulate(model, cfg, topo, device, full=True)
    assert fast.step_time_s == pytest.approx(full.step_time_s, rel=1e-9)
    assert len(full.engine.simulated_ranks) == cfg.world_size


def test_layout_refusals():
    from zsim.errors import InputError

    with pytest.raises(InputError, match="pipeline"):
        ParallelConfig(pp=2, zero_stage=ZeroStage.GRADIENTS)
    with pytest.raises(InputError, match="precision"):
        flat_device().rates_for(str(Precision.BF16))


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (4, 4)])
def test_deepspeed_pipeline_bubble(p, m):
    # DeepSpeed's TrainSchedule is a synchronous 1F1B: the same (p-1)/(m+p-1) bubble when
    # communication is free
    cfg = ParallelConfig(pp=p, grad_accum=m, micro_batch=2)
    step = simulate(MLP, cfg, ideal(cfg.world_size), flat_device()).step_time_s
    assert (step - ideal_step(cfg)) / step == pytest.approx((p - 1) / (m + p - 1), rel=1e-3)


def test_only_a_model_with_a_tied_embedding_reduces_it_between_first_and_last_stage():
    """DeepSpeed's `allreduce_tied_weight_gradients` and Megatron's embedding all-reduce run
    over tied weights; the seeds' MLP (no vocabulary) has none, a GPT ties its embedding."""
    cfg = ParallelConfig(pp=2, grad_accum=2, micro_batch=2)
    gpt = with_overrides(preset("gpt-125m"), layers=2)
    for model, expected in [(MLP, 0), (gpt, 2)]:  # the GPT's: one on each end stage
        spans = simulate(model, cfg, ideal(2), flat_device()).engine.all_spans()
        assert sum(s.name.endswith("tied_embedding_allreduce") for s in spans) == expected


def test_a_straggler_sets_the_step_of_every_rank_it_syncs_with():
    # on a network where communication costs nothing, a data-parallel step is compute then
    # a blocking all-reduce: the step waits for the slowest rank, f x slower (f x the step)
    topo = presets.topology(str(Path(__file__).parent / "data" / "ideal-8.yaml"))
    model, cfg = preset("gpt-125m"), ParallelConfig(dp=8, micro_batch=2)
    gpu = presets.gpu("a100-80gb")
    base = simulate(model, cfg, topo, gpu, full=True).step_time_s
    slow = simulate(model, cfg, topo, gpu, full=True, stragglers={5: 1.25}).step_time_s
    assert slow == pytest.approx(1.25 * base, rel=1e-6)


def test_stragglers_need_every_rank_simulated_and_a_real_rank():
    topo = presets.topology("2x4-ethernet")
    model, cfg, gpu = preset("gpt-125m"), ParallelConfig(dp=8), presets.gpu("a100-80gb")
    for kwargs, needle in (
        ({"stragglers": {1: 2.0}}, "--full"),
        ({"full": True, "stragglers": {8: 2.0}}, "a rank in 0..7"),
        ({"full": True, "stragglers": {1: 0.5}}, ">= 1"),
    ):
        with pytest.raises(InputError, match=needle):
            simulate(model, cfg, topo, gpu, **kwargs)
