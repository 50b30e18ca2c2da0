"""ZeRO++ (Wang et al. 2023) as DeepSpeed 0.19 reads it: which of its parts act in a layout,
and the layouts it refuses. Its knobs act in ZeRO-3 only, as there."""

from __future__ import annotations

from typing import Protocol

from zsim.errors import require

_PARAMETERS = 3  # ZeroStage.PARAMETERS


class _Knobs(Protocol):
    @property
    def hpz_partition_size(self) -> int: ...
    @property
    def quantized_weights(self) -> bool: ...
    @property
    def quantized_gradients(self) -> bool: ...
    @property
    def reduce_scatter(self) -> bool: ...


class _Layout(Protocol):
    """The fields of a `ParallelConfig` the rules read (this module stays below
    `zsim.workload.parallel`, whose ZeroStage compares equal to its value)."""

    @property
    def dp(self) -> int: ...
    @property
    def tp(self) -> int: ...
    @property
    def pp(self) -> int: ...
    @property
    def zero_stage(self) -> int: ...
    @property
    def knobs(self) -> _Knobs: ...
    @property
    def world_size(self) -> int: ...


def check(cfg: _Layout) -> None:
    """hpZ groups are consecutive global ranks that must divide the world (utils/groups.py)
    and stand for data-parallel ranks (partition_parameters.py counts dp / h of them); qgZ's
    all-to-all groups are a node's global ranks and the same GPU of every node: neither runs
    with model parallelism. qgZ needs `reduce_scatter` (stage3.py asserts it)."""
    if cfg.zero_stage != _PARAMETERS:
        return
    k = cfg.knobs
    if k.quantized_gradients:
        require(
            cfg.tp == cfg.pp == 1,
            "zero_quantized_gradients",
            True,
            "false with tp or pp > 1 (DeepSpeed's qgZ all-to-alls run over every GPU of a "
            "node and the same GPU of every node, as if all were data-parallel)",
        )
        require(k.reduce_scatter, "reduce_scatter", False, "true with qgZ (DeepSpeed asserts it)")
    h = k.hpz_partition_size
    if h <= 1:
        return
    require(cfg.dp % h == 0, "zero_hpz_partition_size", h, f"a divisor of dp={cfg.dp}")
    require(
        cfg.tp == cfg.pp == 1,
        "zero_hpz_partition_size",
        h,
        "1 with tp or pp > 1 (DeepSpeed builds hpZ groups from global ranks as if all were "
        "data-parallel)",
    )


def parts(cfg: _Layout) -> str:
    """ZeRO++'s parts that act in this layout, in the paper's names ("" for none)."""
    if cfg.zero_stage != _PARAMETERS:
        return ""
    k = cfg.knobs
    found = [f"hpZ {k.hpz_partition_size}"] if k.hpz_partition_size > 1 else []
    found += ["qwZ"] if k.quantized_weights else []
    return ", ".join(found + (["qgZ"] if k.quantized_gradients else []))


def qgz_nodes(cfg: _Layout, node_gpus: int) -> int:
    """The nodes qgZ averages gradients across, for nodes of `node_gpus` GPUs (DeepSpeed's
    `device_count()`); 0 where it does not act: off, not ZeRO-3, or one node (stage3.py
    `__avg_scatter_grads` needs `num_nodes > 1`)."""
    nodes = cfg.world_size // node_gpus
    on = cfg.knobs.quantized_gradients and cfg.zero_stage == _PARAMETERS
    return nodes if on and nodes > 1 else 0
