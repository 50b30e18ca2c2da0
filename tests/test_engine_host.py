"""DeepSpeed's own host time per engine call on CPU ranks: read off the tiny steps by
subtracting what the simulator already charges, then charged once per call."""

from dataclasses import replace

import pytest

from zsim.calibrate.engine_fit import engine_host_s, tiny_case, tiny_model, tiny_pipe_case
from zsim.calibrate.measurement import Kind, Measurement
from zsim.calibrate.profile import load_profile
from zsim.inputs import presets
from zsim.simulation import simulate
from zsim.step.phases import simulated_phases
from zsim.workload.mechanisms import Mechanism
from zsim.workload.model_presets import preset
from zsim.workload.parallel import ParallelConfig, PipelineEngine, Precision, ZeroStage

PROFILE = load_profile("calibration/cpu-2rank.json")
TOPOLOGY = "1x2-cpu"
HOST = {"forward": 0.004, "backward": 0.007, "step": 0.003}  # injected, seconds per call
PER_TENSOR = {"forward": 0.0, "backward": 0.0, "step": 0.0005}  # and per parameter tensor


def rows_with(call, per_tensor, stage=3):
    """Tiny steps that take what the simulator charges plus the injected host time."""
    bare = replace(PROFILE, engine_host_s={})
    topo = presets.topology(TOPOLOGY)
    rows = []
    for layers in (8, 16):
        report = simulate(tiny_model(layers), tiny_case(stage, topo.world_size), topo, bare)
        phases = simulated_phases(report.engine.all_spans(), 0, report.step_time_s)
        for p in call:
            t = phases[p] + call[p] + per_tensor[p] * layers  # one tensor per tiny layer
            row = Measurement(Kind.ENGINE_HOST, f"z{stage}.{p}", "fp32", (t,) * 5, params=layers)
            rows.append(row)
    return rows


def test_time_inside_collectives_is_not_taken_for_host_time():
    """Rows of the time outside collectives ("<phase>_host") are read against the simulated
    time outside collectives: tiny steps whose collectives took 5 ms more than simulated
    (small messages over a shaped link, say) in whole-phase rows, plus the injected host
    time, give the injected host time alone."""
    bare = replace(PROFILE, engine_host_s={})
    topo = presets.topology(TOPOLOGY)
    rows = []
    for layers in (8, 16):
        report = simulate(tiny_model(layers), tiny_case(3, topo.world_size), topo, bare)
        phases = simulated_phases(report.engine.all_spans(), 0, report.step_time_s)
        for p in HOST:
            host = HOST[p] + PER_TENSOR[p] * layers
            whole = phases[p] + host + 0.005
            outside = phases[p] - phases[f"{p}_comm"] + host
            for op, t in ((f"z3.{p}", whole), (f"z3.{p}_host", outside)):
                rows.append(Measurement(Kind.ENGINE_HOST, op, "fp32", (t,) * 5, params=layers))
    found = engine_host_s(PROFILE, rows, TOPOLOGY)
    expected = {f"z3.{p}": s for p, s in HOST.items()}
    expected |= {f"z3.{p}_per_tensor": s for p, s in PER_TENSOR.items()}
    assert found == pytest.approx(expected, abs=1e-9)


def off(cfg):
    return replace(cfg, without=frozenset({Mechanism.ENGINE_HOST}))


def test_the_host_time_is_what_the_tiny_step_takes_beyond_the_simulation():
    found = engine_host_s(PROFILE, rows_with(HOST, PER_TENSOR), TOPOLOGY)
    expected = {f"z3.{p}": s for p, s in HOST.items()}
    expected |= {f"z3.{p}_per_tensor": s for p, s in PER_TENSOR.items()}
    assert found == pytest.approx(expected, abs=1e-9)


