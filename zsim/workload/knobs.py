"""DeepSpeed's zero_optimization knobs (DeepSpeed 0.19, `deepspeed/runtime/zero/config.py`)."""

from __future__ import annotations

from dataclasses import dataclass

from zsim.errors import is_whole, require


@dataclass(frozen=True)
class ZeroKnobs:
    """DeepSpeed's zero_optimization knobs that change memory or the communication schedule.

    Sizes are in elements, as in DeepSpeed.
    """

    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    overlap_comm: bool | None = None  # None: DeepSpeed's default (True for stage 3 only)
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    use_multi_rank_bucket_allreduce: bool = True  # ZeRO-1/2: all-reduce whole buckets
    prefetch_bucket_size: int = 50_000_000
    param_persistence_threshold: int = 100_000
    max_live_parameters: int = 1_000_000_000
    max_reuse_distance: int = 1_000_000_000
    # ZeRO++ (Wang et al. 2023; DeepSpeed 0.19 zero/config.py): the secondary partition of
    # parameters over consecutive groups of this many ranks (hpZ), int8 parameter gathers (qwZ),
    # int4 gradients averaged by all-to-alls within and then across nodes (qgZ)
    hpz_partition_size: int = 1
    quantized_weights: bool = False
    quantized_gradients: bool = False

    def __post_init__(self) -> None:
        # DeepSpeed takes 0 for the stage-3 knobs (no prefetch, nothing persistent or kept
        # live or reused); a bucket of 0 elements would never fill
        for name in ("reduce_bucket_size", "allgather_bucket_size"):
            value = getattr(self, name)
            require(is_whole(value, 1), name, value, "a positive integer")
        stage3 = ("prefetch_bucket_size", "param_persistence_threshold", "max_live_parameters",
                  "max_reuse_distance")  # fmt: skip
        for name in stage3:
            value = getattr(self, name)
            require(is_whole(value), name, value, "a non-negative integer (0 turns it off)")
        h = self.hpz_partition_size
        require(is_whole(h), "zero_hpz_partition_size", h, "a non-negative integer (1: off)")
