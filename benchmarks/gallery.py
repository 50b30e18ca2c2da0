"""The README's gallery: figures made by zsim's own commands, written to docs/gallery/.

    python benchmarks/gallery.py

A timeline of ZeRO-3 over 100 GbE, a plan's throughput-memory frontier and a cluster drawing;
the predicted-vs-measured plot is the committed validation run's own
(benchmarks/validation/cpu-2x2-1gbit-emulated/predicted_vs_measured.png).
"""

from __future__ import annotations

import sys
from pathlib import Path

from zsim.cli import main as zsim

GALLERY = Path(__file__).resolve().parent.parent / "docs" / "gallery"

COMMANDS = (
    ["run", "--topology", "2x4-ethernet", "--stage", "3", "--plot", "timeline-zero3-ethernet.png"],
    ["plan", "--model", "llama-70b", "--topology", "8x8-dgx-h100", "--global-batch", "1024",
     "--top", "5", "--plot", "frontier-llama70b.png"],
    ["topology", "2x8-dgx-h100", "--plot", "cluster-2x8-dgx-h100.png"],
)  # fmt: skip


def main() -> int:
    GALLERY.mkdir(parents=True, exist_ok=True)
    for argv in COMMANDS:
        where = argv.index("--plot") + 1
        argv = [*argv[:where], str(GALLERY / argv[where]), *argv[where + 1 :]]
        print("zsim", " ".join(argv), file=sys.stderr, flush=True)
        code = zsim(argv)
        if code not in (0, 1):
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
