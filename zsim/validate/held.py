"""The tensors a real DeepSpeed engine (or PyTorch FSDP2) holds, by ledger category (needs
torch).

The engine's objects (its module's parameters, the ZeRO optimizer wrapper, the torch optimizer
it wraps, the engine itself) are walked for tensors; each tensor is reduced to its storage, so a
view (a parameter inside a flat buffer, a gradient inside a bucket) counts once; each storage is
classified by the names it was reached under, in this order:

  optimizer_states  the torch optimizer's `state` (Adam's exp_avg, exp_avg_sq, step)
  comm_buffers      DeepSpeed's communication buckets (`ipg` reduce buckets, all-gather buffers)
                    and, under ZeRO-3, parameters while gathered for compute
  gradients         `.grad` and DeepSpeed's gradient partitions (`averaged_gradients`, ...)
  optimizer_states  the fp32 master partition (`single_partition_of_fp32_groups`, ...)
  parameters        the module's parameters and their flat or partitioned buffers
  other             anything else DeepSpeed keeps (recorded so that nothing is hidden)

Sizes are the bytes of the storages, which is what a GPU allocates. On a CPU, `torch.empty`
does not touch its pages, so a large bucket that is never filled counts here but not in the
resident set size: both are reported, and they answer different questions.

Activations are not held by the engine: `SavedTensors` counts the tensors autograd saves for
backward during one micro-batch (parameters excluded), by storage.
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from zsim.testbed.fsdp_engine import FsdpEngine, local

CATEGORIES = ("parameters", "gradients", "optimizer_states", "comm_buffers", "other")

# FSDP2's unsharded gradients and reduce-scatter inputs are its comm buffers too (the ledger's)
_COMM = r"ipg|bucket|allgather|all_gather|prefetch|^gathered<[^>]*>$|unsharded_grad|reduce_scatter"
# ZeRO++'s hpZ keeps a secondary partition of each parameter (`ds_secondary_tensor`)
_PARAMS = r"^param<[^>]*>$|>\.ds_tensor$|>\.ds_secondary_tensor$|bit16|fp16|bf16|lp_param"
_RULES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("optimizer_states", re.compile(r"\.state\[")),
    ("comm_buffers", re.compile(_COMM, re.I)),
    ("gradients", re.compile(r"grad", re.I)),
    ("optimizer_states", re.compile(r"fp32", re.I)),
    ("parameters", re.compile(_PARAMS, re.I)),
)
# a storage reached under several names takes the first of these that any name gave it
_PRIORITY = ("comm_buffers", "optimizer_states", "gradients", "parameters", "other")
_SKIP = {"_z3_optimizer", "timers", "monitor", "mpu", "_config", "config", "tput_timer", "logger"}
_WALKED_MODULES = ("deepspeed", "torch.optim")
_MAX_DEPTH = 12


def classify(path: str) -> str:
    """The category of one name a storage was reached under (the first rule that matches)."""
    for category, pattern in _RULES:
        if pattern.search(path):
            return category
    return "other"


@dataclass
class _Storage:
    nbytes: int
    paths: list[str] = field(default_factory=list)  # the first few, for the record
    categories: set[str] = field(default_factory=set)  # of every name

    @property
    def category(self) -> str:
        return next(c for c in _PRIORITY if c in self.categories)


class Inventory:
    """Storages reachable from the roots, keyed by (device, data pointer)."""

    def __init__(self) -> None:
        self.storages: dict[tuple[str, int], _Storage] = {}
        self._seen: set[int] = set()

    def add(self, t: torch.Tensor, path: str) -> None:
        if t.device.type == "meta":
            return
        storage = t.untyped_storage()
        if storage.nbytes() == 0:
            return
        key = (str(t.device), storage.data_ptr())
        entry = self.storages.setdefault(key, _Storage(storage.nbytes()))
        entry.categories.add(classify(path))
        if len(entry.paths) < 4:
            entry.paths.append(path)

    def walk(self, root: Any, path: str) -> None:
        todo: deque[tuple[Any, str, int]] = deque([(root, path, 0)])
        while todo:
            obj, where, depth = todo.popleft()
            for child, child_path in self._children(obj, where, depth):
                todo.append((child, child_path, depth + 1))

    def _children(self, obj: Any, where: str, depth: int) -> list[tuple[Any, str]]:
        if depth > _MAX_DEPTH or obj is None or isinstance(obj, str | bytes | int | float):
            return []
        if isinstance(obj, torch.Tensor):
            self.add(obj, where)
            if id(obj) in self._seen:
                return []
            self._seen.add(id(obj))
            out = [(v, f"{where}.{k}") for k, v in vars(obj).items() if k not in _SKIP]
            if obj.is_leaf and obj.grad is not None:
                out.append((obj.grad, f"{where}.grad"))
            return out
        if isinstance(obj, nn.Module):
            return []  # parameters are walked from the module root, under their names
        if isinstance(obj, dict):
            return [(v, f"{where}[{_key(k)}]") for k, v in obj.items()]
        if isinstance(obj, list | tuple | set | frozenset | deque):
            return [(v, f"{where}[{i}]") for i, v in enumerate(obj)] + [
                (v, f"{where}.{k}") for k, v in getattr(obj, "__dict__", {}).items()
            ]
        if id(obj) in self._seen or not type(obj).__module__.startswith(_WALKED_MODULES):
            return []
        self._seen.add(id(obj))
        return [
            (v, f"{where}.{k}") for k, v in getattr(obj, "__dict__", {}).items() if k not in _SKIP
        ]

    def by_category(self) -> dict[str, int]:
        totals = dict.fromkeys(CATEGORIES, 0)
        for entry in self.storages.values():
            totals[entry.category] += entry.nbytes
        return totals

    def largest(self, n: int = 12) -> list[dict[str, Any]]:
        """The largest storages, with their category and the first names they were found under."""
        entries = sorted(self.storages.values(), key=lambda e: -e.nbytes)[:n]
        return [{"bytes": e.nbytes, "category": e.category, "paths": e.paths[:3]} for e in entries]


def _key(k: Any) -> str:
    if isinstance(k, torch.Tensor):
        return f"<tensor {tuple(k.shape)}>"
    return repr(k)[:60]


def engine_inventory(engine: Any) -> Inventory:
    """Every storage the engine holds right now."""
    if isinstance(engine, FsdpEngine):
        return fsdp_inventory(engine)
    inv = Inventory()
    for name, param in engine.module.named_parameters():
        # ZeRO-3: a partitioned parameter's .data is the full tensor only while gathered
        gathered = hasattr(param, "ds_tensor") and not getattr(param, "ds_persist", False)
        inv.walk(param, f"gathered<{name}>" if gathered else f"param<{name}>")
    inv.walk(engine.optimizer, "optimizer")
    if getattr(engine, "basic_optimizer", None) is not None:
        inv.walk(engine.basic_optimizer, "basic_optimizer")
    rest = {k: v for k, v in vars(engine).items() if k not in ("module", "optimizer")}
    inv.walk(rest, "engine")
    return inv


def _parameter_storages(module: nn.Module) -> set[tuple[str, int]]:
    """Where the module's parameters live: a DTensor's (FSDP) local shard; a parameter whose
    storage FSDP has freed (resharded) lives nowhere."""
    keys = set()
    for p in module.parameters():
        to_local = getattr(p, "to_local", None)
        t = to_local() if to_local is not None else p
        try:
            keys.add((str(t.device), t.untyped_storage().data_ptr()))
        except RuntimeError:  # "an invalid python storage": freed
            continue
    return keys


def fsdp_inventory(engine: FsdpEngine) -> Inventory:
    """FSDP2's local storages: shards (and, while gathered, unsharded parameters), their
    gradients, Adam's state. A gathered unit's module holds its unsharded parameters, not
    its shards, which FSDP keeps (`FSDPParam.sharded_param`): walked from its groups."""
    inv = Inventory()
    for name, param in engine.module.named_parameters():
        sharded = hasattr(param, "to_local")
        inv.walk(local(param), f"param<{name}>" if sharded else f"gathered<{name}>")
        if param.grad is not None:  # a gathered unit's gradient before its reduce-scatter
            grad = f"param<{name}>.grad" if sharded else f"gathered<{name}>.unsharded_grad"
            inv.walk(local(param.grad), grad)
    for group in fsdp_groups(engine):
        for fsdp_param in group.fsdp_params:  # a storage walked above counts once
            name = fsdp_param._param_fqn or "unit"
            inv.walk(local(fsdp_param.sharded_param), f"param<{name}>")
    for i, state in enumerate(engine.optimizer.state.values()):
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                inv.walk(local(value), f"optimizer.state[{i}].{key}")
    return inv


def fsdp_groups(engine: FsdpEngine) -> list[Any]:
    """FSDP2's parameter group of every unit (torch 2.13 `FSDPParamGroup`), root included."""
    groups = []
    for module in engine.module.modules():
        state = getattr(module, "_get_fsdp_state", None)
        group = state()._fsdp_param_group if state is not None else None
        if group is not None:
            groups.append(group)
    return groups


