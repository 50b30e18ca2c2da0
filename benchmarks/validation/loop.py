"""The whole local loop, on demand (`make validate`): for each layout, calibrate its profile from
microbenchmarks, then validate ZeRO stages 0-3 against real DeepSpeed runs with it (each case
the median of 3 launches; on 1x2 also a small GPT, data parallel and Megatron-style tp 2, and
DeepSpeed's PipelineEngine at pp 2, PyTorch FSDP2 (also on 1x4); on emulated 2x2 also ZeRO-3 with
ZeRO++'s hpZ and FSDP2 with hybrid sharding), then write the tables of README.md here and exit
non-zero when the MAPE over every case exceeds 10 %.

    python benchmarks/validation/loop.py [--layouts 1x2,1x2-pp,1x2-fsdp,1x4,1x4-gpt,2x2,2x4]
        [--reuse-profiles] [--calibrate-only] [--launches 3]

The emulated layouts (2x2, 2x4: network namespaces joined by tc-shaped veth links) need root.
Each profile is calibrated just before its validation, one run at a time: the machine should
be otherwise idle. --reuse-profiles validates with the committed profiles instead. A speed
probe (`zsim.calibrate.speed`) runs before each layout's calibration, before each of its validations
and after the last; `drift.json` keeps how far the machine's speed spread between them, and a layout
whose probe spread more than 10 % is flagged.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from summarize import (  # this folder's script: run as a script, it is on the path
    case_rows,
    mape_pct,
)

from zsim.calibrate.speed import DRIFT_LIMIT_PCT, probe_ranks, spread_pct

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
MODEL = "toy-mlp:hidden=1024"
MAPE_LIMIT_PCT = 10.0
EMULATED_SIZES = ("--max-size", str(64 * 2**20))  # 256 MiB over 1 Gbit/s: 2 s a call


@dataclass(frozen=True)
class Validation:
    folder: str  # benchmarks/validation/<folder>
    args: tuple[str, ...]  # zsim validate's arguments beyond --profile/--model/--out
    model: str = MODEL


@dataclass(frozen=True)
class Layout:
    profile: str  # calibration/<profile>.json
    calibrate: tuple[str, ...]  # zsim calibrate's arguments beyond --name/--out
    validations: tuple[Validation, ...]
    ranks: int = 2  # processes its runs put on the host's cores (the speed probe's too)


ON_1X2 = ("--topology", "1x2-cpu", "--steps", "8")
CONFIGS = "benchmarks/validation/ds_configs"  # ds_configs the loop validates as given
ON_2X2 = ("--topology", "2x2-cpu-1gbit", "--emulate", "--steps", "5")
# a GPT small enough that its 12 launches of 4 stages take minutes: gpt-125m's blocks, two
# of them, a 8,192-token vocabulary (50,257 makes the LM head 3.7 s of a step)
GPT = "gpt-125m:layers=2,seq-len=128,vocab=8192"
LAYOUTS = {
    "1x2": Layout(
        "cpu-2rank",
        ("--nproc", "2", "--model", MODEL, "--model", GPT, "--tp", "1,2"),
        (
            Validation("cpu-1x2", ON_1X2),
            Validation("cpu-1x2-gpt", (*ON_1X2, "--warmup", "5"), GPT),
            Validation("cpu-1x2-gpt-tp2", (*ON_1X2, "--warmup", "5", "--tp", "2"), GPT),
        ),
    ),
    "1x2-pp": Layout(  # DeepSpeed's PipelineEngine, its own profile calibrated just before
        "cpu-2rank-pipe",
        ("--nproc", "2", "--model", MODEL),
        (
            Validation(
                "cpu-1x2-pp2", (*ON_1X2, "--pp", "2", "--grad-accum", "4", "--stages", "0,1")
            ),
        ),
    ),
    "1x2-fsdp": Layout(  # PyTorch FSDP2, its own profile (with FSDP's host time) just before
        "cpu-2rank-fsdp",
        ("--nproc", "2", "--model", MODEL),
        (
            Validation(
                "cpu-1x2-fsdp",
                (*ON_1X2, "--engine", "fsdp", "--sharding", "full,grad-op", "--grad-accum", "2"),
            ),
        ),
    ),
    "1x4": Layout(
        "cpu-4rank",
        ("--nproc", "4", "--model", MODEL, "--micro-batches", "4"),
        (
            Validation("cpu-1x4", ("--topology", "1x4-cpu", "--steps", "8")),
            Validation(  # PyTorch FSDP2 on 4 ranks of one host
                "cpu-1x4-fsdp",
                (
                    *("--topology", "1x4-cpu", "--steps", "8", "--engine", "fsdp"),
                    *("--sharding", "full,grad-op", "--grad-accum", "2"),
                ),
            ),
        ),
        ranks=4,
    ),
    "1x4-gpt": Layout(  # tp 2 x dp 2: Megatron's TP groups inside DeepSpeed's ZeRO
        "cpu-4rank-gpt",
        ("--nproc", "4", "--model", GPT, "--tp", "1,2", "--micro-batches", "4"),
        (
            Validation(
                "cpu-1x4-gpt-tp2",
                ("--topology", "1x4-cpu", "--steps", "8", "--warmup", "5", "--tp", "2"),
                GPT,
            ),
        ),
        ranks=4,
    ),
    "2x2": Layout(
        "cpu-2x2-1gbit",
        (
            "--emulate",
            "2x2-cpu-1gbit",
            "--nproc",
            "2",
            "--model",
            MODEL,
            "--micro-batches",
            "4",
            *EMULATED_SIZES,
        ),
        (
            Validation(
                "cpu-2x2-1gbit-emulated",
                ON_2X2,
            ),
            Validation(  # ZeRO-3 with 2 micro-batches, beside ZeRO++'s hpZ within a node
                "cpu-2x2-z3-accum2-emulated",
                (*ON_2X2, "--warmup", "5", "--ds-config", f"{CONFIGS}/z3-accum2.json"),
            ),
            Validation(
                "cpu-2x2-hpz2-emulated",
                (*ON_2X2, "--warmup", "5", "--ds-config", f"{CONFIGS}/z3-hpz2-accum2.json"),
            ),
            Validation(  # PyTorch FSDP2, hybrid sharding within a node, replicated across
                "cpu-2x2-fsdp-emulated",
                (
                    *ON_2X2,
                    "--warmup",
                    "5",
                    "--engine",
                    "fsdp",
                    "--sharding",
                    "full,grad-op,hybrid",
                    "--grad-accum",
                    "2",
                ),
            ),
        ),
        ranks=4,
    ),
    "2x4": Layout(
        "cpu-2x4-1gbit",
        (
            "--emulate",
            "2x4-cpu-1gbit",
            "--nproc",
            "4",
            "--model",
            MODEL,
            "--micro-batches",
            "4",
            *EMULATED_SIZES,
        ),
        (
            Validation(
                "2x4-ethernet-z3-emulated",
                ("--topology", "2x4-ethernet", "--emulate", "--stages", "3", "--steps", "5"),
            ),
        ),
        ranks=8,
    ),
}


def zsim(*args: str) -> None:
    command = [sys.executable, "-m", "zsim", *args]
    print(f"[loop] {time.strftime('%H:%M:%S')} {' '.join(command[2:])}", flush=True)
    subprocess.run(command, cwd=ROOT, check=True)


def run(name: str, layout: Layout, reuse: bool, calibrate_only: bool, launches: int) -> None:
    """Calibrate the layout's profile, then validate with it; the speed probe at the start,
    before each validation (the first just after the calibration) and at the end."""
    profile, started = f"calibration/{layout.profile}.json", time.strftime("%Y-%m-%dT%H:%M:%S%z")
    probes = {"start": probe_ranks(layout.ranks)}
    if not reuse:
        zsim("calibrate", *layout.calibrate, "--name", layout.profile, "--out", profile,
             "--force")  # fmt: skip
    if calibrate_only:
        return
    for v in layout.validations:
        probes[f"before {v.folder}"] = probe_ranks(layout.ranks)
        zsim("validate", "--profile", profile, "--model", v.model, "--launches", str(launches),
             *v.args, "--out", f"benchmarks/validation/{v.folder}")  # fmt: skip
    probes["end"] = probe_ranks(layout.ranks)
    _record_drift(name, probes, started)


def _record_drift(name: str, probes: dict[str, dict[str, float]], started: str) -> None:
    """A layout's speed probes (`zsim.calibrate.speed`) and their spread, kept in drift.json."""
    spread = spread_pct(list(probes.values()))
    flagged = any(x > DRIFT_LIMIT_PCT for x in spread.values())
    path = HERE / "drift.json"
    kept = json.loads(path.read_text()) if path.exists() else {}
    ended = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    kept[name] = {"started": started, "ended": ended, "probes_s": probes,
                  "spread_pct": spread, "flagged": flagged}  # fmt: skip
    path.write_text(json.dumps(kept, indent=1, sort_keys=True) + "\n")
    shown = ", ".join(f"{k} {v:.1f}%" for k, v in spread.items())
    print(f"[loop] {name}: the machine's speed spread {shown} over the layout's run"
          + (f": over {DRIFT_LIMIT_PCT:.0f}%, flagged" if flagged else ""), flush=True)  # fmt: skip


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--reuse-profiles", action="store_true")
    parser.add_argument(
        "--calibrate-only",
        action="store_true",
        help="calibrate the profiles, then predict the committed runs again with them",
    )
    parser.add_argument(
        "--launches", type=int, default=3, help="launches per case (the step: their median)"
    )
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.layouts.split(",") if n.strip()]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        print(f"zsim: error: --layouts {','.join(unknown)}: one of {', '.join(LAYOUTS)}")
        return 2
    for name in names:
        run(name, LAYOUTS[name], args.reuse_profiles, args.calibrate_only, args.launches)
    summarize = [sys.executable, str(HERE / "summarize.py"), "--write"]
    subprocess.run(summarize + (["--repredict"] if args.calibrate_only else []), check=True)
    folders = [HERE / v.folder for layout in LAYOUTS.values() for v in layout.validations]
    missing = [f.name for f in folders if not (f / "predicted_vs_measured.csv").exists()]
    if missing:  # a case added to the loop but not run yet
        print(f"[loop] not run yet, left out of the MAPE: {', '.join(missing)}")
    mape = mape_pct(case_rows([f for f in folders if f.name not in missing]))
    print(f"[loop] MAPE over every committed case: {mape:.1f}% (limit {MAPE_LIMIT_PCT:.0f}%)")
    return 0 if mape <= MAPE_LIMIT_PCT else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
