"""Scenario = model + parallel layout + device (+ topology): built from flags or files.

This is the boundary where raw user input (strings from the command line, dicts from a
ds_config.json) becomes validated, immutable data. Nothing downstream re-validates.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from zsim.cluster.device import DeviceProfile
from zsim.errors import InputError, count, positive_int, require
from zsim.inputs.ds_file import fill_trainer_auto, merged_batch
from zsim.inputs.files import load_json, load_mapping
from zsim.workload import context_parallel
from zsim.workload import model_presets as models
from zsim.workload import parallel as par
from zsim.workload.batch import resolve_batch
from zsim.workload.ds_config import from_ds_config
from zsim.workload.layout import check_split
from zsim.workload.model import ModelKind, ModelSpec
from zsim.workload.parallel import ParallelConfig
from zsim.workload.te_overlap import from_ub_cfgs


@dataclass(frozen=True)
class Scenario:
    model: ModelSpec
    parallel: ParallelConfig
    device: DeviceProfile


def parse_int(field: str, text: str | int | None) -> int | None:
    """A positive integer from a flag; accepts 5e8-style notation when it is whole."""
    if text is None:
        return None
    if isinstance(text, int):
        return positive_int(field, text)
    try:
        value = float(text)
    except ValueError:
        raise InputError(field, text, "a positive integer") from None
    require(value.is_integer() and value > 0, field, text, "a positive integer")
    return int(value)


def parse_count(field: str, text: str | int) -> int:
    """A non-negative integer from a flag (a knob where 0 turns something off)."""
    if isinstance(text, str):
        try:
            return count(field, float(text))
        except ValueError:
            raise InputError(field, text, "a non-negative integer") from None
    return count(field, text)


def parse_choice(field: str, text: str | None, enum: type[Any]) -> Any:
    if text is None:
        return None
    try:
        return enum(text)
    except ValueError:
        raise InputError(field, text, "one of " + ", ".join(str(e.value) for e in enum)) from None


def build_model(
    name: str | None = None, params: str | None = None, **shape: str | None
) -> ModelSpec:
    """A model from a preset (`PRESET[:key=value,...]`, the grammar everywhere), a parameter
    count, or shape flags over a preset (default gpt-125m when only shape flags are given);
    flags win over the name's keys."""
    if name is not None and ":" in name:
        name, written = _shape_of(name)
        shape = written | {k: v for k, v in shape.items() if v is not None}
    sizes = {k: parse_int(k, v) for k, v in shape.items()}
    if params is not None:
        require(
            name is None and not any(v is not None for v in sizes.values()),
            "params",
            params,
            "either --params or --model/shape flags, not both",
        )
        try:
            count = float(params)
        except ValueError:
            raise InputError("params", params, "a number of parameters, e.g. 7.5e9") from None
        return models.from_params(count)
    base = models.preset(name or "gpt-125m")
    if base.kind is ModelKind.MLP:
        allowed = {"layers", "hidden"}
        extra = [k for k, v in sizes.items() if v is not None and k not in allowed]
        require(not extra, extra[0] if extra else "", None, "toy-mlp takes only --layers, --hidden")
    return models.with_overrides(base, **sizes)  # type: ignore[arg-type]


_SHAPE_KEYS = ("layers", "hidden", "heads", "ffn-hidden", "seq-len", "vocab", "kv-heads")


def parse_model(text: str) -> ModelSpec:
    """`PRESET[:key=value,...]` -> a ModelSpec (keys as the shape flags: seq-len, hidden, ...)."""
    return build_model(text, None)


def _shape_of(text: str) -> tuple[str, dict[str, str | None]]:
    name, _, rest = text.partition(":")
    shape: dict[str, str | None] = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        require(
            bool(eq) and key in _SHAPE_KEYS,
            "model",
            text,
            f"PRESET[:key=value,...] with keys {', '.join(_SHAPE_KEYS)}",
        )
        shape[key.replace("-", "_")] = value
    return name, shape


