"""The real train worker, except that rank 1 raises in the case named "bad" (after DeepSpeed
is initialised, so rank 0 is left waiting in a collective until it is stopped)."""

import os
import sys
from typing import Any

from zsim.validate import train_worker

_train = train_worker.train


def train(case: dict[str, Any]) -> dict[str, Any]:
    if case["name"] == "bad" and os.environ.get("RANK") == "1":
        raise RuntimeError("injected failure on rank 1")
    return _train(case)


train_worker.train = train
sys.exit(train_worker.main(sys.argv[1:]))
