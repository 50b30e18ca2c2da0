"""Model shapes against published counts and formulas (not against this code)."""

import pytest

from zsim.workload.model import ModelKind, ModelSpec
from zsim.workload.model_presets import preset, with_overrides
from zsim.workload.shapes import Shard, activation_bytes, forward_flops


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        # Hugging Face GPT2LMHeadModel("gpt2").num_parameters(): 124,439,808
        (with_overrides(preset("gpt-125m"), seq_len=1024), 124_439_808),
        # GPT-2 XL as Hugging Face counts it (48 x 1600, 25 heads, 1024 positions)
        (
            ModelSpec("gpt2-xl", ModelKind.TRANSFORMER, 48, 1600, 25, 6400, 1024, 50257),
            1_557_611_200,
        ),
        # Hugging Face LlamaForCausalLM parameter counts
        (preset("llama-7b"), 6_738_415_616),
        (preset("llama-13b"), 13_015_864_320),
        (preset("llama-70b"), 68_976_648_192),
    ],
)
def test_parameter_counts_match_published(model, expected):
    assert model.total_params() == expected


def test_toy_mlp_is_eight_linear_4096():
    # the seeds' Net: 8 x nn.Linear(4096, 4096) with bias
    assert preset("toy-mlp").total_params() == 8 * (4096 * 4096 + 4096)


@pytest.mark.parametrize("name", ["gpt-1.3b", "gpt-13b", "gpt-175b"])
@pytest.mark.parametrize("batch", [1, 8])
def test_training_flops_match_megatron_formula(name, batch):
    # Narayanan et al. 2021, eq. 3 without recompute: 72 B s L h^2 (1 + s/6h + V/12hL)
    m = preset(name)
    b, s, L, h, V = batch, m.seq_len, m.layers, m.hidden, m.vocab
    expected = 72 * b * s * L * h**2 * (1 + s / (6 * h) + V / (12 * h * L))
    assert 3 * forward_flops(m, batch) == pytest.approx(expected, rel=1e-12)


def _block(m):
    return next(x for x in m.layer_list() if x.kind == "block")


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_activations_match_korthikanti(tp):
    # Korthikanti et al. 2022, eqs. 1-2: sbh(10 + 24/t + 5as/(ht)) bytes per layer
    m = preset("gpt-1.3b")
    s, b, h, a = m.seq_len, 4, m.hidden, m.heads
    expected = s * b * h * (10 + 24 / tp + 5 * a * s / (h * tp))
    assert activation_bytes(m, _block(m), Shard(b, tp=tp)) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("tp", [2, 8])
def test_sequence_parallel_activations_match_korthikanti(tp):
    # eq. 4: sbh/t (34 + 5as/h)
    m = preset("gpt-6.7b")
    s, b, h, a = m.seq_len, 2, m.hidden, m.heads
    expected = s * b * h / tp * (34 + 5 * a * s / h)
    got = activation_bytes(m, _block(m), Shard(b, tp=tp, sequence_parallel=True))
    assert got == pytest.approx(expected, rel=1e-12)


def test_bad_shapes_are_refused():
    from zsim.errors import InputError

    with pytest.raises(InputError, match="heads"):
        ModelSpec("x", ModelKind.TRANSFORMER, 2, 100, 3, 400, 16, 100)
    with pytest.raises(InputError, match="model"):
        preset("gpt-5")