def test_a_tiny_step_faster_than_simulated_leaves_no_negative_host_time():
    found = engine_host_s(PROFILE, rows_with({"forward": -0.001}, {"forward": 0.0}), TOPOLOGY)
    assert found == pytest.approx({"z3.forward": 0.0, "z3.forward_per_tensor": 0.0}, abs=1e-12)
    assert min(found.values()) >= 0.0  # clamped, not negative (round-off leaves ~1e-20)


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_each_engine_call_pays_its_host_time_once(stage):
    """grad_accum micro-batches: each calls engine(x) and engine.backward once; one
    engine.step: the step grows by 2 x (forward + backward) + step, the step's part per
    tensor times the toy MLP's 16 tensors (8 weights of 4096^2, 8 biases of 4096); under
    ZeRO-3 only the 8 persistent ones, the biases (on one CPU thread)."""
    costs = {f"z{stage}.{p}": s for p, s in HOST.items()} | {f"z{stage}.step_per_tensor": 1e-4}
    host = replace(PROFILE, engine_host_s=costs)
    model = preset("toy-mlp")
    cfg = ParallelConfig(
        dp=2, zero_stage=ZeroStage(stage), micro_batch=4, grad_accum=2, precision=Precision.FP32
    )
    topo = presets.topology(TOPOLOGY)
    with_host = simulate(model, cfg, topo, host).step_time_s
    without = simulate(model, off(cfg), topo, host).step_time_s
    tensors = 8 if stage == 3 else 16
    expected = 2 * (HOST["forward"] + HOST["backward"]) + HOST["step"] + tensors * 1e-4
    assert with_host - without == pytest.approx(expected, rel=1e-6)


def _pipeline(stage=1, engine=PipelineEngine.DEEPSPEED):
    return ParallelConfig(dp=1, pp=2, zero_stage=ZeroStage(stage), micro_batch=4, grad_accum=4,
                          precision=Precision.FP32, pipeline_engine=engine)  # fmt: skip


def test_gpus_megatrons_pipeline_and_the_other_engines_keys_pay_none():
    topo, model = presets.topology(TOPOLOGY), preset("toy-mlp")
    for cfg, costs in [
        (_pipeline(), {"z1.forward": 1.0}),  # DeepSpeedEngine's calls: not a pipeline's
        (_pipeline(engine=PipelineEngine.MEGATRON), {"pipe1.forward": 1.0}),
    ]:
        host = replace(PROFILE, engine_host_s=costs)
        with_host = simulate(model, cfg, topo, host).step_time_s
        assert with_host == simulate(model, off(cfg), topo, host).step_time_s


def test_a_pipelines_instructions_pay_their_host_time_on_its_critical_path():
    """Host time far above the step's own: 1F1B over p = 2 stages and m = 4 micro-batches
    takes (m + p - 1) forward-and-backward slots (Narayanan et al. 2021, sec. 2.2), then the
    step: 5 x (1 + 2) + 0.5 s."""
    costs = {"pipe0.forward": 1.0, "pipe0.backward": 2.0, "pipe0.step": 0.5}
    host = replace(PROFILE, engine_host_s=costs)
    model, topo, cfg = preset("toy-mlp"), presets.topology(TOPOLOGY), _pipeline(stage=0)
    without = simulate(model, off(cfg), topo, host).step_time_s
    grown = simulate(model, cfg, topo, host).step_time_s - without
    assert abs(grown - 15.5) < without


def test_a_pipelines_blocking_sends_pay_their_host_time():
    """Each stage sends m = 4 messages on its compute stream (DeepSpeed's p2p blocks): the
    step grows by at least those of one stage and at most those of both."""
    host = replace(PROFILE, engine_host_s={"pipe1.send": 1.0})
    model, topo, cfg = preset("toy-mlp"), presets.topology(TOPOLOGY), _pipeline()
    without = simulate(model, off(cfg), topo, host).step_time_s
    grown = simulate(model, cfg, topo, host).step_time_s - without
    assert 4.0 - without < grown < 8.0 + without


