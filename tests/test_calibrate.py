"""Calibration without measuring: the fit against synthetic data from known parameters, the
profile file (round trip, validation, sampling), and the command's refusals."""

import json
from dataclasses import replace

import numpy as np
import pytest

from zsim.calibrate.fit import fit_profile, residuals
from zsim.calibrate.plan import Kind, Measurement, Plan, default_plan, merge, merge_launches
from zsim.calibrate.profile import (
    Calibration,
    load_calibration,
    load_profile,
    sample_profiles,
    save_profile,
)
from zsim.cli import main
from zsim.cluster.device import ADAM_STEP_BYTES_PER_PARAM, layer_time_key, model_signature
from zsim.errors import InputError
from zsim.workload.model import LayerKind
from zsim.workload.model_presets import preset, with_overrides

MIB = 2**20
INFO = {"memory_bytes": 8e9, "reserved_bytes": 1e8, "backend": "gloo", "cache_bytes": 32 * MIB}

# the "true" device the synthetic measurements come from
GEMM_RATE, GEMM_OVERHEAD = 80e9, 6e-6  # FLOP/s, s
MEM_RATE, MEM_OVERHEAD = 9e9, 3e-6  # B/s, s
ATTN_RATE = 30e9
COPY_RATE = 7e9
ADAM_PARAMS_PER_S = 90e6


def synthetic_rows(noise=0.0, seed=0, repeats=9):
    """Measurements from closed forms written here (t = overhead + work / rate), with
    multiplicative noise per repeat."""
    rng = np.random.default_rng(seed)

    def samples(t):
        return tuple(float(t * (1 + noise * rng.standard_normal())) for _ in range(repeats))

    rows = []
    for s in (16, 32, 64, 128, 256, 512, 1024):
        flops = 2.0 * s**3
        rows.append(
            Measurement(
                Kind.GEMM,
                "mm",
                "fp32",
                samples(GEMM_OVERHEAD + flops / GEMM_RATE),
                flops=flops,
                shape=(s, s, s, 1),
            )
        )
    for size in (1024, 4096, 256 * MIB, 768 * MIB):
        rows.append(
            Measurement(
                Kind.MEMORY, "add", "fp32", samples(MEM_OVERHEAD + size / MEM_RATE), size_bytes=size
            )
        )
    for f in (1e8, 4e8, 1.6e9):
        rows.append(
            Measurement(
                Kind.ATTENTION,
                "sdpa",
                "fp32",
                samples(GEMM_OVERHEAD + f / ATTN_RATE),
                flops=f,
                micro_batch=1,
            )
        )
    for size in (64 * MIB, 256 * MIB):
        rows.append(
            Measurement(
                Kind.HOST_COPY, "memcpy", "fp32", samples(size / COPY_RATE), size_bytes=size
            )
        )
    for p in (2**22, 2**24):
        rows.append(
            Measurement(Kind.OPTIMIZER, "adamw", "fp32", samples(p / ADAM_PARAMS_PER_S), params=p)
        )
    key = layer_time_key(preset("toy-mlp"), LayerKind.LINEAR, 4, "fp32")
    rows.append(Measurement(Kind.LAYER_FORWARD, "linear", "fp32", samples(1e-3), layer_key=key))
    rows.append(Measurement(Kind.LAYER_BACKWARD, "linear", "fp32", samples(2e-3), layer_key=key))
    return tuple(rows)


def test_fit_recovers_compute_parameters_exactly():
    fit = fit_profile("synthetic", synthetic_rows(), INFO)
    rates = fit.profile.rates["fp32"]
    assert rates.gemm_flops_per_s == pytest.approx(GEMM_RATE, rel=1e-9)
    assert rates.gemm_overhead_s == pytest.approx(GEMM_OVERHEAD, rel=1e-9)
    assert rates.memory_bytes_per_s == pytest.approx(MEM_RATE, rel=1e-9)
    assert rates.memory_overhead_s == pytest.approx(MEM_OVERHEAD, rel=1e-9)
    assert rates.attention_flops_per_s == pytest.approx(ATTN_RATE, rel=1e-9)
    assert fit.profile.host_link_bytes_per_s == pytest.approx(COPY_RATE, rel=1e-9)
    assert fit.profile.host_adam_params_per_s == pytest.approx(ADAM_PARAMS_PER_S, rel=1e-9)
    assert fit.profile.optimizer_bytes_per_s == pytest.approx(
        ADAM_PARAMS_PER_S * ADAM_STEP_BYTES_PER_PARAM, rel=1e-9
    )
    assert fit.profile.memory_bytes == 8e9
    assert all(r.worst_rel_err < 1e-9 for r in fit.residuals)


