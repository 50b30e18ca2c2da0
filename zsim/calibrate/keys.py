"""Names shared by calibration and the simulator: which model a layer time belongs to, and the
bytes an Adam step streams per parameter (the conversion behind `optimizer_bytes_per_s`).

Torch-free: the simulator imports this to look up measured layer times in a profile.
"""

from __future__ import annotations

from zsim.hardware import layer_key
from zsim.model import LayerKind, ModelKind, ModelSpec

ADAM_STEP_BYTES_PER_PARAM = 28
"""Bytes one Adam(W) step moves per parameter, counted as a fused kernel would: the fp32
master weight, m and v are each read and written (3 x 2 x 4 = 24) and the gradient is read
(4 in fp32; in mixed precision a 2-byte gradient read plus a 2-byte low-precision weight write,
also 4). Calibration times torch's AdamW per parameter and reports
`optimizer_bytes_per_s = params_per_s * ADAM_STEP_BYTES_PER_PARAM`, so a simulator that charges
`params * ADAM_STEP_BYTES_PER_PARAM / optimizer_bytes_per_s` recovers the measured time."""


def model_signature(model: ModelSpec, flash_attention: bool = False) -> str:
    """Everything about a model that changes the time of one of its layers, as a short string.

    The layer count and the preset's name are left out (a layer's time does not depend on how
    many there are or what the model is called), so `gpt-125m` with 2 layers and with 12 share
    their layer times. Example: `transformer-h768-a12-kv12-f3072-s128-v50257-bias-drop-pos-tied`.
    """
    if model.kind is ModelKind.MLP:
        return f"mlp-h{model.hidden}" + ("-bias" if model.bias else "")
    if model.kind is ModelKind.PARAMS_ONLY:
        return f"params-{model.params_override}"
    flags = (
        ("gated", model.gated_mlp),
        ("rms", model.rmsnorm),
        ("bias", model.bias),
        ("drop", model.dropout),
        ("pos", model.learned_positions),
        ("tied", model.tied_embeddings),
        ("flash", flash_attention),
    )
    return (
        f"transformer-h{model.hidden}-a{model.heads}-kv{model.n_kv_heads}-f{model.ffn_hidden}"
        f"-s{model.seq_len}-v{model.vocab}" + "".join(f"-{name}" for name, on in flags if on)
    )


def layer_time_key(
    model: ModelSpec,
    kind: LayerKind,
    micro_batch: int,
    dtype: str,
    tp: int = 1,
    flash_attention: bool = False,
) -> str:
    """The key under which a profile stores the measured time of one layer of `model`."""
    return layer_key(model_signature(model, flash_attention), str(kind), micro_batch, tp, dtype)
