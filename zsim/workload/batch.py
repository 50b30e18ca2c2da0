"""DeepSpeed's batch rule: train_batch_size = micro_batch_per_gpu x gradient_accumulation_steps
x dp, any two of the three giving the third."""

from __future__ import annotations

import math

from zsim.errors import InputError, positive_int


def resolve_batch(
    dp: int, micro_batch: int | None, grad_accum: int | None, global_batch: int | None
) -> tuple[int, int]:
    """(micro_batch, grad_accum) from any two of the three, by DeepSpeed's rule.

    Mirrors `DeepSpeedConfig._set_batch_related_parameters` and `_batch_assertion`:
    train_batch_size = micro_batch x grad_accum x dp, refused when inconsistent.
    """
    for name, value in (
        ("micro_batch", micro_batch),
        ("grad_accum", grad_accum),
        ("global_batch", global_batch),
    ):
        if value is not None:
            positive_int(name, value)
    if global_batch is None:
        return micro_batch or 1, grad_accum or 1
    given = [(n, v) for n, v in (("micro_batch", micro_batch), ("grad_accum", grad_accum)) if v]
    per_sample = math.prod(v for _, v in given) * dp  # what the batch must be a multiple of
    if len(given) < 2 and (global_batch % per_sample or global_batch < per_sample):
        factors = " x ".join([*(f"{n} {v}" for n, v in given), f"dp {dp}"])
        raise InputError(
            "global_batch",
            global_batch,
            f"a multiple of {factors} = {per_sample} (train_batch_size = micro_batch_per_gpu "
            "x gradient_accumulation_steps x dp)",
        )
    if micro_batch is None:
        micro_batch = global_batch // dp // (grad_accum or 1)
    if grad_accum is None:
        grad_accum = global_batch // micro_batch // dp
    if micro_batch * grad_accum * dp != global_batch:
        raise InputError(
            "global_batch",
            global_batch,
            "train_batch_size must equal micro_batch_per_gpu * gradient_acc_step * world_size "
            f"(dp): {global_batch} != {micro_batch} * {grad_accum} * {dp}",
        )
    return micro_batch, grad_accum