def test_fit_recovers_compute_parameters_through_noise():
    fit = fit_profile("synthetic", synthetic_rows(noise=0.03, seed=4), INFO)
    rates = fit.profile.rates["fp32"]
    assert rates.gemm_flops_per_s == pytest.approx(GEMM_RATE, rel=0.05)
    assert rates.gemm_overhead_s == pytest.approx(GEMM_OVERHEAD, rel=0.15)
    assert rates.memory_bytes_per_s == pytest.approx(MEM_RATE, rel=0.05)
    assert fit.profile.host_adam_params_per_s == pytest.approx(ADAM_PARAMS_PER_S, rel=0.05)


def one_gpu_rows():
    """What the CUDA worker writes for one H200-like GPU (bf16, no collectives: one rank),
    from closed forms written here: GEMMs, HBM-streaming adds beyond 4x a 60 MB L2, pinned
    host<->device copies both ways, fused AdamW on the GPU and torch AdamW on the host."""
    gemm_rate, gemm_overhead, hbm_rate, pcie_rate = 700e12, 8e-6, 4.0e12, 50e9
    rows = [
        Measurement(
            Kind.GEMM,
            "mm",
            "bf16",
            (gemm_overhead + 2.0 * s**3 / gemm_rate,) * 5,
            flops=2.0 * s**3,
            shape=(s, s, s, 1),
        )
        for s in (256, 1024, 4096, 8192)
    ]
    rows += [
        Measurement(Kind.MEMORY, "add", "bf16", (3e-6 + moved / hbm_rate,) * 5, size_bytes=moved)
        for moved in (192, 768, 3 * 256 * MIB, 3 * 1024 * MIB)
    ]
    rows += [
        Measurement(Kind.HOST_COPY, op, "fp32", (size / pcie_rate,) * 5, size_bytes=size)
        for op in ("h2d", "d2h")
        for size in (64 * MIB, 256 * MIB)
    ]
    rows += [
        Measurement(Kind.OPTIMIZER, op, "fp32", (p / rate,) * 5, params=p)
        for op, rate in (("adamw", 20e9), ("host_adamw", 400e6))
        for p in (2**24, 2**25)
    ]
    info = {
        "memory_bytes": 141e9,
        "reserved_bytes": 0.5e9,
        "backend": "nccl",
        "cache_bytes": 60e6,
        "topology": "1x1-nvlink",
    }
    truth = {"gemm": (gemm_rate, gemm_overhead), "hbm": hbm_rate, "pcie": pcie_rate}
    return tuple(rows), info, truth


