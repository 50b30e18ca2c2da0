"""PyTorch FSDP's sharding strategies, and the rules zsim holds an FSDP layout to.

FSDP2 (`torch.distributed.fsdp.fully_shard`, torch 2.13) spells the strategies of FSDP1's
`ShardingStrategy` as arguments: FULL_SHARD is `reshard_after_forward=True` (the default),
SHARD_GRAD_OP is `reshard_after_forward=False`, HYBRID_SHARD is a 2D device mesh
(replicate, shard) whose inner dimension, consecutive ranks, shards. All three shard the
parameters, the gradients and the optimizer states over the shard group; they differ in when
the parameters are gathered (`zsim.step.fsdp`).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Protocol

from zsim.errors import require
from zsim.workload.model import Layer, LayerKind

UNIT_KINDS = (LayerKind.BLOCK, LayerKind.LINEAR)  # wrapped one by one; the rest is the root


def is_unit(layer: Layer) -> bool:
    """A layer FSDP wraps as a unit of its own: a block (an MLP layer) holding parameters."""
    return layer.kind in UNIT_KINDS and bool(layer.tensors)


class FsdpSharding(StrEnum):
    FULL = "full"  # FULL_SHARD: each unit gathered again for its backward
    GRAD_OP = "grad-op"  # SHARD_GRAD_OP: kept gathered from its forward to its backward
    HYBRID = "hybrid"  # HYBRID_SHARD: FULL_SHARD within fsdp_shard_size ranks, replicated


class _Layout(Protocol):
    """The fields of a `ParallelConfig` the rules read (its enums compare equal to their
    values: this module stays below `zsim.workload.parallel`)."""

    @property
    def dp(self) -> int: ...
    @property
    def cp(self) -> int: ...
    @property
    def pp(self) -> int: ...
    @property
    def zero_stage(self) -> int: ...
    @property
    def offload(self) -> str: ...
    @property
    def dp_engine(self) -> str: ...
    @property
    def fsdp_sharding(self) -> FsdpSharding: ...
    @property
    def fsdp_shard_size(self) -> int: ...
    @property
    def knobs(self) -> Any: ...


def shard_ranks(cfg: _Layout) -> int:
    """The ranks one copy of the sharded model states spans: the hybrid mesh's shard
    dimension, else every data-parallel rank (with context parallelism, data x context)."""
    hybrid = cfg.dp_engine == "fsdp" and cfg.fsdp_sharding is FsdpSharding.HYBRID
    return cfg.fsdp_shard_size if hybrid else cfg.dp * cfg.cp


def node_shard_size(gpus_per_node: int, tp: int, dp: int) -> int:
    """HYBRID_SHARD's shard group when none is given: the data-parallel ranks of one node, as
    torch's FSDP shards within a node and replicates across nodes when given no process group
    (`_init_intra_and_inter_node_groups`), and as FSDP2's users build their 2D mesh."""
    return max(1, min(dp, gpus_per_node // tp))


def default_shard_size(gpus_per_node: int, tp: int, dp: int) -> int:
    """--sharding hybrid's shard group when --shard-size is not given (`node_shard_size`),
    refused in one line where a node holds every data-parallel rank."""
    size = node_shard_size(gpus_per_node, tp, dp)
    fits = f"a divisor of dp={dp} from 2 to {dp // 2}, or " if dp >= 4 else ""
    require(
        size < dp,
        "shard_size",
        f"unset (one node holds all {dp} data-parallel ranks)",
        f"set with --sharding hybrid on one node: {fits}--sharding full (hybrid replicates "
        "the model states across shard groups)",
    )
    return size


def check_fsdp(cfg: _Layout) -> None:
    """What zsim's FSDP covers (`dp_engine: fsdp`): ZeRO-3's partition of all three model
    states, on its own engine (no DeepSpeed knobs), without pipeline parallelism or CPU
    offload (torchtitan composes both; zsim does not model them yet)."""
    size = cfg.fsdp_shard_size
    if cfg.dp_engine != "fsdp":
        unused = cfg.fsdp_sharding is FsdpSharding.FULL and size == 0
        require(unused, "fsdp_sharding", str(cfg.fsdp_sharding), "full unless dp_engine fsdp")
        return
    reason = "3 with dp_engine fsdp (FSDP shards parameters, gradients, optimizer states)"
    require(cfg.zero_stage == 3, "zero_stage", int(cfg.zero_stage), reason)
    require(cfg.pp == 1, "pp", cfg.pp, "1 with dp_engine fsdp (FSDP with PP: not modelled)")
    require(cfg.offload == "none", "offload", str(cfg.offload), "none with dp_engine fsdp")
    k = cfg.knobs
    zpp = k.hpz_partition_size <= 1 and not k.quantized_weights
    require(zpp, "zero_hpz_partition_size", k.hpz_partition_size, "off (ZeRO++) with fsdp")
    off = "false with fsdp (ZeRO++ is DeepSpeed's)"
    require(not k.quantized_gradients, "zero_quantized_gradients", True, off)
    if cfg.fsdp_sharding is not FsdpSharding.HYBRID:
        allowed = "0 (the data-parallel group) unless --sharding hybrid"
        require(size in (0, cfg.dp), "fsdp_shard_size", size, allowed)
        return
    fits = 1 < size < cfg.dp and cfg.dp % size == 0
    allowed = f"a divisor of dp={cfg.dp} from 2 to {cfg.dp // 2} with --sharding hybrid"
    require(fits, "fsdp_shard_size", size, allowed)
