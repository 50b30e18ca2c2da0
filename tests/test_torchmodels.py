"""The torch modules used by calibration/validation hold exactly the parameters zsim models."""

import pytest

torch = pytest.importorskip("torch", reason="torch is in the calibrate extra")

from zsim.testbed import torchmodels  # noqa: E402
from zsim.workload.model import ModelKind, ModelSpec  # noqa: E402
from zsim.workload.model_presets import preset, with_overrides  # noqa: E402

SMALL = [
    with_overrides(preset("gpt-125m"), layers=2, hidden=128, heads=4, seq_len=64, vocab=1000),
    with_overrides(
        preset("llama-7b"), layers=2, hidden=128, heads=4, seq_len=64, vocab=1000, ffn_hidden=344
    ),
    ModelSpec(
        "gqa",
        ModelKind.TRANSFORMER,
        2,
        128,
        8,
        256,
        32,
        500,
        kv_heads=2,
        tied_embeddings=False,
        gated_mlp=True,
        rmsnorm=True,
        bias=False,
        learned_positions=False,
        dropout=False,
    ),
    with_overrides(preset("toy-mlp"), hidden=256),
]


@pytest.mark.consistency
@pytest.mark.parametrize("spec", SMALL, ids=lambda s: s.name)
def test_module_parameters_equal_spec(spec):
    module = torchmodels.build(spec)
    assert sum(p.numel() for p in module.parameters()) == spec.total_params()
    x, y = torchmodels.batch(spec, 2)
    loss = module(x, y)
    loss.backward()
    assert torch.isfinite(loss)
