"""CPU ranks compute subnormal floats as zero (`testbed.torchmodels.flush_subnormals`), as a
GPU runs them at full speed: on an Intel core each subnormal operand costs a microcode assist,
which made a calibrated LM-head backward 20x slower than the training's own."""

import pytest

torch = pytest.importorskip("torch")

from zsim.testbed.torchmodels import flush_subnormals  # noqa: E402

SUBNORMAL = 1e-40  # below float32's least normal, 2**-126 = 1.18e-38


@pytest.fixture(autouse=True)
def _restored():
    yield
    torch.set_flush_denormal(False)


def test_a_cpu_rank_flushes_subnormals_to_zero():
    x = torch.tensor([SUBNORMAL, 1e-30], dtype=torch.float32)
    assert (x * 1.0)[0].item() != 0.0  # IEEE-754 keeps it by default
    flush_subnormals("cpu")
    y = x * 1.0
    assert y[0].item() == 0.0  # flushed (FTZ/DAZ)
    assert y[1].item() == pytest.approx(1e-30)  # a normal float is untouched


def test_a_gpu_rank_is_left_as_it_is():
    flush_subnormals("cuda")
    assert (torch.tensor([SUBNORMAL]) * 1.0).item() != 0.0


def test_both_kinds_of_rank_set_it_up():
    """The calibration worker and the training worker call it before any work."""
    import inspect

    from zsim.calibrate import worker
    from zsim.validate import train_worker

    for module in (worker, train_worker):
        assert "flush_subnormals(" in inspect.getsource(module.main), module.__name__
