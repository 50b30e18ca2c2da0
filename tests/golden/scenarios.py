"""The golden scenarios: `zsim` command lines whose `--json` output is recorded in
`outputs.json`, so that a change that should move no number (a refactoring) can prove it.

Recorded before the code was reorganised into packages (issue 12); a later change that moves a
number re-records the file and says in its commit why the number moved.
"""

from __future__ import annotations

import shlex
from pathlib import Path

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
CAL = ROOT / "calibration"
DS = HERE / "ds_config.json"
DS_OFFLOAD = HERE / "ds_config_offload.json"
IDEAL = ROOT / "tests" / "data" / "ideal-8.yaml"
CPU_MLP = "--model toy-mlp --hidden 1024 --micro-batch 4 --precision fp32"


def _cpu(topology: str, profile: str, rest: str) -> str:
    return f"run --topology {topology} --profile {CAL / profile}.json {CPU_MLP} {rest}"


_LINES = {
    # ZeRO stages on the default cluster (1x8 NVLink, gpt-1.3b) and on 2 x 4 over Ethernet
    "run-default": "run",
    **{f"run-1x8-z{s}": f"run --stage {s}" for s in range(4)},
    "run-2x4-eth-z3": "run --topology 2x4-ethernet --stage 3",
    "run-2x4-eth-z2-accum4": "run --topology 2x4-ethernet --stage 2 --grad-accum 4",
    "run-2x4-eth-z1-overlap": "run --topology 2x4-ethernet --stage 1 --overlap-comm",
    "run-z3-prefetch-knobs": "run --topology 2x4-ethernet --stage 3 --prefetch-bucket-size 2e7 "
    "--max-reuse-distance 1 --param-persistence-threshold 1e4",
    "run-z0-fp32": "run --stage 0 --precision fp32 --model gpt-350m",
    "run-z2-bf16-recompute-full": "run --stage 2 --precision bf16 --recompute full",
    "run-z1-recompute-selective": "run --stage 1 --recompute selective",
    # TP, sequence parallelism, flash attention
    "run-tp8-sp": "run --model gpt-6.7b --tp 8 --sequence-parallel --micro-batch 1",
    "run-tp4-dp2-flash-z1": "run --model gpt-2.7b --tp 4 --stage 1 --flash-attention",
    "run-2x8-h100-tp8-z1": "run --topology 2x8-dgx-h100 --model llama-7b --tp 8 --stage 1 "
    "--micro-batch 2 --grad-accum 2",
    # pipelines: both engines, every schedule
    "run-pp4-deepspeed": "run --tp 2 --pp 4 --micro-batch 2 --grad-accum 8",
    "run-pp4-deepspeed-bf16-z1": "run --pp 4 --stage 1 --precision bf16 --micro-batch 1 "
    "--grad-accum 6",
    "run-pp2-megatron-gpipe": "run --tp 2 --pp 2 --pipeline-engine megatron --pp-schedule gpipe "
    "--micro-batch 1 --grad-accum 4",
    "run-pp2-megatron-1f1b": "run --tp 4 --pp 2 --pipeline-engine megatron --micro-batch 1 "
    "--grad-accum 6",
    "run-pp4-megatron-interleaved": "run --tp 2 --pp 4 --pipeline-engine megatron "
    "--pp-schedule interleaved --virtual-stages 2 --micro-batch 1 --grad-accum 8",
    "run-2x8-pp4-tp4-sp": "run --topology 2x8-dgx-a100 --model gpt-13b --tp 4 --pp 4 "
    "--sequence-parallel --pipeline-engine megatron --micro-batch 1 --grad-accum 8 --stage 1",
    # fabrics: PCIe + IB, RoCE rails, one GPU per node, a cluster file; every rank (--full)
    "run-4x8-roce-llama-z3": "run --topology 4x8-roce --model llama-7b --stage 3 --micro-batch 1",
    "run-4x4-ib-z2": "run --topology 4x4-ib --stage 2 --micro-batch 2",
    "run-8x1-ib-z3": "run --topology 8x1-ib --stage 3 --micro-batch 2",
    "run-ideal-file-z3": f"run --topology {IDEAL} --stage 3",
    "run-2x4-eth-full-z3": "run --topology 2x4-ethernet --stage 3 --full",
    "run-2x4-eth-full-pp2": "run --topology 2x4-ethernet --pp 2 --tp 2 --full --micro-batch 1 "
    "--grad-accum 4",
    # offload, with the host side of a calibrated profile
    "run-cpu-offload-opt-z2": _cpu("1x2-cpu", "cpu-2rank", "--stage 2 --offload optimizer"),
    "run-cpu-offload-params-z3": _cpu(
        "1x2-cpu", "cpu-2rank", "--stage 3 --offload optimizer+params"
    ),
    # the CPU and emulated topologies with their committed profiles
    **{f"run-cpu-1x2-z{s}": _cpu("1x2-cpu", "cpu-2rank", f"--stage {s}") for s in range(4)},
    "run-cpu-1x4-z2": _cpu("1x4-cpu", "cpu-4rank", "--stage 2"),
    "run-cpu-2x2-emulated-z3": _cpu("2x2-cpu-1000mbit", "cpu-2x2-1gbit", "--stage 3"),
    "run-cpu-2x4-emulated-z1": _cpu("2x4-cpu-1000mbit", "cpu-2x4-1gbit", "--stage 1"),
    # a DeepSpeed config file
    "run-ds-config": f"run --ds-config {DS} --topology 4x8-roce --model llama-7b",
    # 1,024 GPUs
    "run-1024-gpt13b-3d": "run --topology 128x8-dgx-a100 --model gpt-13b --tp 8 --pp 4 "
    "--micro-batch 1 --grad-accum 8 --stage 1",
    # the memory ledger
    "memory-seed-7.5b": "memory --params 7.5e9 --dp 64",
    "memory-seed-30b": "memory --params 30e9 --dp 16 --gpu a100-80gb",
    "memory-175b-tp8": "memory --model gpt-175b --tp 8 --dp 8 --micro-batch 1 --grad-accum 16 "
    "--recompute full",
    "memory-llama70b-offload": f"memory --ds-config {DS_OFFLOAD} --model llama-70b "
    "--recompute selective --flash-attention",
    "memory-ds-config": f"memory --ds-config {DS} --model llama-7b",
    # collectives
    "collective-2x4-eth-allgather-dp": "collective --topology 2x4-ethernet --op all_gather "
    "--group dp --sizes 1K..1G",
    "collective-2x8-h100-allreduce": "collective --topology 2x8-dgx-h100 --op all_reduce "
    "--sizes 8..256M",
    "collective-4x8-roce-tree": "collective --topology 4x8-roce --op all_reduce --algorithm tree "
    "--sizes 1M,64M",
    "collective-2x8-hierarchical-rs": "collective --topology 2x8-dgx-a100 --op reduce_scatter "
    "--algorithm hierarchical --sizes 4M,256M",
    "collective-tp-all-groups": "collective --topology 2x8-dgx-a100 --op all_reduce --group tp "
    "--tp 8 --all-groups --sizes 16M",
    **{
        f"collective-cpu-2x2-{op}": f"collective --topology 2x2-cpu-1000mbit --op {op} "
        "--sizes 8,64K,16M"
        for op in (
            "all_reduce",
            "all_gather",
            "reduce_scatter",
            "broadcast",
            "reduce",
            "send_recv",
            "all_to_all",
        )
    },
    # topology summaries
    "topology-2x8-dgx-h100": "topology 2x8-dgx-h100",
    "topology-2x2-cpu": "topology 2x2-cpu-1gbit",
}

SCENARIOS: dict[str, list[str]] = {name: shlex.split(line) for name, line in _LINES.items()}
