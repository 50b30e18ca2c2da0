"""The machine's speed, probed around calibration and validation runs (needs torch).

A profile predicts a run only if the machine ran as fast during the run as during the
calibration; on a shared VM it may not (between two runs of one layout three hours apart,
2026-12-05, its GEMMs moved 9 % and its copies 19 %, its steps 28-43 %). The probe times three
fixed operations, one process per rank beside each other as the runs use the cores: a
GPT-sized GEMM, a 64 MiB copy and a 64 MiB add. The validation loop probes before a layout's
calibration, before each validation and at the end (`drift.json`); `zsim calibrate` on CPU
ranks probes after measuring and keeps it in the profile's provenance (`speed_probe_s`);
`zsim validate` probes before each round of launches on CPU ranks (`probes.json` in its
folder). Nothing here feeds a profile's rates or a prediction.

The rule for a round whose machine is not the calibration's (set 2026-12-05, before any run
used it): where the profile holds a probe, a round starts only when every operation's probe
is within DRIFT_LIMIT_PCT of it; else the probe is repeated WAIT_S later, RETRIES times at
most, and the round then runs marked as drifted. A case's step is the median of its rounds
that were not drifted, of all of them where every one was (and its detail says so).

    python -m zsim.calibrate.speed [--ranks 2]   # prints the seconds as JSON
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

DRIFT_LIMIT_PCT = 10.0
REPEATS = 15
WAIT_S = 30.0
RETRIES = 3
Probe = dict[str, float]


def median_s(run: Callable[[], object], repeats: int = REPEATS) -> float:
    """Median wall-clock seconds of `run` over `repeats` calls."""
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def probe() -> dict[str, float]:
    """Median seconds of a GPT-sized GEMM, a 64 MiB copy and a 64 MiB add, one thread."""
    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(512, 768), torch.randn(768, 3072)
    src, dst = torch.randn(16 * 2**20), torch.empty(16 * 2**20)
    x, y = torch.randn(16 * 2**20), torch.randn(16 * 2**20)
    return {
        "gemm_512x3072x768_s": median_s(lambda: torch.mm(a, b)),
        "copy_64MiB_s": median_s(lambda: dst.copy_(src)),
        "add_64MiB_s": median_s(lambda: x.add_(y, alpha=0.5)),
    }


def probe_ranks(ranks: int) -> dict[str, float]:
    """Each operation's slowest median over `ranks` processes run beside each other."""
    command = [sys.executable, "-m", "zsim.calibrate.speed", "--one"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(command, stdout=subprocess.PIPE, env=env) for _ in range(ranks)]
    results = [json.loads(p.communicate()[0]) for p in procs]
    return {k: max(r[k] for r in results) for k in results[0]}


def spread_pct(probes: list[dict[str, float]]) -> dict[str, float]:
    """Each operation's slowest probe over its fastest, less one, in percent."""
    return {k: 100.0 * (max(p[k] for p in probes) / min(p[k] for p in probes) - 1.0)
            for k in probes[0]}  # fmt: skip


def drift_pct(reference: Probe, probed: Probe) -> Probe:
    """Each operation's time against the reference's, less one, in percent."""
    return {k: 100.0 * (probed[k] / reference[k] - 1.0) for k in reference if k in probed}


def within(reference: Probe | None, probed: Probe) -> bool:
    """Whether the machine runs as fast as when the reference was probed (no reference: yes)."""
    if not reference:
        return True
    return all(abs(x) <= DRIFT_LIMIT_PCT for x in drift_pct(reference, probed).values())


def settled_round(
    out_dir: Path,
    launch: int,
    ranks: int,
    reference: Probe | None = None,
    measure: Callable[[int], Probe] = probe_ranks,
    wait: Callable[[float], None] = time.sleep,
) -> bool:
    """Probe before a round of launches, again WAIT_S later while it is off the reference
    (RETRIES times at most), each probe appended to `out_dir/probes.json`; whether the round
    runs on the reference's machine (the module's rule)."""
    path = out_dir / "probes.json"
    rounds = json.loads(path.read_text()) if path.exists() else []
    out_dir.mkdir(parents=True, exist_ok=True)
    for attempt in range(RETRIES + 1):
        if attempt:
            wait(WAIT_S)
        probed = measure(ranks)
        ok = within(reference, probed)
        at = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        entry: dict[str, object] = {"round": launch, "at": at, "probe_s": probed}
        if reference:
            entry |= {"drift_pct": drift_pct(reference, probed), "within": ok}
        rounds.append(entry)
        path.write_text(json.dumps(rounds, indent=1) + "\n")
        if ok:
            return True
    return False


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    print(json.dumps(probe() if args.one else probe_ranks(args.ranks)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