def test_a_pipelines_host_time_is_read_off_rank_0s_instructions():
    """Rows that take what the simulator charges rank 0 plus injected host time give it back
    (the first stage holds 8 / 2 and 16 / 2 of the tiny layers)."""
    bare = replace(PROFILE, engine_host_s={})
    topo = presets.topology(TOPOLOGY)
    call, per_tensor = {"forward": 2e-4, "backward": 3e-4, "step": 1e-3}, 1e-5
    rows = []
    for layers in (8, 16):
        report = simulate(tiny_model(layers), tiny_pipe_case(1, 2), topo, bare)
        spans = [s for s in report.engine.all_spans() if s.rank == 0]
        passes = {c: sum(s.end_s - s.start_s for s in spans if s.category == c) / 4
                  for c in ("forward", "backward")}  # fmt: skip
        passes["step"] = report.step_time_s - max(
            s.end_s for s in spans if s.category in ("forward", "backward", "pp_comm")
        )
        for p, extra in call.items():
            t = passes[p] + extra + per_tensor * layers / 2
            rows.append(
                Measurement(Kind.ENGINE_HOST, f"pipe1.{p}", "fp32", (t,) * 5, params=layers)
            )
    found = engine_host_s(PROFILE, rows, TOPOLOGY)
    expected = {f"pipe1.{p}": s for p, s in call.items()}
    expected |= {f"pipe1.{p}_per_tensor": per_tensor for p in call}
    assert found == pytest.approx(expected, abs=1e-9)


def test_fsdps_cost_per_unit_and_per_tensor_come_apart_with_a_biased_tiny_model():
    """FSDP2's hooks run once per unit, its copies and DTensor work once per tensor: tiny
    steps of 8 and 16 one-tensor units and of 8 two-tensor units (weights and biases), built
    with known costs, give back the three."""
    from zsim.calibrate.engine_fit import BIASED, HOST_SUFFIX, tiny_fsdp_case

    bare = replace(PROFILE, engine_host_s={})
    topo = presets.topology(TOPOLOGY)
    call_s, unit_s, tensor_s = 0.002, 0.0012, 0.0003
    rows = []
    for layers, bias in ((8, False), (16, False), (8, True)):
        case = tiny_fsdp_case("full", topo.world_size)
        report = simulate(tiny_model(layers, bias), case, topo, bare)
        phases = simulated_phases(report.engine.all_spans(), 0, report.step_time_s)
        tensors = 2 * layers if bias else layers
        t = phases["forward"] - phases["forward_comm"] + call_s + unit_s * layers
        t += tensor_s * tensors
        op = f"fsdp-full{BIASED if bias else ''}.forward{HOST_SUFFIX}"
        rows.append(Measurement(Kind.ENGINE_HOST, op, "fp32", (t,) * 5, params=layers))
    found = engine_host_s(PROFILE, rows, TOPOLOGY)
    expected = {"fsdp-full.forward": call_s, "fsdp-full.forward_per_unit": unit_s,
                "fsdp-full.forward_per_tensor": tensor_s}  # fmt: skip
    assert found == pytest.approx(expected, abs=1e-9)


def test_an_fsdp_step_pays_per_unit_and_per_tensor():
    """The toy MLP under FSDP: 8 units (its Linear layers) of 2 tensors each; 2 micro-batches
    each call engine(x) once."""
    from zsim.workload.parallel import DpEngine

    costs = {"fsdp-full.forward": 0.001, "fsdp-full.forward_per_unit": 0.002,
             "fsdp-full.forward_per_tensor": 0.0005}  # fmt: skip
    host = replace(PROFILE, engine_host_s=costs)
    cfg = ParallelConfig(dp=2, zero_stage=ZeroStage.PARAMETERS, micro_batch=4, grad_accum=2,
                         precision=Precision.FP32, dp_engine=DpEngine.FSDP)  # fmt: skip
    topo = presets.topology(TOPOLOGY)
    model = preset("toy-mlp")
    with_host = simulate(model, cfg, topo, host).step_time_s
    without = simulate(model, off(cfg), topo, host).step_time_s
    assert with_host - without == pytest.approx(2 * (0.001 + 8 * 0.002 + 16 * 0.0005), rel=1e-6)


