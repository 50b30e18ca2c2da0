"""Model presets: published shapes of the GPT-3 and Llama families and the seeds' toy MLP, and
models known only by a parameter count or a preset with some fields replaced."""

from __future__ import annotations

from dataclasses import replace

from zsim.errors import choose, require
from zsim.workload.model import ModelKind, ModelSpec


def _gpt(name: str, layers: int, hidden: int, heads: int, seq_len: int = 2048) -> ModelSpec:
    """GPT-3 family shapes (Brown et al. 2020, table 2.1): GeLU MLP of 4h, tied embeddings."""
    return ModelSpec(
        name, ModelKind.TRANSFORMER, layers, hidden, heads, 4 * hidden, seq_len, vocab=50257
    )


def _llama(
    name: str,
    layers: int,
    hidden: int,
    heads: int,
    ffn: int,
    kv_heads: int = 0,
    seq_len: int = 2048,
) -> ModelSpec:
    """Llama shapes (Touvron et al. 2023): SwiGLU, RMSNorm, no biases, RoPE, untied head."""
    return ModelSpec(
        name,
        ModelKind.TRANSFORMER,
        layers,
        hidden,
        heads,
        ffn,
        seq_len,
        vocab=32000,
        kv_heads=kv_heads,
        tied_embeddings=False,
        gated_mlp=True,
        rmsnorm=True,
        bias=False,
        learned_positions=False,
        rotary=True,
        dropout=False,
    )


PRESETS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        _gpt("gpt-125m", 12, 768, 12),
        _gpt("gpt-350m", 24, 1024, 16),
        _gpt("gpt-760m", 24, 1536, 16),
        _gpt("gpt-1.3b", 24, 2048, 16),
        _gpt("gpt-2.7b", 32, 2560, 32),
        _gpt("gpt-6.7b", 32, 4096, 32),
        _gpt("gpt-13b", 40, 5120, 40),
        _gpt("gpt-30b", 48, 7168, 56),
        _gpt("gpt-175b", 96, 12288, 96),
        _llama("llama-7b", 32, 4096, 32, 11008),
        _llama("llama-13b", 40, 5120, 40, 13824),
        _llama("llama-70b", 80, 8192, 64, 28672, kv_heads=8, seq_len=4096),
        # The seeds' experiment: nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(8)])
        ModelSpec("toy-mlp", ModelKind.MLP, layers=8, hidden=4096),
    )
}


def preset(name: str) -> ModelSpec:
    return PRESETS[choose("model", name, list(PRESETS))]


def from_params(params: float) -> ModelSpec:
    """A model known only by its parameter count (e.g. `--params 7.5e9`)."""
    require(
        isinstance(params, int | float) and params >= 1 and float(params).is_integer(),
        "params",
        params,
        "a positive whole number of parameters, e.g. 7.5e9",
    )
    scale, unit = (1e12, "T") if params >= 1e12 else (1e9, "B") if params >= 1e9 else (1e6, "M")
    return ModelSpec(
        f"{params / scale:.3g}{unit}-params",
        ModelKind.PARAMS_ONLY,
        layers=1,
        hidden=1,
        params_override=int(params),
    )


def with_overrides(base: ModelSpec, **overrides: int) -> ModelSpec:
    """A preset with some shape fields replaced (ffn follows hidden unless given)."""
    given = {k: v for k, v in overrides.items() if v is not None}
    if "hidden" in given and "ffn_hidden" not in given and base.kind is ModelKind.TRANSFORMER:
        given["ffn_hidden"] = base.ffn_hidden * given["hidden"] // base.hidden
    name = base.name if not given else "custom"
    return replace(base, name=name, **given)  # type: ignore[arg-type]
