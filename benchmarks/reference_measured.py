"""A published row's own numbers: its fields parsed, and its measured step time (a row that
reports only TFLOP/s is converted with its source's own formula, never with zsim's)."""

from __future__ import annotations

import re
import statistics

from zsim.workload.model import ModelSpec


class Skip(Exception):
    """A row that cannot be mapped to a zsim scenario; the message says why."""


_NUMBER = re.compile(r"^\s*(\d[\d,]*(?:\.\d+)?)(?![\w.])")


def num(row: dict[str, str], key: str) -> float | None:
    """The row's number in `key` (the mean when it lists several as 'a / b / c')."""
    text = row.get(key, "").strip()
    parts = text.split(" / ")
    values = []
    for part in parts:
        match = _NUMBER.match(part)
        if not match:
            return None
        values.append(float(match.group(1).replace(",", "")))
    return statistics.fmean(values) if values else None


def integer(row: dict[str, str], key: str) -> int | None:
    value = num(row, key)
    if value is None:
        return None
    if not float(value).is_integer():
        raise Skip(f"{key}={row[key]!r} is not a whole number")
    return int(value)


def text(row: dict[str, str], key: str) -> str:
    return row.get(key, "").strip().lower()


def measured(row: dict[str, str], model: ModelSpec) -> tuple[float, str]:
    """The measured step time and where it came from (the row's own numbers only)."""
    batch, gpus = integer(row, "global_batch_size") or 0, integer(row, "num_gpus") or 0
    tokens = batch * model.seq_len
    if (step := num(row, "step_time_s")) is not None:
        check_consistent(row, model, step)
        return step, "step_time_s"
    if (tps := num(row, "tokens_per_s")) is not None:
        return tokens / tps, "tokens_per_s"
    if (tpg := num(row, "tokens_per_s_per_gpu")) is not None:
        return tokens / (tpg * gpus), "tokens_per_s_per_gpu"
    if (sps := num(row, "samples_per_s")) is not None:
        return batch / sps, "samples_per_s"
    if (step := num(row, "derived_step_time_s")) is not None:
        return step, "derived_step_time_s (source's FLOP formula)"
    tflops, definition = num(row, "tflops_per_gpu"), text(row, "tflops_definition")
    if tflops is not None and "megatron flop formula (includes recompute)" in definition:
        step = tflops_step_s(model, batch, tflops, gpus, recompute=True)
        return step, "tflops_per_gpu (Megatron hardware formula)"
    if tflops is not None and definition.startswith("model tflop/s"):
        step = tflops_step_s(model, batch, tflops, gpus, recompute=False)
        return step, "tflops_per_gpu (Megatron model formula)"
    raise Skip("no step time, throughput or convertible TFLOP/s")


AGREE = 0.20
"""How far a row's step time may lie from the one its own TFLOP/s give by its source's
formula: in BLOOM's file 99 of 102 rows that report both agree within 5 % (rounding), the
other three by 4x."""


def check_consistent(row: dict[str, str], model: ModelSpec, step: float) -> None:
    """Skip a row whose step time and hardware TFLOP/s (Megatron-DeepSpeed's formula with
    recompute, `megatron_flops`) disagree: the batch it ran is not the one it states (BLOOM's
    18B probes, 02-21: 0.25x, a quarter of the stated 2,048 sequences)."""
    tflops, definition = num(row, "tflops_per_gpu"), text(row, "tflops_definition")
    gpus, batch = integer(row, "num_gpus"), integer(row, "global_batch_size")
    if tflops is None or not gpus or not batch or "hardware tflops incl" not in definition:
        return
    implied = tflops_step_s(model, batch, tflops, gpus, recompute=True)
    if abs(step / implied - 1) > AGREE:
        raise Skip(
            f"its step time ({step:.4g} s) and its TFLOP/s ({implied:.4g} s by the source's "
            f"formula) disagree (x{step / implied:.2f}): it did not run the batch it states"
        )


def tflops_step_s(model: ModelSpec, batch: int, tflops: float, gpus: int, recompute: bool) -> float:
    """The step a reported TFLOP/s per GPU stands for, by the source's formula."""
    return megatron_flops(model, batch, recompute) / (tflops * 1e12 * gpus)


def megatron_flops(model: ModelSpec, batch: int, recompute: bool) -> float:
    """The FLOPs of one step by the formula the Megatron sources report TFLOP/s with
    (Narayanan et al. 2021, section 5.1): 96 B s l h^2 (1 + s/6h + V/16lh) with recompute,
    72 B s l h^2 (1 + s/6h + V/12lh) without. Used only to convert a reported TFLOP/s back
    to the step time it was computed from."""
    b, s, layers, h, v = batch, model.seq_len, model.layers, model.hidden, model.vocab
    if recompute:
        return 96 * b * s * layers * h**2 * (1 + s / (6 * h) + v / (16 * layers * h))
    return 72 * b * s * layers * h**2 * (1 + s / (6 * h) + v / (12 * layers * h))
