"""The seeds' stage-selection table, computed: writes docs/playbook.md (between its markers).

    python benchmarks/playbook.py [--no-write]

For each row of seed 000's table (section 4.1), what `zsim plan` recommends on a matching
cluster, beside the seed's recommendation and the best layout zsim finds at the seed's stages;
tests/test_plan.py recomputes the recommendations and holds them to this page.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from results_md import write_block

from zsim.plan.playbook import ROWS, answer

DOC = Path(__file__).resolve().parent.parent / "docs" / "playbook.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    lines = [
        "| scenario | cluster, global batch | the seed | zsim plan | tokens/s | best at the "
        "seed's stages | tokens/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in ROWS:
        a = answer(row)
        rate = "" if a.tokens_per_s is None else f"{a.tokens_per_s:,.0f}"
        seed_rate = "" if a.seed_tokens_per_s is None else f"{a.seed_tokens_per_s:,.0f}"
        lines.append(
            f"| {row.scenario} | {row.model} on {row.topology}, {row.global_batch} | {row.seed} "
            f"| {a.layout} | {rate} | {a.seed_layout} | {seed_rate} |"
        )
        print(lines[-1], file=sys.stderr, flush=True)
    block = "\n".join(lines) + "\n"
    print(block)
    if not args.no_write:
        write_block(DOC, block)
    return 0


if __name__ == "__main__":
    sys.exit(main())