def test_a_one_gpu_calibration_fits_and_drives_the_simulator(tmp_path, capsys):
    rows, info, truth = one_gpu_rows()
    fit = fit_profile("h200-synthetic", rows, info)
    prof = fit.profile
    rates = prof.rates["bf16"]
    assert (rates.gemm_flops_per_s, rates.gemm_overhead_s) == pytest.approx(truth["gemm"])
    assert rates.memory_bytes_per_s == pytest.approx(truth["hbm"])
    assert prof.host_link_bytes_per_s == pytest.approx(truth["pcie"])
    assert prof.host_adam_params_per_s == pytest.approx(400e6)
    assert prof.backend == "nccl"
    assert not prof.links  # one rank: no link measured
    cal = Calibration("h200-synthetic", prof, rows, fit.residuals, provenance=info)
    save_profile(cal, tmp_path / "h200.json")
    argv = ["run", "--profile", str(tmp_path / "h200.json"), "--model", "gpt-1.3b"]
    argv += ["--topology", "1x8-nvlink", "--stage", "3", "--precision", "bf16"]
    assert main([*argv, "--flash-attention", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    # Megatron-LM's FLOPs of a step (Narayanan et al., SC'21, "Efficient Large-Scale Language
    # Model Training on GPU Clusters Using Megatron-LM"): 96 B s l h^2 (1 + s / 6h + V / 16lh)
    # with recomputation, i.e. 72 B s l h^2 (1 + s / 6h + V / 12lh) without. At the fitted GEMM
    # rate they bound a GPU's compute from below; the memory-bound kernels at the HBM rate add
    # well under half again
    m = preset("gpt-1.3b")
    b, s, layers, h, v = out["parallel"]["micro_batch"], m.seq_len, m.layers, m.hidden, m.vocab
    flops = 72 * b * s * layers * h * h * (1 + s / (6 * h) + v / (12 * h * layers))
    floor_s = flops / truth["gemm"][0]
    assert floor_s < out["compute_s"] < 1.5 * floor_s


def test_memory_sizes_served_from_cache_are_reported_not_fitted():
    # a 4 MiB add runs from cache, 4x faster than DRAM: measured and reported, not fitted
    fast = Measurement(
        Kind.MEMORY, "add", "fp32", (4 * MIB / (4 * MEM_RATE),) * 3, size_bytes=4 * MIB
    )
    fit = fit_profile("synthetic", (*synthetic_rows(), fast), INFO)
    assert fit.profile.rates["fp32"].memory_bytes_per_s == pytest.approx(MEM_RATE, rel=1e-9)
    outside = [r for r in fit.residuals if r.kind == "memory" and not r.fitted]
    assert len(outside) == 1
    assert outside[0].worst_rel_err == pytest.approx(3.0, rel=0.01)


def calibration(rows=None):
    rows = rows or synthetic_rows(noise=0.05, seed=1)
    fit = fit_profile("synthetic", rows, INFO)
    return Calibration("synthetic", fit.profile, rows, fit.residuals, provenance=INFO)


def test_profile_round_trip(tmp_path):
    cal = calibration()
    written = save_profile(cal, tmp_path / "p.json")
    assert [p.name for p in written] == ["p.json", "p.csv"]
    assert load_profile(tmp_path / "p.json") == cal.profile
    back = load_calibration(tmp_path / "p.json")
    assert back.measurements == cal.measurements
    assert back.residuals == cal.residuals
    csv_lines = (tmp_path / "p.csv").read_text().splitlines()
    assert len(csv_lines) == 1 + len(cal.measurements)


def test_sample_profiles_follow_the_measured_spread(tmp_path):
    cal = calibration()
    save_profile(cal, tmp_path / "p.json")
    draws = sample_profiles(tmp_path / "p.json", 20, seed=7)
    again = sample_profiles(cal, 20, seed=7)
    assert draws == again  # deterministic for a seed, from a path or an object
    rates = np.array([d.rates["fp32"].gemm_flops_per_s for d in draws])
    assert len(set(rates.tolist())) > 10  # they differ
    # the bootstrap spread of a median of 9 samples with 5% noise: a few percent
    assert 0.002 < rates.std() / rates.mean() < 0.05
    assert abs(rates.mean() / GEMM_RATE - 1) < 0.05


def test_sampled_profiles_draw_whole_launches_first():
    # host copies measured in 3 launches, 1% noise within each; one launch ran at half speed.
    # Repeats within a launch are not independent: the band must cover a draw of the slow one.
    rng = np.random.default_rng(5)

    def launch(size: float, factor: float) -> list[Measurement]:
        t = factor * size / COPY_RATE
        return [
            Measurement(
                Kind.HOST_COPY,
                "memcpy",
                "fp32",
                tuple(t * (1 + 0.01 * rng.standard_normal(20))),
                size_bytes=size,
            )
        ]

    copies = [
        merge_launches([launch(size, f) for f in (1.0, 1.0, 2.0)])[0]
        for size in (64 * MIB, 256 * MIB)
    ]
    rows = tuple(r for r in synthetic_rows() if r.kind is not Kind.HOST_COPY) + tuple(copies)
    fit = fit_profile("launches", rows, INFO)
    clustered = Calibration("launches", fit.profile, rows, provenance=INFO)
    flat = Calibration(
        "flat", fit.profile, tuple(replace(r, launch_samples=()) for r in rows), provenance=INFO
    )
    spread = {}
    for cal in (clustered, flat):
        rates = [d.host_link_bytes_per_s for d in sample_profiles(cal, 60, seed=3)]
        spread[cal.name] = np.percentile(rates, 95) / np.percentile(rates, 5)
    # iid repeats: 2 of 3 launches fast, so nearly every resample's median is a fast one
    assert spread["flat"] < 1.05
    # whole launches: 7 in 27 draws hold the slow launch twice or more, and their median is slow
    assert spread["launches"] > 1.5


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda d: d.pop("device"), "device"),
        (lambda d: d["device"].pop("memory_bytes"), "memory_bytes"),
        (lambda d: d["device"]["rates"]["fp32"].update(gemm_flops_per_s=-1), "gemm_flops_per_s"),
        (lambda d: d["device"].update(links={"loopback": {"latency_s": 1e-5}}), "bandwidth"),
        (lambda d: d.update(zsim_profile=99), "zsim_profile"),
        (lambda d: d["measurements"][0].update(kind="gpu"), "kind"),
        (lambda d: d["measurements"][0].update(launch_samples=["a"]), "launch_samples"),
        (lambda d: d["measurements"][0].update(samples_s=[]), "samples_s"),
    ],
)
def test_malformed_profile_is_one_line_and_exit_2(tmp_path, capsys, mutate, needle):
    save_profile(calibration(), tmp_path / "p.json")
    data = json.loads((tmp_path / "p.json").read_text())
    mutate(data)
    (tmp_path / "p.json").write_text(json.dumps(data))
    with pytest.raises(InputError, match=needle):
        load_profile(tmp_path / "p.json")
    assert main(["profile", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert needle in err


def test_not_json_is_exit_2(tmp_path, capsys):
    (tmp_path / "p.json").write_text("{not json")
    assert main(["profile", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("zsim: error: profile=")
    assert err.count("\n") == 1


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--device", "cuda"], "device='cuda'"),
        (["--device", "tpu"], "device='tpu'"),
        (["--precision", "fp8"], "precision='fp8'"),
        (["--nproc", "0"], "nproc"),
        (["--model", "gpt-9"], "model='gpt-9'"),
        (["--model", "gpt-125m:depth=3"], "model="),
        (["--micro-batches", "1,x"], "micro_batches"),
        (["--launches", "0"], "launches='0'"),
    ],
)
def test_bad_calibrate_input_is_one_line_and_exit_2(tmp_path, capsys, argv, needle):
    out = tmp_path / "cal" / "p.json"
    assert main(["calibrate", *argv, "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert needle in err
    assert err.count("\n") == 1
    assert not out.parent.exists()  # nothing half-written


def test_model_signature_names_what_changes_a_layer_time():
    gpt = preset("gpt-125m")
    assert model_signature(gpt) == model_signature(with_overrides(gpt, layers=2))
    assert model_signature(gpt) != model_signature(with_overrides(gpt, seq_len=128))
    assert model_signature(gpt) != model_signature(gpt, flash_attention=True)
    assert model_signature(preset("toy-mlp")) == "mlp-h4096-bias"
    key = layer_time_key(gpt, LayerKind.BLOCK, 4, "bf16")
    assert key.endswith("|block|mb4|tp1|bf16")


def test_plan_survives_json():
    model = with_overrides(preset("gpt-125m"), layers=2, seq_len=128)
    plan = default_plan(
        "cpu",
        "fp32",
        (model, preset("toy-mlp")),
        (1, 2),
        quick=False,
        topology="1x2-cpu",
        link_classes={"intra": "loopback"},
    )
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    # the model's own GEMMs, forward and backward, are in the sweep
    assert (128, 2304, 768, 1) in plan.gemm_shapes
    assert (768, 2304, 128, 1) in plan.gemm_shapes  # the qkv weight gradient


# ---- collectives: the link fit through zsim's own collective model -----------------------

CALL_S, LINK_LATENCY_S, LINK_BPS = 120e-6, 15e-6, 1.5e9
P2P_CALL_S = 80e-6  # send/recv, posted on the caller's thread
MESSAGE_S = 25e-6  # CPU per message a rank handles
# each op's own CPU per byte a rank sends plus receives; broadcast's none (the wire's reference)
OWN_S_PER_BYTE = {"all_gather": 0.3e-9, "all_reduce": 0.05e-9, "reduce_scatter": 0.08e-9}
OWN_S_PER_BYTE |= {"send_recv": 0.02e-9, "broadcast": 0.0}
# the own cost per call of the ops torch wraps around gloo's (allocations, clones, copies)
OWN_CALL_S = {"all_gather": 60e-6, "reduce_scatter": 40e-6}
SUM_BPS = MEM_RATE / 3  # output bytes of a + b: the elementwise rate moves three operands
# all_gather's flat output is allocated on gloo's worker thread: beyond a thread arena's 64 MiB
# heap (glibc HEAP_MAX_SIZE) it is mapped afresh and faulted in on every call
TOUCH_BPS, FRESH_ABOVE = 2.5e9, 63 * 2**20


def gloo_two_ranks_s(op, size):
    """gloo's algorithms for n = 2 ranks (notes/collectives_algorithms.md section 1), on the
    CPU topology where a message crosses two loopback links (rank -> host -> rank): alpha = 2 x
    link latency; a rank's link is half duplex, so B is shared by what it sends and receives;
    two segments in flight, so a ring step costs one alpha; each rank's CPU pays MESSAGE_S per
    message it sends or receives (per call), its copies run at the memcpy rate, its sums at a
    third of the elementwise rate, and the op's own OWN_S_PER_BYTE on what it sends plus
    receives (all_gather S, all_reduce 2 S, send/recv S per call, broadcast S) and the wrapped
    ops their OWN_CALL_S; send/recv has its own call latency. all_gather's flat output above
    FRESH_ABOVE is faulted in at TOUCH_BPS; every other temporary comes from memory already
    touched."""
    alpha = 2 * LINK_LATENCY_S
    segments = -(-max(-(-size // MIB), 4) // 2) * 2  # roundUp(max(S / 1 MiB, 2n), n)
    # reduce-scatter and all-gather loops: each rank sends and receives its k segments, but an
    # 8-byte buffer fills only segments 0 and 1 of 4: one rank sends both, the other receives
    messages = 4 if size < 16 else 2 * segments
    all_reduce = CALL_S + 2 * alpha + 2 * (size / 2) / (LINK_BPS / 2)
    all_reduce += messages * MESSAGE_S + (size / 2) / SUM_BPS
    if op == "all_reduce":
        return all_reduce + 2 * size * OWN_S_PER_BYTE["all_reduce"]
    if op == "reduce_scatter_tensor":  # clone, all_reduce, copy the own half
        own = 2 * size * OWN_S_PER_BYTE["reduce_scatter"] + OWN_CALL_S["reduce_scatter"]
        return size / COPY_RATE + all_reduce + (size / 2) / COPY_RATE + own
    if op == "all_gather_into_tensor":  # flat output, prime own half, ring, copy out
        local = (size / 2) / COPY_RATE + 4 * MESSAGE_S + size / COPY_RATE
        local += size * OWN_S_PER_BYTE["all_gather"] + OWN_CALL_S["all_gather"]
        local += size / TOUCH_BPS if size > FRESH_ABOVE else 0.0
        return CALL_S + alpha + (size / 2) / (LINK_BPS / 2) + local
    if op == "broadcast":  # one message, alone on both ranks' links
        return CALL_S + alpha + size / LINK_BPS + MESSAGE_S + size * OWN_S_PER_BYTE["broadcast"]
    # send/recv: each rank sends to the other at once, so each link carries both directions
    own = size * OWN_S_PER_BYTE["send_recv"]
    return P2P_CALL_S + alpha + size / (LINK_BPS / 2) + MESSAGE_S + own


def collective_rows(noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for op in (
        "all_gather_into_tensor",
        "reduce_scatter_tensor",
        "all_reduce",
        "broadcast",
        "sendrecv",
    ):
        for size in (8, 1024, 65536, 2**20, 16 * 2**20, 256 * 2**20):
            t = gloo_two_ranks_s(op, size)
            samples = tuple(float(t * (1 + noise * rng.standard_normal())) for _ in range(9))
            rows.append(
                Measurement(
                    Kind.COLLECTIVE,
                    op,
                    "fp32",
                    samples,
                    size_bytes=size,
                    group="intra",
                    ranks=2,
                    link_class="loopback",
                )
            )
    return tuple(rows)


def test_fit_recovers_link_parameters_exactly():
    pytest.importorskip("simpy")
    info = {**INFO, "topology": "1x2-cpu"}
    fit = fit_profile("synthetic", synthetic_rows() + collective_rows(), info)
    link = fit.profile.links["loopback"]
    assert fit.profile.call_latency_s == pytest.approx(CALL_S, rel=1e-6)
    assert link.latency_s == pytest.approx(LINK_LATENCY_S, rel=1e-6)
    assert link.bandwidth_bytes_per_s == pytest.approx(LINK_BPS, rel=1e-6)
    assert fit.profile.message_s == pytest.approx(MESSAGE_S, rel=1e-6)
    assert fit.profile.first_touch_bytes_per_s == pytest.approx(TOUCH_BPS, rel=1e-6)
    assert fit.profile.p2p_call_latency_s == pytest.approx(P2P_CALL_S, rel=1e-6)
    own = fit.profile.op_s_per_byte
    assert set(own) == set(OWN_S_PER_BYTE)
    for op, s_per_byte in OWN_S_PER_BYTE.items():
        assert own[op] == pytest.approx(s_per_byte, rel=1e-6, abs=1e-18), op
    assert fit.profile.op_call_s == pytest.approx(OWN_CALL_S, rel=1e-6)
    coll = [r for r in fit.residuals if r.kind == "collective"]
    assert len(coll) == 5
    assert all(r.worst_rel_err < 1e-6 for r in coll)


def test_fit_recovers_link_parameters_through_noise(tmp_path):
    info = {**INFO, "topology": "1x2-cpu"}
    rows = synthetic_rows() + collective_rows(noise=0.05, seed=3)
    fit = fit_profile("synthetic", rows, info)
    link = fit.profile.links["loopback"]
    assert fit.profile.call_latency_s == pytest.approx(CALL_S, rel=0.1)
    assert link.latency_s == pytest.approx(LINK_LATENCY_S, rel=0.2)
    assert link.bandwidth_bytes_per_s == pytest.approx(LINK_BPS, rel=0.05)
    assert fit.profile.message_s == pytest.approx(MESSAGE_S, rel=0.2)
    assert fit.profile.p2p_call_latency_s == pytest.approx(P2P_CALL_S, rel=0.2)
    assert fit.profile.op_s_per_byte["all_gather"] == pytest.approx(0.3e-9, rel=0.1)
    assert fit.profile.op_call_s["all_gather"] == pytest.approx(60e-6, rel=0.3)
    cal = Calibration("synthetic", fit.profile, rows, fit.residuals, provenance=info)
    save_profile(cal, tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json") == fit.profile  # links and call latency kept


def test_collectives_are_reported_in_nccl_tests_terms(tmp_path, capsys):
    # nccl-tests doc/PERFORMANCE.md: algbw = S / t; busbw = algbw x 2(n-1)/n for all_reduce,
    # x (n-1)/n for all_gather and reduce_scatter, x 1 for broadcast. 1 MiB in 1 ms on 4 ranks:
    t, size = 1e-3, float(MIB)
    expected = {
        "all_reduce": 1.048576 * 1.5,
        "all_gather_into_tensor": 1.048576 * 0.75,
        "broadcast": 1.048576,
    }
    rows = list(synthetic_rows())
    for op in expected:
        rows.append(
            Measurement(
                Kind.COLLECTIVE, op, "fp32", (t, t, t), size_bytes=size, group="intra", ranks=4
            )
        )
    cal = Calibration("bw", calibration().profile, tuple(rows), provenance=INFO)
    save_profile(cal, tmp_path / "bw.json")
    lines = (tmp_path / "bw.csv").read_text().splitlines()
    head = lines[0].split(",")
    for line in lines[1:]:
        cells = dict(zip(head, line.split(","), strict=True))
        if cells["kind"] != "collective":
            assert cells["busbw_GBps"] == ""
            continue
        assert float(cells["algbw_GBps"]) == pytest.approx(1.048576, rel=1e-5)  # 6 digits
        assert float(cells["busbw_GBps"]) == pytest.approx(expected[cells["op"]], rel=1e-5)
    # the view: one table per op and group, in the same terms
    rows2 = synthetic_rows() + collective_rows()
    info = {**INFO, "topology": "1x2-cpu"}
    fit = fit_profile("two", rows2, info)
    two = Calibration("two", fit.profile, rows2, fit.residuals, provenance=info)
    save_profile(two, tmp_path / "t.json")
    capsys.readouterr()
    assert main(["profile", str(tmp_path / "t.json"), "--collectives"]) == 0
    out = capsys.readouterr().out
    assert "busbw GB/s" in out
    assert out.count("(intra, n=2, loopback") == 5  # one table per op
    big = gloo_two_ranks_s("broadcast", 256 * MIB)
    assert f"{256 * MIB / big / 1e9:.3f}" in out  # broadcast's busbw is its algbw


def test_launches_share_the_plans_rounds_samples_and_time():
    plan = default_plan("cpu", "fp32", (), (1,), quick=False)
    assert plan.launches == 3  # CPU: placement differs from process to process
    assert default_plan("cuda", "bf16", (), (1,), quick=False).launches == 1
    assert default_plan("cpu", "fp32", (), (1,), quick=True).launches == 1
    one = plan.per_launch()
    assert one.launches == 1
    assert one.rounds * plan.launches == plan.rounds
    assert one.repeats * plan.launches >= plan.repeats
    assert one.max_repeats * plan.launches >= plan.max_repeats
    assert one.max_row_s * plan.launches == pytest.approx(plan.max_row_s)
    # more launches than rounds: every launch still runs one round
    many = default_plan("cpu", "fp32", (), (1,), quick=False, launches=5)
    assert many.per_launch().rounds == 1
    assert many.rounds == 5


def test_a_gpu_plan_reaches_the_regimes_its_models_are_fitted_in():
    # An H200: 60 MB of L2 (PyTorch's reading on the lent machines, device library KINDS.md)
    # and bf16 GEMMs at their top rate from 8192^3 on (ibid.: 769-798 TFLOP/s there).
    h200_l2 = 60e6
    plan = default_plan("cuda", "bf16", (), (1,), quick=False)
    dram = [b for b in plan.memory_sizes_bytes if b >= 4 * h200_l2]
    assert len(dram) >= 2  # a rate and an overhead need two sizes in the DRAM regime
    assert (8192, 8192, 8192, 1) in plan.gemm_shapes
    cpu = default_plan("cpu", "fp32", (), (1,), quick=False)
    assert max(s[0] for s in cpu.gemm_shapes if s[0] == s[1] == s[2]) == 2048  # ~0.2 s here


def test_merge_appends_the_samples_of_the_same_rows():
    def row(op: str, *samples: float) -> Measurement:
        return Measurement(Kind.MEMORY, op, "fp32", samples, size_bytes=1024)

    first = [row("add", 1.0, 2.0), row("copy", 3.0)]
    merged = merge(merge([], first), [row("add", 4.0), row("copy", 5.0, 6.0)])
    assert [m.samples_s for m in merged] == [(1.0, 2.0, 4.0), (3.0, 5.0, 6.0)]
    with pytest.raises(InputError, match="the same rows"):
        merge(first, [row("copy", 1.0), row("add", 1.0)])


def _row(*samples: float, op: str = "add") -> Measurement:
    return Measurement(Kind.MEMORY, op, "fp32", samples, size_bytes=1024)


def test_merged_launches_keep_each_launchs_median():
    launches = [
        [_row(1.0, 3.0), _row(7.0)],
        [_row(2.0), _row(8.0, 9.0)],
        [_row(4.0, 5.0), _row(6.0)],
    ]
    add, other = merge_launches(launches)
    assert add.samples_s == (1.0, 3.0, 2.0, 4.0, 5.0)
    assert add.launch_samples == (2, 1, 2)
    assert add.launch_medians_s == (2.0, 2.0, 4.5)
    assert other.launch_medians_s == (7.0, 8.5, 6.0)
    assert Measurement.from_dict(add.to_dict()) == add
    (one,) = merge_launches([[_row(1.0, 2.0)]])
    assert one.launch_samples == ()
    assert one.launch_medians_s == (1.5,)
    assert "launch_samples" not in one.to_dict()  # as every profile before the field
    bad = dict(add.to_dict(), launch_samples=[2, 2])
    with pytest.raises(InputError, match="launch_samples"):
        Measurement.from_dict(bad)


def test_launches_agree_when_one_time_is_within_10_percent_of_each():
    def launches(*medians: float) -> Measurement:
        return merge_launches([[_row(m)] for m in medians])[0]

    assert launches(1.0, 1.2).launches_agree  # 1.1 is within 10 % of both
    assert not launches(1.0, 1.25).launches_agree  # apart by more than 1.1 / 0.9
    assert launches(1.0, 1.2, 1.1).launches_agree
    assert _row(1.0, 9.0).launches_agree is None  # one launch: nothing to compare


def test_residuals_count_the_rows_over_10_percent_and_the_unrepeatable_ones():
    steady = merge_launches([[_row(1.0)], [_row(1.0)]])[0]
    jumpy = merge_launches([[_row(1.0)], [_row(2.0)]])[0]  # median 1.5
    rows = [steady, steady, jumpy]
    (group,) = residuals(rows, {0: 1.05, 1: 1.2, 2: 1.0}, frozenset({0, 1, 2}))
    assert (group.rows, group.over, group.over_launches_disagree) == (3, 2, 1)
    (single,) = residuals([_row(1.0)], {0: 2.0}, frozenset({0}))
    assert (single.over, single.over_launches_disagree) == (1, None)


def _nnls_by_enumeration(a, y):
    """The non-negative least-squares optimum by definition: the best unconstrained solution
    over every set of free variables whose values are all non-negative."""
    import itertools

    best, best_err = np.zeros(a.shape[1]), float(y @ y)
    for k in range(1, a.shape[1] + 1):
        for free in itertools.combinations(range(a.shape[1]), k):
            x, *_ = np.linalg.lstsq(a[:, free], y, rcond=None)
            err = float(np.sum((a[:, free] @ x - y) ** 2))
            if np.all(x >= 0) and err < best_err:
                best, best_err = np.zeros(a.shape[1]), err
                best[list(free)] = x
    return best


@pytest.mark.parametrize("seed", range(20))
def test_nonnegative_least_squares_finds_the_optimum(seed):
    from zsim.calibrate.links import nonnegative_lstsq

    rng = np.random.default_rng(seed)
    a = rng.random((12, 6)) * np.array([1, 1e-9, 1e3, 1, 1e6, 1])  # unknowns of unlike units
    y = a @ rng.normal(size=6) + 0.1 * rng.normal(size=12)  # some of them negative
    x = nonnegative_lstsq(a, y)
    expected = _nnls_by_enumeration(a, y)
    assert np.all(x >= 0)
    assert np.sum((a @ x - y) ** 2) == pytest.approx(np.sum((a @ expected - y) ** 2), rel=1e-9)


def test_every_node_of_a_multi_node_calibration_names_the_same_port(tmp_path):
    from zsim.calibrate.runner import Launch, worker_argv

    def port(launch):
        argv = worker_argv(launch, tmp_path / "plan.json", tmp_path / "raw.json")
        return next(a for a in argv if a.startswith("--master_port="))

    nodes = [Launch(nproc=2, nnodes=2, node_rank=r, master_addr="10.0.0.1") for r in (0, 1)]
    assert port(nodes[0]) == port(nodes[1]) == "--master_port=29500"  # torchrun's default
    assert port(Launch(nproc=2, master_port=1234)) == "--master_port=1234"