def test_fsdps_cost_per_unit_of_each_swept_size_comes_back_from_wider_tiny_steps():
    """The unit-size sweep: 8 one-tensor units of 1 and 16 MiB (Linear(512) and
    Linear(2048)), each built to cost a known amount per unit beyond the 16 KiB tiny unit's,
    give back those amounts beside the tiny fit's three."""
    from zsim.calibrate.engine_fit import BIASED, HOST_SUFFIX, WIDER, tiny_fsdp_case

    bare = replace(PROFILE, engine_host_s={})
    topo = presets.topology(TOPOLOGY)
    call_s, unit_s, tensor_s = 0.002, 0.0012, 0.0003
    beyond = {512: 0.0004, 2048: 0.0019}  # s a unit of 1 and 16 MiB pays beyond a tiny one
    rows = []
    for layers, bias, width in ((8, False, 64), (16, False, 64), (8, True, 64),
                                (8, False, 512), (8, False, 2048)):  # fmt: skip
        case = tiny_fsdp_case("full", topo.world_size)
        report = simulate(tiny_model(layers, bias, width), case, topo, bare)
        phases = simulated_phases(report.engine.all_spans(), 0, report.step_time_s)
        tensors = 2 * layers if bias else layers
        t = phases["forward"] - phases["forward_comm"] + call_s + unit_s * layers
        t += tensor_s * tensors + beyond.get(width, 0.0) * layers
        call = f"fsdp-full{BIASED if bias else ''}{f'{WIDER}{width}' if width != 64 else ''}"
        op = f"{call}.forward{HOST_SUFFIX}"
        rows.append(Measurement(Kind.ENGINE_HOST, op, "fp32", (t,) * 5, params=layers))
    found = engine_host_s(PROFILE, rows, TOPOLOGY)
    expected = {"fsdp-full.forward": call_s, "fsdp-full.forward_per_unit": unit_s,
                "fsdp-full.forward_per_tensor": tensor_s,
                "fsdp-full.forward_per_unit_at_1MiB": beyond[512],
                "fsdp-full.forward_per_unit_at_16MiB": beyond[2048]}  # fmt: skip
    assert found == pytest.approx(expected, abs=1e-9)


def test_a_units_cost_beyond_the_tiny_ones_is_linear_in_its_bytes_between_measured_sizes():
    """0 at the tiny unit's 16 KiB and below, the measured values at 1 and 16 MiB, straight
    lines between, the last line's slope beyond; nothing where the profile swept no sizes."""
    from zsim.cluster.device import unit_size_extra_s

    host = {"c_per_unit_at_1MiB": 0.0004, "c_per_unit_at_16MiB": 0.0019}
    mib, tiny = 1 << 20, 16384
    assert unit_size_extra_s(host, "c", tiny) == 0.0
    assert unit_size_extra_s(host, "c", 100) == 0.0
    assert unit_size_extra_s(host, "c", mib) == pytest.approx(0.0004)
    assert unit_size_extra_s(host, "c", (mib + tiny) / 2) == pytest.approx(0.0002)
    assert unit_size_extra_s(host, "c", 4 * mib) == pytest.approx(0.0004 + 0.0015 * 3 / 15)
    assert unit_size_extra_s(host, "c", 31 * mib) == pytest.approx(0.0019 + 0.0015)
    assert unit_size_extra_s({}, "c", 4 * mib) == 0.0


def test_an_fsdp_step_pays_for_its_units_size():
    """The toy MLP at hidden 1024 under FSDP: 8 units of 1024 x 1024 + 1024 fp32 parameters
    (4.004 MiB) each pay the interpolated cost beyond a tiny unit's in each of 2 forwards."""
    from zsim.workload.model_presets import with_overrides
    from zsim.workload.parallel import DpEngine

    costs = {"fsdp-full.forward_per_unit_at_1MiB": 0.0004,
             "fsdp-full.forward_per_unit_at_16MiB": 0.0019}  # fmt: skip
    host = replace(PROFILE, engine_host_s=costs)
    cfg = ParallelConfig(dp=2, zero_stage=ZeroStage.PARAMETERS, micro_batch=4, grad_accum=2,
                         precision=Precision.FP32, dp_engine=DpEngine.FSDP)  # fmt: skip
    topo = presets.topology(TOPOLOGY)
    model = with_overrides(preset("toy-mlp"), hidden=1024)
    with_host = simulate(model, cfg, topo, host).step_time_s
    without = simulate(model, off(cfg), topo, host).step_time_s
    unit_mib = (1024 * 1024 + 1024) * 4 / (1 << 20)
    per_unit = 0.0004 + 0.0015 * (unit_mib - 1) / 15
    assert with_host - without == pytest.approx(2 * 8 * per_unit, rel=1e-6)
