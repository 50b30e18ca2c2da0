"""TransformerEngine's userbuffers under Megatron-Core's --tp-comm-overlap: the SMs its
communication kernels take from the GEMM they overlap.

A "pipeline" or "bulk" layer's reduce-scatter or all-gather is a userbuffers kernel of
`num_sm` CTAs of 1,024 threads (`SETUP_LAUNCH_CONFIG(sms, warps * 32, ...)` in
`common/comm_gemm_overlap/userbuffers/userbuffers.cu`, `comm->threads = 1024` in
`userbuffers-host.cpp`, NVIDIA/TransformerEngine d0067d0), launched beside the GEMM it hides
in and running about as long. Where the layer's `set_sm_margin` is on, TE launches the GEMM on
`sm_count - num_sm` SMs (`_math_sms` in `comm_gemm_overlap.cpp`; `pytorch/csrc/
comm_gemm_overlap.h` in 1.x); where it is off (TE 1.x's default), the GEMM is launched on
every SM but the comm kernel's CTAs hold theirs while it runs (a CTA of 1,024 threads leaves
no room on its SM for a GEMM CTA's registers): zsim charges both alike, the GEMM on
`sm_count - num_sm` SMs. A "ring_exchange" layer's sends go through the copy engines
(`use_ce`, true by default): no SMs, unless a config turns `use_ce` off or sets its margin
(then `num_sm`).
Defaults (`initialize_ub`'s `get_default_config`): `num_sm` 16 for "pipeline" and "bulk", 1
for "ring_exchange"; the margin on since TE 2.0 (544dd14, 2025-02), off in 1.x. A Megatron
`--tp-comm-overlap-cfg` file (TE's `ub_cfgs`) sets them per layer.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from zsim.errors import InputError, is_whole, require

TE_METHODS: dict[str, str] = {
    "qkv_fprop": "ring_exchange",
    "fc1_fprop": "ring_exchange",
    "proj_dgrad": "ring_exchange",
    "fc2_dgrad": "ring_exchange",
    "proj_fprop": "pipeline",
    "fc2_fprop": "pipeline",
    "qkv_dgrad": "bulk",
    "qkv_wgrad": "bulk",
    "fc1_dgrad": "bulk",
    "fc1_wgrad": "bulk",
}
"""TE's default overlap method of each userbuffers layer (`initialize_ub`'s `methods`)."""

TE_LAYER_OPS: dict[str, str] = {layer: layer.removesuffix("_fprop") for layer in TE_METHODS}
"""The GEMM each TE layer is in zsim: the forward's by the linear's name, the backward's as
"<linear>_dgrad" / "<linear>_wgrad"."""

SmMargins = tuple[tuple[str, int], ...]


def parse_sms(value: Any) -> SmMargins:
    """(TE layer, SMs) pairs, sorted, from a mapping or pairs; zero margins dropped."""
    pairs = value.items() if isinstance(value, Mapping) else value
    ok = isinstance(pairs, Iterable) and not isinstance(pairs, str)
    pairs = list(pairs) if ok else []
    ok = ok and all(isinstance(p, tuple | list) and len(p) == 2 for p in pairs)
    require(ok, "tp_overlap_sms", value, "a mapping of TE layer names to SMs")
    out = {}
    for layer, sms in pairs:
        require(layer in TE_METHODS, "tp_overlap_sms", layer, f"one of {', '.join(TE_METHODS)}")
        require(is_whole(sms), f"tp_overlap_sms.{layer}", sms, "a non-negative whole number of SMs")
        out[layer] = sms
    return tuple(sorted((layer, sms) for layer, sms in out.items() if sms))


def from_ub_cfgs(ub_cfgs: Mapping[str, Any] | None) -> SmMargins:
    """The SMs each layer's comm kernel takes from its GEMM under a TE `ub_cfgs` mapping
    (Megatron's --tp-comm-overlap-cfg): each layer's config is TE's default updated with the
    mapping's keys (as `initialize_ub` does); `num_sm`, margin or not, but none for a ring
    exchange through the copy engines. zsim models TE's default method of each layer (and
    the pipeline's 4 splits): a config that changes them is refused."""
    ub_cfgs = {} if ub_cfgs is None else ub_cfgs
    field = "tp_comm_overlap_cfg"
    require(isinstance(ub_cfgs, Mapping), field, ub_cfgs, "a mapping by layer")
    for layer, given in ub_cfgs.items():
        require(layer in TE_METHODS, field, layer, f"one of {', '.join(TE_METHODS)}")
        require(given is None or isinstance(given, Mapping), f"{field}.{layer}", given, "a mapping")
    margins = {}
    for layer, method in TE_METHODS.items():
        given = dict(ub_cfgs.get(layer) or {})
        where = f"{field}.{layer}"
        chosen = given.get("method", method)
        require(chosen == method, f"{where}.method", chosen, f"{method} (TE's default, modelled)")
        if method == "pipeline":
            splits = given.get("num_splits", 4)
            require(splits == 4, f"{where}.num_splits", splits, "4 (TE's default, modelled)")
        ring = method == "ring_exchange"
        cfg = {"num_sm": 1 if ring else 16, "set_sm_margin": not ring, "use_ce": True} | given
        on, sms, ce = cfg["set_sm_margin"], cfg["num_sm"], cfg["use_ce"]
        require(on in (True, False, 0, 1), f"{where}.set_sm_margin", on, "true or false (1 or 0)")
        require(ce in (True, False, 0, 1), f"{where}.use_ce", ce, "true or false (1 or 0)")
        require(is_whole(sms), f"{where}.num_sm", sms, "a non-negative whole number of SMs")
        margins[layer] = 0 if ring and ce and not on else sms  # copy engines, no margin
    return parse_sms(margins)


TE_DEFAULT_SMS = from_ub_cfgs({})
"""TE's defaults (1.x and 2.x alike): 16 SMs for its "pipeline" (proj_fprop, fc2_fprop) and
"bulk" layers, none for its ring exchanges."""


def gemm_slowdown(margins: SmMargins, sm_count: int) -> dict[str, float]:
    """Each overlapped GEMM's time over its time on every SM (by zsim op name): a GEMM on
    `sm_count - m` SMs runs `sm_count / (sm_count - m)` times as long. Empty where the
    device's SM count is unknown (0: CPU ranks, profiles without one)."""
    if not sm_count:
        return {}
    out = {}
    for layer, sms in margins:
        if sms >= sm_count:
            raise InputError(f"tp_overlap_sms.{layer}", sms, f"fewer than the GPU's {sm_count} SMs")
        out[TE_LAYER_OPS[layer]] = sm_count / (sm_count - sms)
    return out
