"""A ds_config.json as users bring it: Hugging Face Trainer "auto" values filled, and its batch
merged with the batch flags.

The Trainer's DeepSpeed integration (transformers `integrations/deepspeed.py`,
`HfTrainerDeepSpeedConfig.trainer_config_process` and `trainer_config_finalize`) replaces
"auto" by its arguments: the micro-batch by `per_device_train_batch_size` (default 8), the
accumulation by `gradient_accumulation_steps` (default 1), `train_batch_size` by world size x
both, `fp16.enabled` / `bf16.enabled` by `--fp16` / `--bf16` (default off: fp32), and from
the model's hidden size h: `reduce_bucket_size` = h^2, and under ZeRO-3
`stage3_prefetch_bucket_size` = int(0.9 h^2) and `stage3_param_persistence_threshold` = 10 h.
zsim's flags stand for the Trainer's arguments. Keys zsim does not read (optimizer,
scheduler, clipping) may stay "auto".
"""

from __future__ import annotations

import copy
from typing import Any

from zsim.errors import InputError

TRAINER_MICRO_BATCH = 8  # TrainingArguments.per_device_train_batch_size default
TRAINER_GRAD_ACCUM = 1  # TrainingArguments.gradient_accumulation_steps default
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def fill_trainer_auto(
    ds: dict[str, Any],
    *,
    dp: int,
    micro: int | None,
    accum: int | None,
    global_batch: int | None,
    precision: str | None,
    hidden: int | None,
) -> tuple[dict[str, Any], list[str]]:
    """A copy of `ds` with the Trainer's "auto" values filled, and what was filled."""
    if not isinstance(ds, dict):
        return ds, []
    ds = copy.deepcopy(ds)
    filled: list[str] = []

    def fill(section: dict[str, Any], key: str, value: Any, name: str) -> None:
        if section.get(key) == "auto":
            section[key] = value
            filled.append(f"{name}={value}")

    if any(ds.get(k) == "auto" for k in BATCH_KEYS):
        m = micro or TRAINER_MICRO_BATCH
        a = accum or (global_batch // (m * dp) if global_batch and micro else TRAINER_GRAD_ACCUM)
        if global_batch and not micro:
            m = max(1, global_batch // (a * dp))
        fill(ds, "train_micro_batch_size_per_gpu", m, "train_micro_batch_size_per_gpu")
        fill(ds, "gradient_accumulation_steps", a, "gradient_accumulation_steps")
        fill(ds, "train_batch_size", global_batch or m * a * dp, "train_batch_size")
    for kind in ("fp16", "bf16"):
        section = ds.get(kind)
        if isinstance(section, dict):
            fill(section, "enabled", precision == kind, f"{kind}.enabled")
    zero = ds.get("zero_optimization")
    if isinstance(zero, dict):
        _fill_zero(zero, hidden, fill)
    return ds, filled


def _fill_zero(zero: dict[str, Any], hidden: int | None, fill: Any) -> None:
    sized = ["reduce_bucket_size"]
    if zero.get("stage") == 3:
        sized += ["stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"]
    wanted = [k for k in sized if zero.get(k) == "auto"]
    if not wanted:
        return
    if hidden is None:
        raise InputError(
            f"zero_optimization.{wanted[0]}",
            "auto",
            "a number, or a model with a hidden size (--model): the Trainer fills it from h",
        )
    fill(zero, "reduce_bucket_size", hidden * hidden, "reduce_bucket_size")
    fill(zero, "stage3_prefetch_bucket_size", int(0.9 * hidden * hidden), "prefetch_bucket_size")
    fill(zero, "stage3_param_persistence_threshold", 10 * hidden, "param_persistence_threshold")


def merged_batch(
    ds: dict[str, Any], micro: int | None, accum: int | None, global_batch: int | None
) -> tuple[int | None, int | None, int | None]:
    """(micro, accum, global) from the flags, completed by the file: flags win, and the
    file's values fill in while fewer than two are known, train_batch_size first (the
    quantity DeepSpeed is configured by), so `--micro-batch 2` over a file's
    train_batch_size 256 keeps 256 and derives the accumulation."""
    known = {"micro": micro, "accum": accum, "global": global_batch}
    from_file = {
        "global": ds.get("train_batch_size"),
        "micro": ds.get("train_micro_batch_size_per_gpu"),
        "accum": ds.get("gradient_accumulation_steps"),
    }
    given = sum(v is not None for v in known.values())
    if given == 0:
        return from_file["micro"], from_file["accum"], from_file["global"]
    for key, value in from_file.items():
        if given >= 2:
            break
        if known[key] is None and value is not None:
            known[key] = value
            given += 1
    return known["micro"], known["accum"], known["global"]