def fsdp_in_flight(engine: FsdpEngine) -> list[tuple[torch.Tensor, str]]:
    """FSDP2's buffers its module does not hold (torch 2.13 `_fsdp_param_group`): a unit's
    all-gather output while pending (prefetched; its parameters are swapped in only at its
    own pre-forward or pre-backward), the reduce-scatter inputs kept for the next unit, and
    with a hybrid mesh each unit's all-reduced shard, kept to the backward's end."""
    found: list[tuple[torch.Tensor, str]] = []
    groups = fsdp_groups(engine)
    for group in groups:
        if group._all_gather_result is not None:
            found.append((group._all_gather_result.all_gather_output, "fsdp.all_gather_output"))
        if group._all_reduce_state is not None:  # a hybrid mesh's shard, kept to the end
            found.append((group._all_reduce_state.all_reduce_input, "fsdp.reduce_scatter_output"))
    for kept in groups[0].comm_ctx.reduce_scatter_states if groups else []:
        found.append((kept.reduce_scatter_input, "fsdp.reduce_scatter_input"))
    return found


class SavedTensors:
    """Bytes of the storages autograd saves for backward while active (parameters excluded)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.storages: dict[tuple[str, int], int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def __enter__(self) -> SavedTensors:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        if storage.nbytes() and key not in _parameter_storages(self.module):
            self.storages[key] = storage.nbytes()
        return t

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    @property
    def total_bytes(self) -> int:
        return sum(self.storages.values())
