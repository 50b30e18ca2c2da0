"""Record the golden outputs: `python -m tests.golden.record` (from the repository root).

Only for a change that is meant to move numbers: say in its commit which moved and why.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from typing import Any

from tests.golden.scenarios import HERE, ROOT, SCENARIOS
from zsim.cli import main

OUTPUTS = HERE / "outputs.json"


def output(argv: list[str]) -> Any:
    """The parsed `--json` output of one zsim command, with this checkout's root as `ROOT`."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        code = main([*argv, "--json"])
    if code not in (0, 3):  # 3: the layout does not fit, and the output says so
        raise RuntimeError(f"zsim {' '.join(argv)} exited {code}")
    return json.loads(buffer.getvalue().replace(str(ROOT), "ROOT"))


def main_record(names: list[str]) -> int:
    recorded = json.loads(OUTPUTS.read_text()) if OUTPUTS.exists() else {}
    for name in names or SCENARIOS:
        print(name, file=sys.stderr)
        recorded[name] = output(SCENARIOS[name])
    recorded = {k: recorded[k] for k in SCENARIOS if k in recorded}
    OUTPUTS.write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main_record(sys.argv[1:]))
