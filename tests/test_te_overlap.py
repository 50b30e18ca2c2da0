"""TransformerEngine's SMs under --tp-comm-overlap, against its source: `initialize_ub`'s
defaults (transformer_engine/pytorch/module/base.py: "num_sm" 1 for ring_exchange layers and 16
otherwise, "use_ce" on), the GEMM launched on `sm_count - num_sm` SMs where the margin is on
(comm_gemm_overlap.cpp `_math_sms`), the comm kernel's num_sm CTAs of 1,024 threads holding
theirs where it is off (userbuffers.cu `SETUP_LAUNCH_CONFIG`)."""

import json
from dataclasses import replace

import pytest

from zsim.cli import main
from zsim.errors import InputError
from zsim.inputs import presets
from zsim.step.job import StageJob
from zsim.step.kernels import LayerKernels
from zsim.workload.layout import layer_passes
from zsim.workload.model_presets import preset
from zsim.workload.parallel import ParallelConfig
from zsim.workload.te_overlap import TE_DEFAULT_SMS, from_ub_cfgs

H100 = presets.gpu("h100-sxm")
MODEL = preset("gpt-1.3b")
BLOCK = next(x for x in MODEL.layer_list() if str(x.kind) == "block")
CFG = ParallelConfig(tp=8, sequence_parallel=True, micro_batch=4, tp_comm_overlap=True)


def test_te_defaults_reserve_16_sms_for_its_pipeline_and_bulk_layers():
    pipeline, bulk = (
        ["proj_fprop", "fc2_fprop"],
        ["qkv_dgrad", "qkv_wgrad", "fc1_dgrad", "fc1_wgrad"],
    )
    assert dict(TE_DEFAULT_SMS) == dict.fromkeys(pipeline + bulk, 16)


def test_a_config_file_sets_each_comm_kernels_sms_margin_or_not():
    # NVIDIA/dgxc-benchmarking nemo_megatron/gpt3_175b_hydra.yaml, ub_tp_comm_overlap_cfg: a
    # kernel of num_sm CTAs of 1,024 threads holds its SMs whether or not TE tells cuBLAS
    ub = {
        "qkv_dgrad": {"method": "bulk", "num_sm": 4, "set_sm_margin": 0},
        "proj_fprop": {"method": "pipeline", "num_sm": 24, "set_sm_margin": 1},
        "fc2_fprop": {"method": "pipeline", "num_sm": 20, "set_sm_margin": 1},
        "fc1_dgrad": {"method": "bulk", "num_sm": 2, "set_sm_margin": 0},
        "qkv_wgrad": {"method": "bulk", "num_sm": 8, "set_sm_margin": 0},
        "fc1_wgrad": {"method": "bulk", "num_sm": 4, "set_sm_margin": 0},
    }
    assert dict(from_ub_cfgs(ub)) == {
        "proj_fprop": 24,
        "fc2_fprop": 20,
        "qkv_dgrad": 4,
        "qkv_wgrad": 8,
        "fc1_dgrad": 2,
        "fc1_wgrad": 4,
    }
    # a layer it leaves out keeps TE's default
    assert dict(from_ub_cfgs({"qkv_dgrad": {"set_sm_margin": 0}}))["fc1_wgrad"] == 16
    # a ring exchange sends through the copy engines (use_ce, TE's default): no SMs; without
    # them its kernel's num_sm
    assert "qkv_fprop" not in dict(from_ub_cfgs({}))
    assert dict(from_ub_cfgs({"qkv_fprop": {"use_ce": False}}))["qkv_fprop"] == 1
    # ... or with a margin, which TE's GEMM keeps whatever carries the sends
    assert dict(from_ub_cfgs({"qkv_fprop": {"set_sm_margin": 1}}))["qkv_fprop"] == 1


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("tp_overlap_sms", {"attn_fprop": 16}),  # not a TE layer
        ("tp_overlap_sms.proj_fprop", {"proj_fprop": -1}),
        ("tp_overlap_sms", "abc"),
        ("tp_overlap_sms", [["proj_fprop"]]),
    ],
)
def test_bad_margins_name_the_field(field, value):
    with pytest.raises(InputError, match=field):
        replace(CFG, tp_overlap_sms=value)


def test_the_last_of_repeated_pairs_wins():
    assert replace(CFG, tp_overlap_sms=[("proj_fprop", 8), ("proj_fprop", 0)]).tp_overlap_sms == ()


