"""A `ParallelConfig` from a DeepSpeed `ds_config.json` (as a dict) and back. File I/O lives in
`zsim.inputs.files`; keys and defaults follow DeepSpeed 0.19."""

from __future__ import annotations

from typing import Any

from zsim.errors import InputError, count, positive_int, require
from zsim.workload.batch import resolve_batch
from zsim.workload.parallel import (
    Offload,
    ParallelConfig,
    Precision,
    Recompute,
    ZeroKnobs,
    ZeroStage,
)

_KNOB_KEYS = {
    "reduce_bucket_size": "reduce_bucket_size",
    "allgather_bucket_size": "allgather_bucket_size",
    "overlap_comm": "overlap_comm",
    "contiguous_gradients": "contiguous_gradients",
    "reduce_scatter": "reduce_scatter",
    "use_multi_rank_bucket_allreduce": "use_multi_rank_bucket_allreduce",
    "stage3_prefetch_bucket_size": "prefetch_bucket_size",
    "stage3_param_persistence_threshold": "param_persistence_threshold",
    "stage3_max_live_parameters": "max_live_parameters",
    "stage3_max_reuse_distance": "max_reuse_distance",
    "zero_hpz_partition_size": "hpz_partition_size",
    "zero_quantized_weights": "quantized_weights",
    "zero_quantized_gradients": "quantized_gradients",
}


_BOOL_KNOBS = (
    "quantized_weights",
    "quantized_gradients",
    "overlap_comm",
    "contiguous_gradients",
    "reduce_scatter",
    "use_multi_rank_bucket_allreduce",
)


def _no_auto(key: str, value: Any) -> Any:
    if value == "auto":
        raise InputError(
            key,
            "auto",
            'a concrete value: zsim fills "auto" only where the Hugging Face Trainer does '
            "(batch sizes, fp16/bf16.enabled, reduce_bucket_size, and under ZeRO-3 "
            "stage3_prefetch_bucket_size and stage3_param_persistence_threshold)",
        )
    return value


def _precision(ds: dict[str, Any]) -> Precision:
    enabled = [
        p
        for p in (Precision.FP16, Precision.BF16)
        if _no_auto(f"{p}.enabled", ds.get(str(p), {}).get("enabled", False)) is True
    ]
    require(len(enabled) <= 1, "fp16/bf16", "both enabled", "at most one of fp16 and bf16")
    return enabled[0] if enabled else Precision.FP32


def _offload(zero: dict[str, Any]) -> Offload:
    def on(key: str) -> bool:
        device = (zero.get(key) or {}).get("device", "none")
        require(
            device in ("none", "cpu"),
            f"zero_optimization.{key}.device",
            device,
            "none or cpu (NVMe offload is not modelled)",
        )
        return bool(device == "cpu")

    if on("offload_param"):
        return Offload.OPTIMIZER_PARAMS
    return Offload.OPTIMIZER if on("offload_optimizer") else Offload.NONE


def _check_unmodelled(zero: dict[str, Any]) -> None:
    """Keys DeepSpeed 0.19.8 no longer takes: refused rather than ignored."""
    for key in ("mics_shard_size", "mics_hierarchical_params_gather"):
        require(
            key not in zero,
            f"zero_optimization.{key}",
            zero.get(key),
            "absent: DeepSpeed 0.19.8 removed MiCS (runtime/config.py rejects the key)",
        )


def _knobs(zero: dict[str, Any]) -> ZeroKnobs:
    """The zero_optimization knobs zsim simulates, checked as DeepSpeed would read them."""
    knobs: dict[str, Any] = {}
    for key, name in _KNOB_KEYS.items():
        if key not in zero:
            continue
        field, value = f"zero_optimization.{key}", _no_auto(f"zero_optimization.{key}", zero[key])
        if name in _BOOL_KNOBS:  # a string such as "no" would read as true: JSON booleans only
            require(isinstance(value, bool), field, value, "true or false")
            knobs[name] = value
        else:
            knobs[name] = count(field, value)
    return ZeroKnobs(**knobs)