def build_parallel(
    ds_config: Path | None = None, hidden: int | None = None, **flags: Any
) -> tuple[ParallelConfig, list[str]]:
    """A ParallelConfig from flags, over a ds_config.json when one is given, and notes on
    what was assumed (Hugging Face "auto" values filled, fp32 when the file enables no
    16-bit type). Flags win over the file. The batch obeys DeepSpeed's rule. `hidden`: the
    model's, for the Trainer's "auto" bucket sizes."""
    dp = parse_int("dp", flags.pop("dp", None))
    tp = parse_int("tp", flags.pop("tp", None)) or 1
    pp = parse_int("pp", flags.pop("pp", None)) or 1
    micro = parse_int("micro_batch", flags.pop("micro_batch", None))
    accum = parse_int("grad_accum", flags.pop("grad_accum", None))
    global_batch = parse_int("global_batch", flags.pop("global_batch", None))
    stage = flags.pop("stage", None)
    if stage is not None:
        require(str(stage) in ("0", "1", "2", "3"), "stage", stage, "0, 1, 2 or 3")
        stage = par.ZeroStage(int(stage))
    enums = {k: e for k, e in par.ENUM_FIELDS.items() if k != "zero_stage"}  # stage: 0-3
    choices = {k: parse_choice(k, flags.pop(k, None), e) for k, e in enums.items()}
    knob_flags = {k: flags.pop(k) for k in list(flags) if k in _KNOBS and flags[k] is not None}
    for k, v in knob_flags.items():
        if not isinstance(v, bool):
            knob_flags[k] = parse_count(k, v)
    other = {k: v for k, v in flags.items() if v is not None}
    ub_file = other.pop("tp_comm_overlap_cfg", None)  # Megatron's flag: TE's ub_cfgs YAML
    if ub_file is not None:
        other["tp_overlap_sms"] = from_ub_cfgs(load_mapping(Path(ub_file), "tp_comm_overlap_cfg"))
    for name in ("cp", "virtual_stages", "fsdp_shard_size"):
        if name in other:
            other[name] = parse_int(name, other[name])
    notes: list[str] = []
    if ds_config is not None:
        precision = choices["precision"]
        cfg, notes = _from_file(
            ds_config, dp, tp, pp, (micro, accum, global_batch), hidden, precision
        )
    else:
        dp = dp or 1
        m, a = resolve_batch(dp, micro, accum, global_batch)
        cfg = ParallelConfig(dp=dp, tp=tp, pp=pp, micro_batch=m, grad_accum=a)
    updates: dict[str, Any] = {k: v for k, v in choices.items() if v is not None} | other
    if stage is None and choices["dp_engine"] is par.DpEngine.FSDP:
        stage = par.ZeroStage.PARAMETERS  # FSDP shards all three model states
    if stage is not None:
        updates["zero_stage"] = stage
    if knob_flags:
        updates["knobs"] = replace(cfg.knobs, **knob_flags)
    cfg = replace(cfg, **updates)
    if ub_file is not None and not cfg.tp_comm_overlap:
        notes.append("--tp-comm-overlap-cfg has no effect without --tp-comm-overlap")
    return cfg, notes


def _from_file(
    path: Path,
    dp: int | None,
    tp: int,
    pp: int,
    batch: tuple[int | None, int | None, int | None],
    hidden: int | None,
    precision: par.Precision | None,
) -> tuple[ParallelConfig, list[str]]:
    raw = load_json(path, "ds_config")
    micro, accum, global_batch = batch
    ds, filled = fill_trainer_auto(
        raw,
        dp=dp or 1,
        micro=micro,
        accum=accum,
        global_batch=global_batch,
        precision=None if precision is None else str(precision),
        hidden=hidden,
    )
    notes = [f"{path.name}: filled as the Hugging Face Trainer does: {', '.join(filled)}"]
    notes = notes if filled else []
    cfg = from_ds_config(ds, dp=dp, tp=tp, pp=pp)
    micro, accum, global_batch = merged_batch(ds, micro, accum, global_batch)
    require(
        micro is not None or global_batch is not None,
        "train_batch_size",
        None,
        "train_batch_size or train_micro_batch_size_per_gpu in the file, or a batch flag "
        "(DeepSpeed needs one of them)",
    )
    m, a = resolve_batch(cfg.dp, micro, accum, global_batch)
    if precision is None and cfg.precision is par.Precision.FP32:
        notes.append(f"{path.name} enables neither fp16 nor bf16: fp32, DeepSpeed's default")
    return replace(cfg, micro_batch=m, grad_accum=a), notes


_KNOBS = set(par.ZeroKnobs.__dataclass_fields__)


def dp_left(world: int, cluster: str, tp: int, pp: int, cp: int) -> int:
    """The data-parallel size a cluster of `world` GPUs leaves beside tp x pp x cp."""
    split = tp * pp * cp
    what = "tp x pp x cp" if cp > 1 else "tp x pp"
    require(world % split == 0, what, split, f"a divisor of the {world} GPUs of {cluster}")
    return world // split


def check_layout(model: ModelSpec, cfg: ParallelConfig) -> None:
    """Refuse layouts Megatron cannot build: TP must divide heads, hidden and ffn; PP the
    layers."""
    if model.kind is ModelKind.PARAMS_ONLY:
        return
    if model.kind is ModelKind.TRANSFORMER:
        for name, size in (
            ("heads", model.heads),
            ("ffn_hidden", model.ffn_hidden),
            ("kv_heads", model.n_kv_heads),
        ):
            require(size % cfg.tp == 0, "tp", cfg.tp, f"a divisor of {name}={size}")
    else:
        require(model.hidden % cfg.tp == 0, "tp", cfg.tp, f"a divisor of hidden={model.hidden}")
    # DeepSpeed's PipelineModule splits uneven layer counts (partition_uniform); Megatron's
    # interleaved schedule needs every model chunk to hold the same number of layers
    if cfg.virtual_stages > 1:
        require(
            model.layers % (cfg.pp * cfg.virtual_stages) == 0,
            "pp",
            cfg.pp,
            f"pp x virtual_stages dividing layers={model.layers} (interleaved schedule)",
        )
    require(model.layers >= cfg.pp, "pp", cfg.pp, f"at most layers={model.layers}")
    context_parallel.check_model(model, cfg.cp)
    check_split(model, cfg)
