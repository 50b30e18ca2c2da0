"""A compute task beside an NCCL collective runs its SM-bound share on the SMs left.

Expected values from the mechanism's arithmetic, not from the engine: while a collective of
C seconds holds c of the GPU's S SMs, a task of T seconds alone whose share s is SM-bound
progresses at 1 / (1 + s (S / (S - c) - 1)); it ends at T + C (1 - 1/f) if the collective
ends first, else at T f (f that slowdown). The counts c: 16 across DGX H100 nodes (NCCL's
log, tests/test_nccl_ctas.py), the H100's 132 SMs (its spec sheet).
"""

from __future__ import annotations

import pytest
import simpy

from zsim.cluster.grid import RankGrid
from zsim.inputs import presets
from zsim.network.collective import CollectiveOp
from zsim.network.communicator import Communicator
from zsim.step.engine import Engine
from zsim.step.program import Category, Comm, Group, Program, Stream, Task
from zsim.step.sm_hold import SmHold

SMS, CHANNELS = 132, 16


def run(seconds: float, share: float, nbytes: float, held: bool = True, on=Stream.REDUCE):
    """(the compute task's end, the collective's seconds) on 2 DGX H100 nodes, dp 16."""
    topo = presets.topology("2x8-dgx-h100")
    program = Program(0)
    comm = Comm(CollectiveOp.ALL_REDUCE, nbytes, Group.DP)
    program.add(Task("reduce", on, Category.GRAD_REDUCE, comm=comm))
    program.add(Task("gemm", Stream.COMPUTE, Category.BACKWARD, seconds, sm_share=share))
    comms = Communicator(simpy.Environment(), topo)
    sms = SmHold(topo, SMS) if held else None
    result = Engine([program], RankGrid(dp=16, pp=1, tp=1), comms, sms=sms).run()
    spans = {s.name: s for s in result.spans if s.rank == 0}
    return spans["gemm"].end_s, spans["reduce"].end_s - spans["reduce"].start_s


def slowdown(share: float) -> float:
    return 1.0 + share * (SMS / (SMS - CHANNELS) - 1.0)


@pytest.mark.parametrize("share", [1.0, 0.6])
def test_a_gemm_beside_a_shorter_all_reduce_loses_its_share_of_the_sms_for_that_long(share):
    end, comm = run(0.5, share, 1 << 30)
    assert comm < 0.5
    assert end == pytest.approx(0.5 + comm * (1 - 1 / slowdown(share)), rel=1e-9)


def test_a_gemm_beside_a_longer_all_reduce_runs_slow_throughout():
    end, comm = run(0.001, 1.0, 1 << 30)
    assert comm > 0.001 * slowdown(1.0)
    assert end == pytest.approx(0.001 * slowdown(1.0), rel=1e-9)


@pytest.mark.parametrize(
    ("share", "held", "on"),
    [(0.0, True, Stream.REDUCE), (1.0, False, Stream.REDUCE), (1.0, True, Stream.COMPUTE)],
    ids=["bandwidth-bound", "switched-off", "not-beside"],
)
def test_nothing_slows_without_sm_bound_work_the_mechanism_or_a_stream_beside(share, held, on):
    end, _ = run(0.5, share, 1 << 30, held, on)
    start = 0.0 if on is Stream.REDUCE else end - 0.5
    assert end - start == pytest.approx(0.5, rel=1e-12)