@pytest.mark.parametrize(
    ("ub", "field"),
    [
        # zsim runs TE's default method of each layer: another one is refused, not ignored
        ({"qkv_dgrad": {"method": "ring_exchange"}}, "qkv_dgrad.method"),
        ({"proj_fprop": {"num_splits": 8}}, "proj_fprop.num_splits"),
        ({"proj_fprop": {"set_sm_margin": "false"}}, "proj_fprop.set_sm_margin"),
        ({"proj_fprop": {"num_sm": 2.5}}, "proj_fprop.num_sm"),
        ({"proj_fprop": 0}, "proj_fprop"),
    ],
)
def test_a_config_file_te_would_run_otherwise_is_refused(ub, field):
    with pytest.raises(InputError, match=f"tp_comm_overlap_cfg.{field}"):
        from_ub_cfgs(ub)


def _free(comm: object) -> float:
    """A TP collective that takes no time."""
    del comm
    return 0.0


def _backward(cfg: ParallelConfig) -> tuple[float, dict[str, float]]:
    """The block's backward with collectives that take no time: its ops back to back."""
    job = StageJob.of(MODEL, cfg, H100, 0, False)
    _, end = LayerKernels(job, _free).pass_template(BLOCK, False)
    ops = layer_passes(MODEL, cfg, BLOCK).backward
    return end, {op.name: H100.op_time_s(op, job.dtype) for op in ops}


def test_the_overlapped_gemms_run_on_the_sms_te_leaves_them():
    end, t = _backward(CFG)
    bulk = ("qkv_dgrad", "qkv_wgrad", "fc1_dgrad", "fc1_wgrad")
    slow = 132 / (132 - 16)  # the H100 SXM5's 132 SMs
    assert end == pytest.approx(sum(t.values()) + (slow - 1) * sum(t[g] for g in bulk), rel=1e-9)
    # TE 1.x: no margin, every GEMM on all SMs
    end, t = _backward(replace(CFG, tp_overlap_sms=()))
    assert end == pytest.approx(sum(t.values()), rel=1e-9)
    # and none without the overlap, or with the mechanism switched off (an ablation)
    end, t = _backward(replace(CFG, tp_comm_overlap=False))
    assert end == pytest.approx(sum(t.values()), rel=1e-9)
    end, t = _backward(replace(CFG, without={"te-sm-margins"}))
    assert end == pytest.approx(sum(t.values()), rel=1e-9)


def test_a_ring_exchanged_gemm_with_its_margin_on():
    # a ring_exchange layer with set_sm_margin on and num_sm 1 (the settings of the rs_cfg in
    # TE's userbuffers examples): its GEMM on 131 of the 132 SMs
    cfg = replace(CFG, tp_overlap_sms={"fc2_dgrad": 1})
    end, t = _backward(cfg)
    assert end == pytest.approx(sum(t.values()) + (132 / 131 - 1) * t["fc2_dgrad"], rel=1e-9)


def test_a_margin_of_every_sm_is_refused():
    cfg = replace(CFG, tp_overlap_sms={"proj_fprop": 132})
    with pytest.raises(InputError, match="fewer than the GPU's 132 SMs"):
        LayerKernels(StageJob.of(MODEL, cfg, H100, 0, False), _free).pass_template(BLOCK, True)


def test_a_run_says_when_the_margins_cannot_apply(tmp_path, capsys):
    ub = tmp_path / "ub.yaml"
    ub.write_text("proj_fprop: {num_sm: 24, set_sm_margin: 1}\n")
    argv = ["run", "--model", "gpt-125m", "--tp", "2", "--sequence-parallel", "--json"]
    # the flag's file without the flag itself
    assert main([*argv, "--topology", "1x8-dgx-h100", "--tp-comm-overlap-cfg", str(ub)]) == 0
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert "--tp-comm-overlap-cfg has no effect without --tp-comm-overlap" in notes
    # a device without an SM count (CPU ranks' profile)
    cpu = ["--profile", "calibration/cpu-2rank.json", "--precision", "fp32"]
    argv[2] = "gpt-125m:seq-len=256"  # to fit a CPU rank's memory
    assert main([*argv, "--topology", "1x2-cpu", *cpu, "--tp-comm-overlap"]) == 0
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert any("no SM count" in n for n in notes)
