"""ZeRO++'s qgZ (issue 18) against the ZeRO++ paper (Wang et al. 2023, section 4.3: int4
gradients, a hierarchical all-to-all in place of the reduce-scatter, a quarter of its bytes)
and DeepSpeed 0.19.8's source (`coalesced_collectives.all_to_all_quant_reduce`: per tensor,
values of 4 bits and one fp32 scale per group, `max(rows, columns, world)` groups within the
node and 1/L of them across; vectors and sizes that do not divide by 2 x world reduce-scattered
alone; stage3.py quantizes only when the world spans more than one node)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from zsim.cli import main
from zsim.inputs import presets
from zsim.plan.agreement import spearman
from zsim.plan.estimate import Estimator
from zsim.plan.space import Space, layouts
from zsim.simulation import Report, simulate
from zsim.workload.ds_config import from_ds_config, to_ds_config
from zsim.workload.model import ModelSpec
from zsim.workload.model_presets import preset
from zsim.workload.parallel import ParallelConfig, ZeroKnobs

EVERY_USE = {"max_reuse_distance": 0, "param_persistence_threshold": 0, "prefetch_bucket_size": 0}
MLP = replace(preset("toy-mlp"), bias=False)  # 8 x Linear(4096, 4096): matrices only
NODES, L = 4, 8  # 4x8-ethernet
W = NODES * L


def _step(model: ModelSpec, topology: str = "4x8-ethernet", **knobs: object) -> Report:
    cfg = ParallelConfig(
        dp=presets.topology(topology).world_size,
        zero_stage=3,
        micro_batch=2,
        knobs=ZeroKnobs(**EVERY_USE, **knobs),  # type: ignore[arg-type]
    )
    return simulate(model, cfg, presets.topology(topology), presets.gpu("a100-80gb"))


def _sent(report: Report) -> float:
    return report.traffic_bytes_per_gpu["grad_reduce"]


def _quantized_bytes(rows: int, columns: int) -> float:
    """What one GPU sends for one matrix: the node's all-to-all of int4 values and scales, then
    the 1/L share's across the nodes (an all-to-all keeps 1/n of its buffer)."""
    n, groups = rows * columns, max(rows, columns, W)
    within = (L - 1) / L * (n / 2 + 4 * groups)
    across = (NODES - 1) / NODES * (n / 2 / L + 4 * (groups // L))
    return within + across


def test_qgz_sends_a_quarter_of_the_gradient_bytes_plus_its_scales():
    h = MLP.hidden
    plain = MLP.layers * 2 * h * h * (W - 1) / W  # the fp16 ring reduce-scatter
    assert _sent(_step(MLP)) == pytest.approx(plain, rel=1e-6)
    quantized = _sent(_step(MLP, quantized_gradients=True))
    assert quantized == pytest.approx(MLP.layers * _quantized_bytes(h, h), rel=1e-6)
    # the paper's ratio: 4 bits for 16, (L-1)/2L + (n-1)/2nL = (W-1)/2W of the tensor, and
    # scales of 4 bytes per group, 8 x groups / elements on top
    assert quantized / plain == pytest.approx(0.25 * (1 + 8 * max(h, W) / (h * h)))


def test_vectors_are_reduce_scattered_alone_in_fp16():
    with_bias = preset("toy-mlp")  # each layer also has a bias of h elements
    h = with_bias.hidden
    # an 8 KB reduce-scatter alone: NCCL's tuner picks LL, whose 8-byte lines carry 4 bytes
    # of data (src/device/prims_ll.h), so twice its bytes go on the wire
    bias = 2 * 2 * (-(-h // W) * W) * (W - 1) / W
    expected = with_bias.layers * (_quantized_bytes(h, h) + bias)
    assert _sent(_step(with_bias, quantized_gradients=True)) == pytest.approx(expected, rel=1e-6)


def test_qgz_moves_only_the_second_all_to_all_across_nodes():
    # the gathers are the same with and without it: what leaves is the ring's crossings
    # (4 node boundaries, each over 2 ethernet links, of (W-1)/W of 2 bytes per element) and
    # what comes is the across all-to-all's (every GPU's (n-1)/n, over 2 links)
    h, layers = MLP.hidden, MLP.layers
    ring = layers * NODES * 2 * 2 * h * h * (W - 1) / W
    across = layers * W * 2 * (NODES - 1) / NODES * (h * h / 2 / L + 4 * (max(h, W) // L))
    plain = _step(MLP).link_traffic_bytes["ethernet"]
    quantized = _step(MLP, quantized_gradients=True).link_traffic_bytes["ethernet"]
    assert plain - quantized == pytest.approx(ring - across, rel=1e-6)


def test_one_node_reduce_scatters_as_plain_zero3():
    # stage3.py `__avg_scatter_grads`: the all-to-all path needs num_nodes > 1
    plain, quantized = _step(MLP, "1x8-nvlink"), _step(MLP, "1x8-nvlink", quantized_gradients=True)
    assert quantized.step_time_s == plain.step_time_s
    assert _sent(quantized) == _sent(plain)


def test_qgz_round_trips_through_a_ds_config_deepspeed_reads():
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    ds = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 3, "zero_quantized_gradients": True},
    }
    cfg = from_ds_config(ds, dp=32)
    assert cfg.knobs.quantized_gradients
    zero = to_ds_config(cfg)["zero_optimization"]
    assert DeepSpeedZeroConfig(**zero).zero_quantized_gradients
    assert cfg.zero_plus_plus == "qgZ"


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--topology", "2x8-ethernet", "--tp", "2"], "zero_quantized_gradients"),
        (["--topology", "2x8-ethernet", "--hpz", "4"], "zero_hpz_partition_size=4"),
        (["--topology", "2x8-ethernet", "--engine", "fsdp"], "zero_quantized_gradients"),
    ],
)
def test_layouts_qgz_cannot_run_are_refused_in_one_line(
    flags: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["run", "--model", "gpt-125m", "--stage", "3", "--quantized-gradients", *flags]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert needle in err
    assert err.count("\n") == 1


@pytest.mark.consistency
def test_the_closed_form_ranks_qgz_layouts_as_the_simulator_does():
    # ZeRO-3 and its ZeRO++ variants on two 4-GPU nodes over 100 GbE, micro-batches 1-4
    model, gpu, topo = (
        preset("gpt-350m"),
        presets.gpu("a100-80gb"),
        presets.topology("2x4-ethernet"),
    )
    found = layouts(model, 8, 4, 32, Space(max_micro_batch=4, recomputes=("none",), tps=(1,)))
    sample = [c for c in found if c.zero_stage == 3 and c.pp == 1]
    assert any(c.knobs.quantized_gradients for c in sample)
    estimator = Estimator(model, topo, gpu)
    closed = [estimator.estimate(c).step_s for c in sample]
    simulated = [simulate(model, c, topo, gpu).step_time_s for c in sample]
    assert spearman(closed, simulated) >= 0.95, (closed, simulated)
    assert all(abs(a / b - 1) < 0.1 for a, b in zip(closed, simulated, strict=True))