def from_ds_config(
    ds: dict[str, Any], dp: int | None = None, tp: int = 1, pp: int = 1, **overrides: Any
) -> ParallelConfig:
    """A ParallelConfig from a DeepSpeed config dict; dp from the argument or the batch rule."""
    require(isinstance(ds, dict), "ds_config", type(ds).__name__, "a JSON object")
    zero = ds.get("zero_optimization", {})
    require(isinstance(zero, dict | None), "zero_optimization", zero, "a JSON object")
    zero = zero or {}
    _check_unmodelled(zero)
    stage = _no_auto("zero_optimization.stage", zero.get("stage", 0))
    require(
        stage in (0, 1, 2, 3) and not isinstance(stage, bool),
        "zero_optimization.stage",
        stage,
        "0, 1, 2 or 3",
    )
    batch = {
        k: _no_auto(k, ds.get(k))
        for k in (
            "train_batch_size",
            "train_micro_batch_size_per_gpu",
            "gradient_accumulation_steps",
        )
    }
    for key, value in batch.items():
        if value is not None:
            batch[key] = positive_int(key, value)
    if dp is None:
        dp = _dp_from_batch(batch)
    micro, accum = resolve_batch(
        dp,
        batch["train_micro_batch_size_per_gpu"],
        batch["gradient_accumulation_steps"],
        batch["train_batch_size"],
    )
    fields: dict[str, Any] = {
        "dp": dp,
        "tp": tp,
        "pp": pp,
        "zero_stage": ZeroStage(stage),
        "micro_batch": micro,
        "grad_accum": accum,
        "precision": _precision(ds),
        "offload": _offload(zero),
        "knobs": _knobs(zero),
    }
    if (ds.get("activation_checkpointing") or {}).get("partition_activations") is not None:
        fields["recompute"] = Recompute.FULL
    fields.update({k: v for k, v in overrides.items() if v is not None})
    return ParallelConfig(**fields)


def _dp_from_batch(batch: dict[str, Any]) -> int:
    train, micro, accum = (
        batch["train_batch_size"],
        batch["train_micro_batch_size_per_gpu"],
        batch["gradient_accumulation_steps"],
    )
    if train is None or micro is None:
        raise InputError(
            "dp",
            None,
            "give --dp, or all of train_batch_size, "
            "train_micro_batch_size_per_gpu (and gradient_accumulation_steps) "
            "in ds_config.json so dp follows from the batch rule",
        )
    positive_int("train_batch_size", train)
    positive_int("train_micro_batch_size_per_gpu", micro)
    per_rank = micro * (positive_int("gradient_accumulation_steps", accum) if accum else 1)
    require(
        train % per_rank == 0,
        "train_batch_size",
        train,
        f"a multiple of micro_batch x grad_accum = {per_rank}",
    )
    return int(train // per_rank)


def to_ds_config(cfg: ParallelConfig) -> dict[str, Any]:
    """A DeepSpeed config that runs this layout (the ZeRO part; TP/PP belong to Megatron)."""
    k = cfg.knobs
    zero: dict[str, Any] = {
        "stage": int(cfg.zero_stage),
        "overlap_comm": cfg.overlap_comm,
        "contiguous_gradients": k.contiguous_gradients,
        "reduce_scatter": k.reduce_scatter,
        "reduce_bucket_size": k.reduce_bucket_size,
        "allgather_bucket_size": k.allgather_bucket_size,
    }
    if cfg.zero_stage is ZeroStage.PARAMETERS:
        zero |= {
            "stage3_prefetch_bucket_size": k.prefetch_bucket_size,
            "stage3_param_persistence_threshold": k.param_persistence_threshold,
            "stage3_max_live_parameters": k.max_live_parameters,
            "stage3_max_reuse_distance": k.max_reuse_distance,
        }
        if k.hpz_partition_size > 1:
            zero["zero_hpz_partition_size"] = k.hpz_partition_size
        if k.quantized_weights:
            zero["zero_quantized_weights"] = True
        if k.quantized_gradients:
            zero["zero_quantized_gradients"] = True
    if cfg.offload is not Offload.NONE:
        zero["offload_optimizer"] = {"device": "cpu"}
    if cfg.offload is Offload.OPTIMIZER_PARAMS:
        zero["offload_param"] = {"device": "cpu"}
    ds: dict[str, Any] = {
        "train_batch_size": cfg.global_batch,
        "train_micro_batch_size_per_gpu": cfg.micro_batch,
        "gradient_accumulation_steps": cfg.grad_accum,
        "zero_optimization": zero,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
    }
    if cfg.precision.mixed:
        ds[str(cfg.precision)] = {"enabled": True}
    return ds


def to_training_ds_config(cfg: ParallelConfig) -> dict[str, Any]:
    """`to_ds_config` as zsim's real runs train with it: DeepSpeed's torch Adam (it runs on
    CPU ranks too) and its step logging quiet."""
    ds = to_ds_config(cfg)
    ds["optimizer"] = {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}}
    ds["steps_per_print"] = 1 << 30
    return ds
